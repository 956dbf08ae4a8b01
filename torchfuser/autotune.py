"""Keep only what is faster: time each fused block kind against the module it replaced, at the
shapes of the model's first training call, and put the original back where it wins.

    torchfuser.optimize(model)
    torchfuser.autotune.apply(model)   # decides at the first forward with autograd on

Decisions are cached in memory for the process, per block kind, spec, device, dtypes and input
shapes (nothing is written to disk: timings belong to one machine under one load). Either choice
computes what the original computes within the numerics rule (the fused module is held to it
against the original), so a decision changes speed, not results beyond that rule.
"""
from __future__ import annotations

import dataclasses
import time
from collections import Counter

import torch
from torch import nn

from torchfuser import unwrap, walker
from torchfuser.modules import decode
from torchfuser.modules.base import FusedModule, hand_back, host_reads_allowed
from torchfuser.modules.residual_norm import ResidualNormForward
from torchfuser.modules.residual_output import ResidualOutputForward
from torchfuser.patterns import _probe
from torchfuser.patterns.base import _PutBack

__all__ = ["apply", "stop", "decisions", "clear"]
UNTIMED = "autotune: left fused, not timed"  # the note on the blocks apply does not time

_HOOKS = "_torchfuser_autotune_hooks"
_DECISIONS: dict[tuple, "Decision"] = {}


@dataclasses.dataclass(frozen=True)
class Decision:
    kind: str  # the pattern name
    keep: str  # "fused" or "original"
    fused_s: float  # fastest seconds of one forward + backward
    original_s: float
    where: str  # "2×64×256 float32 on cpu"

    @property
    def speedup(self) -> float:
        return self.original_s / self.fused_s if self.fused_s > 0 else float("inf")

    def note(self) -> str:
        return f"autotune: {self.kind} kept {self.keep}: fused {self.speedup:.2f}× at {self.where}"


@dataclasses.dataclass
class _KeptOriginal:
    """Undo of a swap that autotune already took back: the original stays. An object, not a
    closure (a model saved whole keeps its undos); the fused module is dropped, so a later
    ``restore`` cannot hand the original stale tensors of a module that left the model."""

    parent: nn.Module
    attr: str
    original: nn.Module

    def __call__(self) -> None:
        self.parent._modules[self.attr] = self.original


def decisions() -> dict[tuple, Decision]:
    """The cached decisions, {key: Decision}."""
    return dict(_DECISIONS)


def clear() -> None:
    _DECISIONS.clear()


def time_call(module: nn.Module, args, kwargs, device: torch.device) -> float:
    """Seconds of one forward and backward of ``module`` (tests replace this with a fake clock)."""
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda *a: None)
    sync(device)
    start = time.perf_counter()
    _forward_backward(module, args, kwargs)
    sync(device)
    return time.perf_counter() - start


def _tensors(tree):
    if isinstance(tree, torch.Tensor):
        yield tree
    elif isinstance(tree, (tuple, list)):
        for t in tree:
            yield from _tensors(t)
    elif isinstance(tree, dict):
        for t in tree.values():
            yield from _tensors(t)


def _forward_backward(module, args, kwargs) -> None:
    out = [t for t in _tensors(module(*args, **kwargs)) if t.requires_grad]
    wrt = [t for t in _tensors((args, kwargs)) if t.requires_grad] + [p for p in module.parameters() if p.requires_grad]
    # autograd.grad, not backward(): the parameters' .grad must not collect the probe's gradients.
    torch.autograd.grad(out, wrt, [torch.ones_like(t) for t in out], allow_unused=True)


def _detached(tree):
    """The call's inputs cut from the model's graph (the same values; grads only where it had them)."""
    if isinstance(tree, torch.Tensor):
        return tree.detach().requires_grad_(tree.requires_grad and tree.is_floating_point())
    if isinstance(tree, tuple) and not hasattr(tree, "_fields"):
        return tuple(_detached(t) for t in tree)
    if isinstance(tree, list):
        return [_detached(t) for t in tree]
    if isinstance(tree, dict):
        return {k: _detached(v) for k, v in tree.items()}
    return tree


def _signature(module: FusedModule, kind: str, args, kwargs) -> tuple[tuple, str]:
    tensors = list(_tensors((args, kwargs)))
    first = tensors[0]
    amp = torch.get_autocast_dtype(first.device.type) if torch.is_autocast_enabled(first.device.type) else None
    shapes = tuple((tuple(t.shape), t.dtype) for t in tensors)
    params = tuple((tuple(p.shape), p.dtype) for p in module.parameters())
    key = (kind, repr(module.spec), str(first.device), amp, shapes, params)
    where = "×".join(map(str, first.shape)) + f" {str(first.dtype).removeprefix('torch.')}"
    where += f" (autocast {str(amp).removeprefix('torch.')})" if amp else ""
    return key, f"{where} on {first.device}"


def _measure(fused: FusedModule, original: nn.Module, args, kwargs, repeats: int) -> tuple[float, float]:
    """Fastest seconds of (fused, original), alternating which goes first, after one warm-up each
    (kernel compilation, allocator growth). The fastest, not the median: on a shared machine other
    jobs only ever add time, and a few runs' median still moves with them (timeit's reasoning)."""
    device = next(_tensors((args, kwargs))).device
    times = {id(fused): [], id(original): []}
    order = [fused, original]
    # Dropout draws in the probe must not move the user's random streams.
    with _probe.saved_rng(), torch.enable_grad():
        for m in order:
            _forward_backward(m, _detached(args), _detached(kwargs))
        for _ in range(repeats):
            for m in order:
                times[id(m)].append(time_call(m, _detached(args), _detached(kwargs), device))
            order.reverse()
    return min(times[id(fused)]), min(times[id(original)])


class _Tuner:
    """A forward pre-hook on one fused block: decides at its first training call, then goes."""

    def __init__(self, target: nn.Module, name: str, kind: str, applied, repeats: int, margin: float):
        self.target, self.name, self.kind, self.applied = target, name, kind, applied
        self.repeats, self.margin = repeats, margin
        self.handle = None

    def __call__(self, module, args, kwargs):
        if not (torch.is_grad_enabled() and module.training and host_reads_allowed()):
            return None  # evaluation, a compile trace or a CUDA graph capture: wait for a training call
        if not any(t.is_floating_point() for t in _tensors((args, kwargs))) or not _empty_caches(module, kwargs):
            return None
        kwargs = {k: None if k in _CACHES else v for k, v in kwargs.items()}  # probes must not append to it
        self.handle.remove()
        key, where = _signature(module, self.kind, args, kwargs)
        decision = _DECISIONS.get(key)
        st = walker.state(self.target)
        if decision is None:
            original = self.applied.undo.original
            hand_back(module, original)  # the original computes with what the fused module holds now
            fused_s, original_s = _measure(module, original, args, kwargs, self.repeats)
            slower = original_s * (1 + self.margin) < fused_s
            decision = _DECISIONS[key] = Decision(self.kind, "original" if slower else "fused", fused_s, original_s, where)
        if st is not None and decision.note() not in st.report.notes:
            st.report.notes.append(decision.note())
        if decision.keep == "original" and st is not None:
            self._put_back(st, decision)
        return None  # this call still runs fused: its caller already chose the module

    def _put_back(self, st, decision: Decision) -> None:
        undo = self.applied.undo
        hand_back(undo.fused, undo.original)
        decode.unshare(undo.fused, undo.original)
        parent_name, _, attr = self.name.rpartition(".")
        self.target.get_submodule(parent_name)._modules[attr] = undo.original  # the live parent
        self.applied.undo = _KeptOriginal(undo.parent, undo.attr, undo.original)
        entry = next(e for e in st.report.entries if e.name == self.name)
        st.report.add(dataclasses.replace(entry, fused=None, backend=None, reason=(
            f"autotune kept the original: fused {decision.speedup:.2f}× at {decision.where}")))


_CACHES = ("cache", "past_key_values", "layer_past")  # the KV cache's names across transformers versions


def _empty_caches(module, kwargs) -> bool:
    """Whether the call's KV caches, if any, hold nothing yet: then the block computes the same
    without one (the model makes an empty cache even in training unless use_cache=False)."""
    for name in _CACHES:
        cache = kwargs.get(name)
        layer = getattr(module, "layer_idx", None) or 0  # the layers before this one filled theirs
        if cache is not None and (not hasattr(cache, "get_seq_length") or cache.get_seq_length(layer) > 0):
            return False
    return True


def _residual_norms(target: nn.Module) -> set[int]:
    """Norms a fused residual-add layer calls by method, not as modules: not tuned alone (the layer's
    fused forward needs them fused, and a hook on them would turn that forward off)."""
    ids = set()
    for layer in target.modules():
        fwd = layer.__dict__.get("forward")
        if isinstance(fwd, (ResidualNormForward, ResidualOutputForward)):
            ids |= {id(getattr(layer, fwd.spec.norm_in)), id(getattr(layer, fwd.spec.norm_mid))}
    return ids


def stop(model: nn.Module) -> None:
    """No more timing: the blocks not decided yet stay fused (``optimize(model, autotune=False)``); those
    already decided stay as decided."""
    _, target = unwrap.optimized(model)
    for old in (target.__dict__.pop(_HOOKS, ()) if target is not None else ()):
        old.handle.remove()


def apply(model: nn.Module, *, repeats: int = 5, margin: float = 0.03) -> nn.Module:
    """Time every fused block kind of an optimized ``model`` against its original at the first
    training call (forward and backward, ``repeats`` alternated runs each on the model's device),
    keep the faster per kind and shape, and say which in ``torchfuser.report(model).notes``.
    The original comes back only when more than ``margin`` faster: the fused block saves memory,
    and a difference within the timing noise is no reason to give that up.
    ``torchfuser.restore`` still puts every original back. Returns ``model``."""
    _, target = unwrap.optimized(model)
    st = walker.state(target) if target is not None else None
    if st is None:
        raise ValueError("torchfuser.autotune.apply: call torchfuser.optimize(model) first")
    for old in target.__dict__.pop(_HOOKS, ()):
        old.handle.remove()
    by_fused = {id(a.undo.fused): a for a in st.undo if isinstance(a.undo, _PutBack)}
    kinds = {e.name: e.pattern for e in st.report.fused}
    skip = _residual_norms(target)
    tuners = []
    for name, module in target.named_modules():
        applied = by_fused.get(id(module))
        if applied is None or id(module) in skip or name not in kinds:
            continue
        tuner = _Tuner(target, name, kinds[name], applied, repeats, margin)
        tuner.handle = module.register_forward_pre_hook(tuner, with_kwargs=True)
        tuners.append(tuner)
    target.__dict__[_HOOKS] = tuners
    tuned = {t.name for t in tuners}
    untuned = Counter(e.pattern for e in st.report.fused if e.name not in tuned)
    note = (f"{UNTIMED} (fused forwards, or norms a fused residual-add layer calls by "
            f"method): {', '.join(f'{k} {n}' for k, n in sorted(untuned.items()))}")
    if untuned and note not in st.report.notes:
        st.report.notes.append(note)
    return model
