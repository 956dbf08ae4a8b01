"""Decode steps run the original modules: a decode-shaped call under no grad is handed to the module the fused one
replaced, so a rollout (``generate``) runs the unfused model's code, bit for bit, at its speed plus one check a
decoder layer (and one a fused module outside the layers, such as the final norm).

Why: a decode step is host-bound (one to a few tokens a row, a KV cache). Its ATen work fused is already below the
unfused model's, but the fused modules' per-call Python costs more than the unfused modules' (measured 3–8 % slower
on the CPU probe and 6–8 % on an H200 at Qwen2.5-1.5B shapes, batch 16: NOTES-trl.md, "Rollouts with generate").
The kernels gain nothing there; prefill and TRL's no-grad scoring of whole sequences are large, and stay fused.

The rule (``original``; ``layer_call`` for a layer), checked first by every fused forward that can hand a call on:

- grad mode off (a training forward always runs fused; the caller checks it inline, before calling here),
- the switch ``switches.decode_to_original`` on (the default),
- not traced or compiled (``torch.compiler.is_compiling()``), not inside TorchFuser's CUDA-graph warm-up or capture
  (``base.no_host_reads``) nor any CUDA graph capture of the current stream (the original's code may read values
  back to the host),
- decode-shaped: the hidden states have at most ``DECODE_POSITIONS`` positions a row (S of B × S × hidden, the rows
  of tokens × hidden; a 4-D input, such as a q/k norm's head-major q, never at the top): packed or variable-length
  calls with one long row are not decode,
- the original still shares this module's parameters, buffers and children (``share``: the same dicts, so whatever
  was swapped in since, by ``.to()``, an adapter, FSDP2 or ``functional_call``, the original holds too; a
  DataParallel replica, whose dicts are its own, keeps the fused path), and the module holds none of its tensors
  outside them (FSDP1 keeps its views of a flat parameter as plain attributes of the module).

Calls made by an original while it runs for a decode step (a layer's norms, attention and MLP; an attention's q/k
norms, whose rows are heads; a MoE block's shared expert on flat tokens) dispatch without the shape check: they are
part of the step. Each handed-on call at the top is counted on its module (``counts``; the report's ``decode_calls``
and a note with ``REASON``), the calls inside it are not: a call-time fallback by choice, kept apart from
``modules.fallbacks``' calls that could not run fused. Kinds: norms, MLPs, attention (also variable-length, and
relative-position, whose B × h × w × C maps are never decode-shaped at the top), MoE blocks (``modules.base.FusedModule`` subclasses, which keep ``_original``), and the decoder
layers and output sublayers whose forward is replaced on the instance (their class's ``forward``). The LM head +
loss is not one: it is the model's forward, and runs the original already wherever no labels are given.
"""
from __future__ import annotations

import threading

import torch
from torch import Tensor, nn

from torchfuser.modules import fallbacks
from torchfuser.modules.base import _graphing
from torchfuser.switches import SWITCHES

# At most this many new positions a row (a decode step: 1; speculative or assisted decoding: a few).
DECODE_POSITIONS = 4
REASON = ("decode-shaped no-grad call: the original modules are faster where the step is host-bound; "
          "switches.decode_to_original=False keeps the fused kernels")
_DICTS = ("_parameters", "_buffers", "_modules")
_TENSORS = "_decode_tensor_names"  # set by share
_CHILDREN = "_decode_children"  # a layer's: (its children and mode, what runs at decode, the fused ones replaced)
_CALLS = "_torchfuser_decode_calls"  # top-level calls handed on: an int in the module's __dict__
HEAD = "decode: "  # every note made here starts so, to be replaced when the report is refreshed


class _State(threading.local):
    inside = False  # an original runs for a decode step on this thread: its fused children follow it


_STATE = _State()


def counts(model: nn.Module) -> dict[str, int]:
    """{qualified module name: top-level decode calls handed to the original modules} over ``model``."""
    return {name: n for name, m in model.named_modules() if (n := m.__dict__.get(_CALLS))}


def notes(model: nn.Module) -> list[str]:
    """One line per module name with layer indices as * (``fallbacks.layer_glob``), the calls summed."""
    grouped: dict[str, list[int]] = {}
    for name, n in counts(model).items():
        grouped.setdefault(fallbacks.layer_glob(name), []).append(n)
    return [f"{HEAD}{name}" + (f" ({len(ns)} modules)" if len(ns) > 1 else "") + f": {sum(ns)} "
            f"call{'s' if sum(ns) != 1 else ''} ran the original modules: {REASON}" for name, ns in grouped.items()]


def clear(module: nn.Module) -> None:
    """What a layer keeps for decode steps (its count, its children's originals), dropped at ``restore``."""
    module.__dict__.pop(_CALLS, None)
    module.__dict__.pop(_CHILDREN, None)


def share(fused: nn.Module, original: nn.Module) -> None:
    """Give ``original`` ``fused``'s parameter, buffer and submodule dicts themselves where it holds the same names
    and objects (``adopt`` registered them): no per-call ``hand_back`` is needed then. Dicts that differ stay
    apart, and such a module keeps the fused path at decode (``original`` checks the identity per call)."""
    for name in _DICTS:
        mine, theirs = fused.__dict__[name], original.__dict__[name]
        if mine.keys() != theirs.keys() or any(theirs[k] is not v for k, v in mine.items()):
            return
    for name in _DICTS:
        original.__dict__[name] = fused.__dict__[name]
    # the names of its own tensors: one found in the instance's __dict__ (FSDP1's views) keeps the fused path
    fused.__dict__[_TENSORS] = (*fused._parameters, *fused._buffers)


def unshare(fused: nn.Module, original: nn.Module) -> None:
    """The original back in the model (``restore``): dicts of its own again, where it shared ``fused``'s."""
    for name in _DICTS:
        if original.__dict__[name] is fused.__dict__[name]:
            original.__dict__[name] = dict(original.__dict__[name])


def decode_shaped(x) -> bool:
    """The shape and mode part of the rule (the module docstring): a top-level call's hidden states ``x``."""
    # (compilation first: no guard on the shape where the compiler traces this)
    if torch.compiler.is_compiling() or _graphing.on or not isinstance(x, Tensor):
        return False
    n = x.dim()  # B × S × hidden, or tokens × hidden; not a head-major q or k (a q/k norm's: the heads are dim 1)
    if n == 3:
        if x.shape[1] > DECODE_POSITIONS:
            return False
    elif n != 2 or x.shape[0] > DECODE_POSITIONS:
        return False
    return not (x.is_cuda and torch.cuda.is_current_stream_capturing())


def original(fused: nn.Module, x):
    """What runs this no-grad call of ``fused`` (on hidden states ``x``) as the original module, or None: the fused
    path. That is the original's ``forward``, or the original itself where it carries hooks of its own (set before
    it was fused: the unfused model runs them). Counted where it is a step's top-level call. The caller checks
    grad mode first; one whose original calls fused modules calls it through ``run``."""
    if not SWITCHES.decode_to_original:
        return None
    inside = _STATE.inside
    if not inside and not decode_shaped(x):
        return None
    d = fused.__dict__
    o = _held(d)
    if o is None:
        return None
    od = o.__dict__
    if od["training"] is not d["training"]:  # model.train() / .eval() reached the fused module only
        od["training"] = d["training"]
    if not inside:
        d[_CALLS] = d.get(_CALLS, 0) + 1
    return o if (od["_forward_hooks"] or od["_forward_pre_hooks"]) else o.forward


def _held(d: dict) -> nn.Module | None:
    """The original a fused module (``d``: its ``__dict__``) can hand a call to: one that shares its dicts, while
    the module holds none of its tensors outside them. None where there is none."""
    names = d.get(_TENSORS)
    if names is None:  # not shared (built outside a pattern, or its dicts differ from the original's)
        return None
    o = d["_original"]
    od = o.__dict__
    if od["_parameters"] is not d["_parameters"] or od["_modules"] is not d["_modules"] or od["_buffers"] is not d["_buffers"]:
        return None
    for name in names:  # (FSDP1 holds its views as plain attributes, outside the dicts the original shares)
        if name in d:
            return None
    return o


def run(forward, *args, **kwargs):
    """``forward(*args, **kwargs)`` for a decode step: the fused modules it calls run their originals too."""
    if _STATE.inside:
        return forward(*args, **kwargs)
    _STATE.inside = True
    try:
        return forward(*args, **kwargs)
    finally:
        _STATE.inside = False


NOT_DECODE = object()  # what ``layer_call`` returns for a call it leaves to the layer's fused forward


def layer_call(layer: nn.Module, args: tuple, kwargs: dict, first: str):
    """A call of a layer whose forward TorchFuser replaced on the instance (``first``: its hidden states' name): for a
    decode step (the same rule; counted on the layer) its class's forward, the unfused layer, with its fused
    children swapped for their originals for the call (``_children``: no check a child; their own fused children,
    q/k norms, check for themselves); else ``NOT_DECODE``. Grad mode is checked by the caller."""
    if not SWITCHES.decode_to_original:
        return NOT_DECODE
    d = layer.__dict__
    outer = _STATE.inside
    if not outer:
        if not decode_shaped(args[0] if args else kwargs.get(first)):
            return NOT_DECODE
        d[_CALLS] = d.get(_CALLS, 0) + 1
    mods = d["_modules"]
    key = (*mods.values(), d["training"])
    swapped = None
    cached = d.get(_CHILDREN)
    if cached is not None and cached[0] == key:
        swapped = cached[1]
        for cd in cached[2]:  # (hooks or FSDP1's views on a replaced child since: it runs, and checks, itself)
            if cd["_forward_hooks"] or cd["_forward_pre_hooks"]:
                swapped = None
            for name in cd[_TENSORS]:  # (loops, not generators: host time)
                if name in cd:
                    swapped = None
    else:
        swapped = _children(d, mods, key)
    _STATE.inside = True
    if swapped is not None:
        d["_modules"] = swapped
    try:
        return type(layer).forward(layer, *args, **kwargs)
    finally:
        if swapped is not None:
            d["_modules"] = mods
        _STATE.inside = outer


def _children(d: dict, mods: dict, key: tuple) -> dict | None:
    """The layer's ``_modules`` with each fused child that can hand its calls on replaced by its original, or None
    where none can; kept in the layer's ``__dict__`` under ``key`` (its children and mode): made again whenever a
    child is swapped or the layer's mode changes, and the originals' modes set then (``model.train()`` /
    ``.eval()`` reach the layer too). A fused child with hooks, or its tensors outside its dicts (FSDP1), keeps
    its place: it runs its hooks, and checks for itself."""
    swapped, replaced = {}, []
    for name, child in mods.items():
        cd = child.__dict__
        o = None if (child._forward_hooks or child._forward_pre_hooks) else _held(cd)
        if o is None:
            swapped[name] = child
            continue
        o.__dict__["training"] = cd["training"]
        swapped[name] = o
        replaced.append(cd)
    d[_CHILDREN] = (key, swapped, tuple(replaced)) if replaced else (key, None, ())
    return swapped if replaced else None
