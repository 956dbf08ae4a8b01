"""When a FusedAttention call runs the original module instead, and why: the checks every call passes before it
runs fused (cheap reads only: they run once a call), and the recording of the attention weights the original
forms on such a call where transformers' output-capturing hooks would not see them.

A call runs the original where the fused forward cannot reproduce it: an attention implementation other than
eager / sdpa, a request for the attention weights (or another output transformers records from the attention
class), encoder states (cross-attention), a position bias or mask of another form, a dropout that was 0 when
the block was fused and is not now, no dict where the layer hands its k and v on, and rotary tables of another
width or form than the probe found.
"""
from __future__ import annotations

import functools

import torch
from torch import Tensor, nn

from torchfuser.modules import attention_bias, rotary_complex

_IMPLEMENTATIONS = ("eager", "sdpa")
# Given (not None) at call time, these turn a self-attention into cross-attention: run the original.
_CROSS_KWARGS = ("encoder_hidden_states", "key_value_states")

try:  # transformers ≥ 5: outputs asked for at call time are collected by forward hooks, not passed down
    from transformers.utils import output_capturing as _capturing
except ImportError:  # pragma: no cover - other transformers versions: the flags reach the attention
    _capturing = None


def _collector() -> dict | None:
    """What transformers' output-capturing hooks collect in this call ({"attentions": [...], ...}), or None.

    A model decorated with ``capture_outputs`` (GPT-2, Llama, … in transformers 5) takes
    ``output_attentions`` itself and may not pass it on to its attention modules (GPT-2 pops it):
    the request is this collector. Under torch.compile a ContextVar cannot be traced; transformers
    then keeps the collector in a plain attribute (``compiling``), read here alike."""
    if _capturing is None:
        return None
    var = _capturing._active_collector
    if torch.compiler.is_compiling():
        return var.global_var if var.compiling else None
    return var.get()


def _recorded_from(original: nn.Module, collected: dict) -> str | None:
    """The output the collector asks of modules of ``original``'s class ("attentions", or another key
    of some model's ``_can_record_outputs`` whose recorder targets that class), or None."""
    keys = _requested_by_class(type(original), frozenset(collected), len(_capturing._CAN_RECORD_REGISTRY))
    return "attentions" if "attentions" in keys else next(iter(keys), None)


@functools.lru_cache(maxsize=256)
def _requested_by_class(cls: type, keys: frozenset, _registered: int) -> tuple[str, ...]:
    """The collected keys some model records from modules of class ``cls`` ("attentions" whenever collected
    too; ``_registered``: the registry's size, so that a model class registered later is seen)."""
    found = {"attentions"} & keys
    for table in list(_capturing._CAN_RECORD_REGISTRY.values()):
        for key, specs in (table or {}).items():
            if key in keys and key != "hidden_states":
                specs = specs if isinstance(specs, list) else [specs]
                targets = [getattr(spec, "target_class", spec) for spec in specs]
                found.update(key for t in targets if isinstance(t, type) and issubclass(cls, t))
    return tuple(sorted(found))


def record_attention_weights(original: nn.Module, out) -> None:
    """transformers collects ``output_attentions`` through forward hooks it installs, on first use,
    on modules of the attention *class*; a FusedAttention is not one, so when the hooks were
    installed after fusion nothing would be recorded and ``outputs.attentions`` would silently come
    back empty. Record the original's weights in the active collector then (transformers 5.x)."""
    collected = _collector()
    if not collected or "attentions" not in collected or not isinstance(out, tuple) or len(out) < 2:
        return
    if any(getattr(h, "__name__", "") == "output_capturing_hook" for h in original._forward_hooks.values()):
        return  # hooked before fusion: the hook recorded it
    if out[1] is not None:
        collected["attentions"].append(out[1])


def _fmt(names) -> str:
    return ", ".join(repr(n) for n in names)


def reason(fused: nn.Module, kwargs, hidden: Tensor, impl) -> str | None:
    """Why this call of ``fused`` (a FusedAttention) must run the original module, or None. ``impl``: the config's
    attention implementation as the caller read it (None: read here)."""
    spec, config = fused.spec, fused.config
    impl = getattr(config, "_attn_implementation", None) if impl is None else impl
    # A module that adds a position bias and holds no config computes its attention itself (BLOOM, MPT).
    if impl not in _IMPLEMENTATIONS and not (impl is None and config is None and spec.bias is not None):
        return f"attention implementation {impl!r} (the fused attention reproduces eager and sdpa)"
    # (the config's flag not read under sdpa, ≈ 1.5 µs a read: transformers refuses output_attentions=True there, and
    # the original module's sdpa path forms no weights either; a request through the collector is seen below)
    if kwargs.get("output_attentions") or (impl != "sdpa" and getattr(config, "output_attentions", False)):
        return "output_attentions=True (SDPA never forms the attention weights)"
    collected = _collector()
    if collected and (key := _recorded_from(fused.__dict__["_original"], collected)) is not None:
        return ("output_attentions=True (SDPA never forms the attention weights)" if key == "attentions" else
                f"output_{key}=True (transformers records it from the original module)")
    for n in _CROSS_KWARGS:  # (a loop, not a generator: every call reads these)
        if kwargs.get(n) is not None:
            return "called with encoder states (cross-attention)"
    if (why := attention_bias.call_reason(spec, kwargs, hidden, impl)) is not None:
        return why
    if spec.same_input and any(kwargs.get(n) is not hidden for n in spec.same_input):
        return f"{_fmt(spec.same_input)} not the hidden states themselves, as when it was fused"
    if spec.idle_dropouts and fused.training:
        children = fused.__dict__["_original"]._modules
        if any(getattr(children[n], "p", 0) for n in spec.idle_dropouts):
            return f"dropout p > 0 in {_fmt(spec.idle_dropouts)}, 0 when it was fused (and left out)"
    if spec.kv_out is not None and not isinstance(kwargs.get(spec.kv_out[0]), dict):
        return f"no dict given as {spec.kv_out[0]!r} (where it hands its k and v on to later layers)"
    if spec.rotary_complex:
        return rotary_complex.unusable(kwargs.get(spec.rotary_complex), spec)
    if spec.rotary_dim:
        pe = kwargs.get("position_embeddings")
        if pe is None:
            return "no position_embeddings given (the fused attention applies the rotary tables it is passed)"
        if pe[0].shape[-1] != spec.rotary_table_dim:
            return f"rotary tables {pe[0].shape[-1]} wide, not the {spec.rotary_table_dim} found when it was fused"
        if spec.rotary_axes > 1:  # the forward splits the head by the last width of the position_ids it is given
            ids = kwargs.get("position_ids")
            if ids is None or ids.shape[-1] != spec.rotary_axes:
                return (f"position_ids of shape {None if ids is None else tuple(ids.shape)}, not B × S × "
                        f"{spec.rotary_axes} (the rotary's axes found when it was fused)")
    return None
