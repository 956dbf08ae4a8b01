"""LM head + loss of a causal LM through ``functional.linear_cross_entropy``.

The model itself cannot be swapped, so this is not a module in the tree: it is a per-instance
``forward`` (stored in ``model.__dict__``; the class and every other instance are untouched).
"""
from __future__ import annotations

import copy
import dataclasses
import functools
import inspect
from dataclasses import dataclass

import torch
from torch import Tensor, nn

from torchfuser import functional as F
from torchfuser.modules import fallbacks, tied_embedding
from torchfuser.ops._call import plain_eager
from torchfuser.modules.lm_head_logits import NOT_KEPT, LogitsNotKept, LogitsNotKeptError  # noqa: F401

# What the capture head hands the model's forward in place of the logits; the forward's own
# post-processing of these values tells what it does to logits (a scale, a softcap, or else).
PROBE_LOGITS = (1.5, 45.0, -7.25)


# The forward keywords that HF's ForCausalLMLoss honours (sum / num_items_in_batch, a custom
# ignore_index, labels shifted by the caller).
LOSS_KWARGS = ("num_items_in_batch", "ignore_index", "shift_labels")


@dataclass(frozen=True)
class LMHeadLossSpec:
    """loss = cross_entropy(softcap(s·(h @ W.T + b)), labels), labels shifted or not; the defaults
    are HF's ``ForCausalLMLoss``. The pattern learns the fields from the model's forward."""

    head: str = "lm_head"  # the nn.Linear (a child of the model, or a path to one in a wrapper) making the logits
    softcap: float | None = None  # Gemma-2's final_logit_softcapping: tanh(z/c)·c
    logit_scale: float = 1.0  # logits · s before the loss (Cohere's logit_scale, Granite's 1/logits_scaling)
    shift: bool = True  # tokens < n predict n (ForCausalLMLoss); False: labels[i] is logits[i]'s target (BART's decoder)
    loss_kwargs: tuple[str, ...] = LOSS_KWARGS  # those of LOSS_KWARGS the forward's loss honours
    # The forward makes its decoder's inputs from the labels where none are given (an encoder-decoder's, T5Gemma 2's),
    # as the model's prepare_decoder_input_ids_from_labels does: called without labels, it is given those.
    decoder_inputs_from_labels: bool = False
    # ... or as the labels shifted right, (start token, pad token for -100) (Florence-2's and UDOP's forwards, which
    # have no prepare_decoder_input_ids_from_labels that does it); cache_off: the forward turns the cache off with
    # labels (use_cache=False passed on), and so does the fused forward
    decoder_shift: tuple[int, int] | None = None
    cache_off: bool = False
    refused_kwargs: tuple[str, ...] = ()  # of LOSS_KWARGS, those the forward raises on with labels (so does the fused)
    # Leading positions of the decoder's output that are never scored, the labels being those of the rest (GIT's
    # image positions before the text): the targets get that many ignored ones in front.
    leading: int = 0

    def transform(self, logits: Tensor) -> Tensor:
        """What the model's forward does to the head's output before the loss."""
        z = logits * self.logit_scale
        return z if self.softcap is None else torch.tanh(z / self.softcap) * self.softcap


def shift_right(labels: Tensor, start: int, pad: int) -> Tensor:
    """The decoder's inputs an encoder-decoder makes from its labels: shifted right by one, ``start`` first, -100 (an
    ignored label) made ``pad``."""
    out = labels.new_full(labels.shape, start)
    out[..., 1:] = labels[..., :-1]
    return out.masked_fill(out == -100, pad)


def head_holder(model: nn.Module, path: str) -> tuple[nn.Module | None, str]:
    """(the module holding the head, the head's name in it) for the head's path in the model: the model itself
    for a child of it (``lm_head``), else the wrapper around it (``lm_head.out_proj``, BERT's ``cls.predictions.decoder``;
    None where the path no longer leads anywhere)."""
    if "." not in path:
        return model, path
    parent, _, leaf = path.rpartition(".")
    try:
        return model.get_submodule(parent), leaf
    except AttributeError:
        return None, leaf


class CaptureHead(nn.Module):
    """Stands in for the head during one fused forward: keeps its input, returns the probe logits
    per position instead of a vocabulary's worth. Any other attribute read comes from the real
    head: Mamba's forward casts its input to ``self.lm_head.weight.dtype``."""

    def __init__(self, probes: dict | None = None, real: nn.Module | None = None, run: bool = False):
        super().__init__()
        self.inputs: list[Tensor] = []
        self.run = run  # keep_logits: the real head runs (its logits returned), the input kept all the same
        self.probes = {} if probes is None else probes  # (dtype, device) → the probe logits
        self.__dict__["_real"] = real  # not a submodule: its parameters stay the model's alone

    def __getattr__(self, name):
        try:
            return super().__getattr__(name)
        except AttributeError:
            real = self.__dict__.get("_real")
            if real is None:
                raise
            return getattr(real, name)

    def forward(self, hidden: Tensor) -> Tensor:
        self.inputs.append(hidden)
        if self.run:
            return self.__dict__["_real"](hidden)
        key, keep = (hidden.dtype, hidden.device), plain_eager((hidden,))  # never keep a traced or fake tensor
        probe = self.probes.get(key) if keep else None
        if probe is None:
            # A tensor built from host values is a blocking copy: made in every step, the host would
            # wait here for the whole forward to finish. So it is made once per dtype and device.
            probe = torch.tensor(PROBE_LOGITS, dtype=hidden.dtype, device=hidden.device)
            if keep:
                self.probes[key] = probe
        return probe.expand(*hidden.shape[:-1], len(PROBE_LOGITS)).clone()


class FusedLMHeadLoss:
    """The ``forward`` of one ``*ForCausalLM`` instance.

    In training mode with ``labels``, the decoder runs as usual, the head's input (the final
    hidden states) is captured and the loss comes from ``linear_cross_entropy``: the logits are
    never materialised: ``output.logits`` is ``NOT_KEPT`` (``LogitsNotKept``), whose every use raises an
    error saying why and what to pass, while the output's dict and tuple views leave the logits out, as
    they leave out any None field (a ``return_dict=False`` tuple is ``(loss, ...)``; under torch.compile the
    attribute is None). Reading the field itself does not raise: FSDP2 and other generic walkers of
    ``ModelOutput`` fields read every field (an output whose ``logits`` raised on reading broke them). With ``keep_logits``
    (``optimize(model, keep_logits=True)``) the model's forward runs its real head, so the logits are
    the ones the original returns (its own matmul in the autocast dtype, its own scale / softcap, with
    their gradient), and the loss is still the fused one on the same hidden states: one more matmul and
    the logits' memory, against the original's float32 logits and their gradient. Labels are shifted or not, and ``ignore_index``
    (default -100), ``shift_labels`` and the Trainer's ``num_items_in_batch`` (sum /
    num_items_in_batch) honoured or not, as the model's own forward does (the spec, probed);
    for most models that is ``transformers.loss.loss_utils.ForCausalLMLoss``.

    Without labels, in eval mode, or with ``logits_to_keep`` set, the original forward runs
    unchanged. Where the input embedding shares the head's weight, its gradient is added into the
    head's in place, in one autograd node, during a fused eager call (``tied_embedding``).

    ``fp8`` ("rowwise" / "tensorwise", set by ``optimize(model, fp8=..., fp8_lm_head=True)``; None by
    default): the head's three products run as FP8 GEMMs (``functional.linear_cross_entropy``'s
    ``fp8``). A call that cannot take them (not bf16; tokens, hidden size or vocabulary not in
    multiples of 16) runs bf16 and is counted on the model (``fallbacks``), with the reason.
    """

    def __init__(self, model: nn.Module, spec: LMHeadLossSpec, backend: str = "auto"):
        self.model = model
        self.spec = spec
        self.backend = None if backend == "auto" else backend
        # An instance forward already there (e.g. accelerate's hooks) is wrapped, and put back on undo.
        self.previous = model.__dict__.get("forward")
        # Keep the signature visible: generate() and the Trainer inspect model.forward's parameters.
        self.__signature__ = inspect.signature(self._original())
        self.values_checked = False  # the value check syncs with the device: once per instance
        self.probes: dict = {}  # the capture head's probe logits, made once (CaptureHead)
        self.fp8: str | None = None  # the FP8 recipe of the head's GEMMs (optimize's fp8_lm_head)
        self.calls = fallbacks.Calls()  # fused calls: the report tells a head a trainer bypasses
        self.keep_logits = False  # optimize's keep_logits: the forward's own logits returned with the fused loss

    def __setstate__(self, state: dict) -> None:
        # Unpickling. Not a lookup with a default in the forward: torch.compile cannot trace
        # ``self.__dict__.setdefault`` (torch 2.11, fullgraph=True).
        self.__dict__.update(state)
        self.__dict__.setdefault("probes", {})  # pickled by a version before the probe cache
        self.__dict__.setdefault("fp8", None)  # pickled by a version before fp8_lm_head
        self.__dict__.setdefault("calls", fallbacks.Calls())
        self.__dict__.setdefault("keep_logits", False)  # pickled by a version before keep_logits

    def _original(self):
        # functools.partial, not function.__get__: torch.compile traces the former, not the latter.
        return self.previous if self.previous is not None else functools.partial(type(self.model).forward, self.model)

    def __repr__(self) -> str:
        fp8 = f", fp8={self.fp8!r}" if self.fp8 else ""
        keep = ", keep_logits=True" if self.keep_logits else ""
        return f"FusedLMHeadLoss(spec={self.spec}, backend={self.backend or 'auto'}{fp8}{keep})"

    def install_on_replica(self, replica: nn.Module) -> None:
        """Give an nn.DataParallel replica of the model this forward, bound to the replica."""
        twin = copy.copy(self)
        twin.model = replica
        replica.__dict__["forward"] = twin

    def __call__(self, *args, **kwargs):
        # generate, scoring: the model's own forward, first (host time of a decode step). This head hands no decode step
        # on itself (modules.decode): without labels it runs the original forward already, whose blocks hand theirs on.
        if not args and kwargs.get("labels") is None:
            previous = self.previous
            return previous(**kwargs) if previous is not None else type(self.model).forward(self.model, **kwargs)
        original = self._original()
        if args:  # name positional arguments so that labels can be found
            bound = self.__signature__.bind_partial(*args, **kwargs)
            kwargs = dict(bound.arguments)
            for p in self.__signature__.parameters.values():
                if p.kind is p.VAR_KEYWORD:
                    kwargs.update(kwargs.pop(p.name, {}))
                elif p.kind is p.VAR_POSITIONAL and kwargs.pop(p.name, ()):
                    return original(*args)  # cannot name these; leave the call as it was
        labels = kwargs.get("labels")
        holder, leaf = head_holder(self.model, self.spec.head)
        head = None if holder is None else holder._modules.get(leaf)
        keep = kwargs.get("logits_to_keep", 0)
        if labels is None or not self.model.training or not isinstance(head, nn.Linear) or not (isinstance(keep, int) and keep == 0):
            return original(**kwargs)
        if kwargs.get("reduction", "mean") not in (None, "mean") or kwargs.get("return_logits"):
            return original(**kwargs)  # BLIP's text decoder: per-row losses, or its logits alone (the probes saw neither)
        return self._fused(original, head, kwargs)

    def _fused(self, original, head: nn.Linear, kwargs):
        if not torch.compiler.is_compiling():
            self.calls.n += 1
        labels = kwargs.pop("labels")
        keep_logits = self.keep_logits
        capture = CaptureHead(self.probes, head, run=keep_logits)
        for name in self.spec.refused_kwargs:
            if kwargs.get(name) is not None:
                raise TypeError(f"{type(self.model).__name__}.forward with labels does not take {name}= "
                                "(its own forward raises on it too)")
        if kwargs.get("decoder_input_ids") is None and kwargs.get("decoder_inputs_embeds") is None:
            if self.spec.decoder_shift is not None:
                kwargs["decoder_input_ids"] = shift_right(labels, *self.spec.decoder_shift)
            elif self.spec.decoder_inputs_from_labels:
                kwargs["decoder_input_ids"] = self.model.prepare_decoder_input_ids_from_labels(labels=labels)
        if self.spec.cache_off:  # as the forward does with labels
            kwargs["use_cache"] = False
        embedding = self._tied_embedding(head, kwargs)
        holder, leaf = head_holder(self.model, self.spec.head)
        holder._modules[leaf] = capture
        slot = None if embedding is None else tied_embedding.install(embedding)
        try:
            out = original(**kwargs, labels=None)
        finally:
            holder._modules[leaf] = head
            if embedding is not None:
                tied_embedding.uninstall(embedding)
        self._check(out, capture, head)
        hidden, bias = capture.inputs[0], head.bias
        weight = head.weight if slot is None else tied_embedding.head_weight(head.weight, slot)
        if self.spec.logit_scale != 1.0:  # s·(h·Wᵀ + b) = (s·h)·Wᵀ + s·b: the logits are never formed
            hidden = hidden * self.spec.logit_scale
            bias = None if bias is None else bias * self.spec.logit_scale
        # A keyword the forward's loss does not honour reached only the decoder, as without fusion.
        honoured = {k: kwargs.get(k) for k in self.spec.loss_kwargs}
        ignore_index = -100 if honoured.get("ignore_index") is None else honoured["ignore_index"]
        target = honoured.get("shift_labels")
        if target is None:
            # shifted: tokens < n predict n, the last position has no target
            target = nn.functional.pad(labels, (0, 1), value=ignore_index)[..., 1:] if self.spec.shift else labels
        if self.spec.leading:
            target = nn.functional.pad(target, (self.spec.leading, 0), value=ignore_index)
        target = target.to(hidden.device)
        if target.shape != hidden.shape[:-1]:
            raise RuntimeError(
                f"lm_head_loss: {type(self.model).__name__}'s head got hidden states of shape {tuple(hidden.shape)} for labels "
                f"of shape {tuple(target.shape)}; the fused loss needs one label per position. "
                "Run torchfuser.optimize(model, exclude=['lm_head_loss'])")
        n_items = honoured.get("num_items_in_batch")
        loss = F.linear_cross_entropy(
            hidden, weight, target, bias=bias, ignore_index=ignore_index,
            reduction="mean" if n_items is None else "sum", softcap=self.spec.softcap, backend=self.backend,
            fp8=self._fp8_for(hidden, weight),
        )
        if n_items is not None:
            loss = loss / (n_items.to(loss.device) if torch.is_tensor(n_items) else n_items)
        aux = None if isinstance(out, tuple) else getattr(out, "aux_loss", None)
        if aux is not None:  # a mixture of experts' router balancing loss, added as the forward adds it with labels
            coef = getattr(self.model, "router_aux_loss_coef", None)
            if not isinstance(coef, (int, float)):
                raise RuntimeError(f"lm_head_loss: {type(self.model).__name__} returns an aux_loss but has no "
                                   "router_aux_loss_coef; run torchfuser.optimize(model, exclude=['lm_head_loss'])")
            loss = loss + coef * (aux.to(loss.device) if torch.is_tensor(aux) else aux)  # some return a plain 0
        if isinstance(out, tuple):  # return_dict=False: HF's tuple is (loss, logits, ...); logits left out unless kept
            return (loss,) + tuple(out if keep_logits else out[1:])
        if keep_logits:
            return dataclasses.replace(out, loss=loss)
        out = dataclasses.replace(out, loss=loss, logits=None)
        if not torch.compiler.is_compiling():  # the attribute alone (ModelOutput's setattr would add it to the dict)
            object.__setattr__(out, "logits", NOT_KEPT)
        return out

    def _fp8_for(self, hidden: Tensor, weight: Tensor) -> str | None:
        """The FP8 recipe this call runs with: ``self.fp8``, unless the call cannot take FP8 GEMMs (then
        bf16, counted with the reason)."""
        if self.fp8 is None:
            return None
        why = F.linear_cross_entropy_fp8_blocker(hidden, weight)
        if why is None:
            return self.fp8
        fallbacks.count(self.model, f"fp8: the LM head + loss ran without FP8 GEMMs: {why}")
        return None

    def _tied_embedding(self, head: nn.Linear, kwargs) -> nn.Embedding | None:
        """The input embedding whose gradient goes straight into the head's (``tied_embedding``):
        in eager training steps that embed ``input_ids`` with a weight tied to the head's."""
        if not plain_eager((head.weight,)):  # first: torch.compile traces none of what follows
            return None
        if kwargs.get("inputs_embeds") is not None or not (torch.is_grad_enabled() and head.weight.requires_grad):
            return None
        get = getattr(self.model, "get_input_embeddings", None)
        try:
            embedding = get() if callable(get) else None
        except NotImplementedError:  # an encoder-decoder's that transformers does not resolve (PP-FormulaNet's)
            embedding = None
        return embedding if embedding is not None and tied_embedding.routable(embedding, head) else None

    def _check(self, out, capture: CaptureHead, head: nn.Linear) -> None:
        """The forward must have called the head once and done to its output exactly what the spec
        says (its logit scale and softcap). Otherwise the fused loss would be silently wrong.

        The forward's code does not change between calls, so the value half of the check (which
        waits for the device) runs on the first eager call only; under torch.compile it is skipped
        (a data-dependent check would break the graph), and on the meta device there are no values.
        With the real head run (keep_logits) the values checked are one position's logits."""
        logits = out[0] if isinstance(out, tuple) else getattr(out, "logits", None)
        width = head.out_features if capture.run else len(PROBE_LOGITS)
        ok = len(capture.inputs) == 1 and isinstance(logits, Tensor) and logits.shape[-1] == width
        # Meta tensors hold no values (shape propagation): there is nothing to check.
        if ok and not self.values_checked and not torch.compiler.is_compiling() and logits.device.type != "meta":
            if capture.run:
                with torch.no_grad():
                    row = capture.inputs[0].detach().reshape(-1, capture.inputs[0].shape[-1])[:1]
                    want = self.spec.transform(head(row).double()).cpu()
                got = logits.detach().reshape(-1, width)[:1].double().cpu()
                atol = 1e-2 * max(float(want.abs().max()), 1.0)
            else:
                want = self.spec.transform(torch.tensor(PROBE_LOGITS, dtype=torch.float64)).expand(1, -1)
                got, atol = logits.detach().reshape(-1, len(PROBE_LOGITS)).double().cpu(), 1e-2
            ok = self.values_checked = bool(torch.allclose(got, want.expand_as(got), rtol=1e-2, atol=atol))
        if not ok:
            raise RuntimeError(
                f"lm_head_loss: {type(self.model).__name__}.forward does not use {self.spec.head!r} the way the fused loss "
                f"assumes (one call, logits scaled by {self.spec.logit_scale:g}"
                + (f", softcap {self.spec.softcap}" if self.spec.softcap else "") + "); run torchfuser.optimize(model, exclude=['lm_head_loss'])"
            )
