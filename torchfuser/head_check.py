"""Which LM head runs: the fused LM head + loss that ``optimize`` installed, or another that bypasses it.

The fused LM head + loss is the model's instance ``forward``; it runs when the model is called in
training mode with labels. A trainer can compute its loss without it: TRL's SFT and DPO trainers put
their own fused head on the model's forward after ``TorchFuserCallback`` ran (``add_fused_lm_head``),
and a trainer that calls the model without labels computes the loss from the logits itself. The report
must not call such a head fused, so ``torchfuser.report`` asks here, each time:

- the instance forward is TRL's head: bypassed, and a note says "LM head: TRL's chunked kernels run
  (fused_lm_head=True)" (TRL's trainers call only that head; docs/performance/NOTES-trl.md);
- the fused forward is gone from the model: bypassed;
- the fused forward is there but made no call while the Trainer took steps (``TorchFuserCallback``
  records the steps in ``idle_steps``): bypassed (the trainer's own head and loss run);
- another wrapper: fused, with the count of fused calls so far, for the reader to judge;

and every fused head's note gives its count of fused calls (``FusedLMHeadLoss.calls``: eager calls,
one increment each).
"""
from __future__ import annotations

import dataclasses

from torch import nn

from torchfuser.modules.lm_head import FusedLMHeadLoss
from torchfuser.patterns.lm_head import trl_head
from torchfuser.report import Entry

HEAD = "lm_head_loss: "  # every note made here starts so, to be replaced when the report is refreshed
# Which head runs under TRL's trainers, said in one line (docs/performance/NOTES-trl.md: why TRL's stays on).
TRL_RUNS = "LM head: TRL's chunked kernels run (fused_lm_head=True)"
_NOT_COUNTED = "calls traced by torch.compile are not counted"


def fused_heads(model: nn.Module, st) -> dict[str, FusedLMHeadLoss]:
    """{qualified name: the fused LM head + loss optimize installed there} (what the walker's undos hold)."""
    names = {id(m): n for n, m in model.named_modules()}
    found = {}
    for applied in st.undo:
        fused, owner = getattr(applied.undo, "fused", None), getattr(applied.undo, "model", None)
        if isinstance(fused, FusedLMHeadLoss) and id(owner) in names:
            found[names[id(owner)]] = fused
    return found


def _calls(n: int) -> str:
    return f"{n} fused call" + ("" if n == 1 else "s")


def _what(forward) -> str:
    fn = getattr(forward, "__func__", forward)
    code = getattr(fn, "__code__", None)
    where = getattr(fn, "__globals__", {}).get("__name__") or type(forward).__module__
    return f"{where}.{code.co_qualname if code is not None else type(forward).__qualname__}"


def bypass(model: nn.Module, fused: FusedLMHeadLoss) -> str | None:
    """Why the fused LM head + loss installed on ``model`` does not run in its training calls, or None."""
    forward = model.__dict__.get("forward")
    calls = _calls(fused.calls.n)
    if trl_head(forward):
        return (f"bypassed — TRL's fused_lm_head wrapper (trl add_fused_lm_head, put on the model by its trainer) "
                f"computes the head and loss of the trainer's calls ({calls})")
    if forward is None:
        return f"bypassed — the fused forward was taken off the model since optimize ({calls})"
    steps = getattr(fused, "idle_steps", 0)
    if fused.calls.n == 0 and steps:
        return (f"bypassed — {calls} in {steps} training step{'s' if steps != 1 else ''}: the trainer computes its "
                "loss without calling the model in training mode with labels, so the model's own head and the "
                "trainer's loss run")
    return None


def check(model: nn.Module, st, entries: list[Entry]) -> tuple[dict[str, Entry], list[str]]:
    """({name: the entry as it must read now}, notes) for the fused LM heads among ``entries``."""
    heads = fused_heads(model, st)
    replaced, notes = {}, []
    for e in entries:
        fused = heads.get(e.name) if e.pattern == "lm_head_loss" and e.is_fused else None
        if fused is None:
            continue
        owner = model.get_submodule(e.name) if e.name else model
        why = bypass(owner, fused)
        if why is not None:
            replaced[e.name] = dataclasses.replace(e, fused=None, backend=None, reason=why)
            notes.append(f"{HEAD}{why}")
            if trl_head(owner.__dict__.get("forward")):
                notes.append(f"{HEAD}{TRL_RUNS}: per-token log-probs (and entropy, top-1 flags as the trainer asks) "
                             "come from trl.kernels.chunked_logprob; the other fused blocks run TorchFuser's kernels")
            continue
        forward = owner.__dict__.get("forward")
        wrapped = "" if forward is fused else f"; the model's forward was replaced since optimize by {_what(forward)}"
        notes.append(f"{HEAD}{_calls(fused.calls.n)} so far (training calls with labels; {_NOT_COUNTED}){wrapped}")
    return replaced, notes
