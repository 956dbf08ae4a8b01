"""What a fused decoder layer may do with its blocks (``modules.residual_norm``): call their methods in place of
the blocks (no hooks), let the norms write in the projections' dtype under autocast, hand FP8 maxima on; how it
calls its attention and MLP as the original calls them."""
from __future__ import annotations

import contextlib

import torch
from torch import nn

from torchfuser.modules import fp8
from torchfuser.modules.attention import FusedAttention
from torchfuser.modules.base import hooked
from torchfuser.modules.mlp import FusedGatedMLP, FusedMLP
from torchfuser.modules.norms import FusedLayerNorm, FusedRMSNorm
from torchfuser.ops._call import autocast_enabled

_NOTHING = contextlib.nullcontext()  # reusable


def unfused_norms(*norms: nn.Module) -> str | None:
    """Why the fused path cannot use these norms' kernels in place of calling them, or None."""
    for n in norms:  # (a loop, not a generator: host time)
        if not isinstance(n, (FusedRMSNorm, FusedLayerNorm)):
            return "its norms are no longer fused RMSNorms or LayerNorms"
    if not as_class(*norms):
        return "hooks (or a forward of their own) on its norms: the fused path would skip them"
    return None


def is_identity(m: nn.Module) -> bool:
    """Whether calling ``m`` returns its input: an ``nn.Identity`` (or a subclass keeping its forward) without
    parameters (a pre-norm layer's first norm left out: ModernBERT-decoder's layer 0)."""
    return isinstance(m, nn.Identity) and type(m).forward is nn.Identity.forward and not m._parameters


def as_class(*modules: nn.Module) -> bool:
    """Whether calling these modules would run just their class's forward (no hooks, no forward
    replaced on the instance), so that this forward may call their methods instead."""
    if hooked(*modules):
        return False
    for m in modules:  # (a loop, not a generator: host time)
        if "forward" in m.__dict__:
            return False
    return True


def projection_dtype(x, attention: nn.Module, mlp: nn.Module) -> torch.dtype | None:
    """Under autocast, the dtype the norms may write their outputs in: the autocast dtype when both
    blocks first project their input with plain ``nn.Linear``s, which would cast it to that dtype
    anyway (the same values; the norm writes half the bytes, the cast kernel goes, and the backward
    reads a bf16 dy, as autocast's own cast gives). Else None: the norms' own dtype."""
    device = x.device.type
    if not autocast_enabled(device) or x.dtype != torch.float32:
        return None
    if not (isinstance(attention, FusedAttention) and isinstance(mlp, FusedGatedMLP)):
        return None
    inputs = [(attention, n) for n in attention.spec.qkv]
    inputs += [(mlp, n) for n in (mlp.spec.gate, mlp.spec.up, mlp.spec.gate_up) if n is not None]
    linears = [getattr(block, name) for block, name in inputs]
    if all(type(m) is nn.Linear for m in linears) and not hooked(*linears):
        return torch.get_autocast_dtype(device)
    return None


def _projections(block: nn.Module, which: str) -> list[nn.Module]:
    """A fused block's projections of its input (``which="in"``) or, attention's, of its output (``"out"``)."""
    if isinstance(block, FusedAttention):
        names = block.spec.qkv if which == "in" else (block.spec.out,)
    elif isinstance(block, FusedGatedMLP) and which == "in":
        names = (block.spec.gate, block.spec.up, block.spec.gate_up)
    elif isinstance(block, FusedMLP) and which == "in":
        names = (block.spec.fc_in,)
    else:
        names = ()
    return [getattr(block, n) for n in names if n is not None]


def maxima(block: nn.Module, which: str, t: torch.Tensor, dtype: torch.dtype | None) -> bool:
    """Whether a norm's output (``which="in"``: in ``dtype``, None for t's) or the gradient the middle
    norm's backward hands the attention's output t (``"out"``) should carry its FP8 maxima to ``block``'s
    projections that take it (``modules.fp8.producer_maxima``: the kernels are the layer's norms, the
    recipe the block's)."""
    if not fp8._SWITCHES.fp8_norm_producers or fp8.recipe_of(block) is None:
        return False
    linears = _projections(block, which)
    return bool(linears) and fp8.producer_maxima(block, t, linears, dtype)


def child(layer: nn.Module, name: str):
    """``getattr(layer, name)`` for a submodule, read from ``_modules`` without nn.Module's ``__getattr__`` frame."""
    m = layer._modules.get(name)
    return m if m is not None else getattr(layer, name)


def attend(attention, args: tuple, attention_input: str, call: dict):
    """The attention called as the original calls it: its input positionally (with the residual after it where it
    adds that itself, BLOOM), or under its keyword."""
    if attention_input and len(args) == 1:
        return attention(**{attention_input: args[0]}, **call)
    return attention(*args, **call)


def mlp_call(layer: nn.Module, s, drop):
    """The layer's MLP block, or for an inline one (OPT) a function computing fc_out(act(fc_in(·))), with
    ``drop(name, t)`` applying its inner dropout where it has one."""
    if s.mlp_tuple:
        block = child(layer, s.mlp)
        if s.mlp_view:
            return lambda *args: block(*args)[0].view(args[0].shape)
        return lambda *args: block(*args)[0]
    if s.mlp2 is not None:  # (called in the original's order: the first, then the second)
        first, second = child(layer, s.mlp), child(layer, s.mlp2)
        return lambda y: first(y) + second(y)
    if not s.mlp_inline:
        return child(layer, s.mlp)
    fc_in, act, fc_out = (getattr(layer, n) for n in s.mlp_inline)
    return lambda y: fc_out(drop(s.mlp_inner_dropout, act(fc_in(y))))


def tail(layer: nn.Module, names: tuple[str, ...], out: torch.Tensor, g: torch.Tensor) -> torch.Tensor:
    """A third block after the layer's attention and MLP, as the original computes it: ``out + norm(fc_out(act(
    fc_in(out)) * g))`` (Gemma 4's per-layer inputs; its add follows its norm, so no kernel of ours takes it)."""
    fc_in, act, fc_out, norm = (child(layer, n) for n in names)
    return out + norm(fc_out(act(fc_in(out)) * g))


def adds(mlp) -> bool:
    """Whether the MLP block's ``add_to`` may stand for ``residual + mlp(y)`` (the sum inside its last GEMM)."""
    return (isinstance(mlp, FusedGatedMLP) or isinstance(mlp, FusedMLP) and mlp.spec.residual is None) and as_class(mlp)


def made_again(norm: nn.Module, y: torch.Tensor, src: torch.Tensor, maxima: bool):
    """The block after an RMSNorm does not keep the norm's output y: the backward makes it again from src
    (``FusedRMSNorm.made_again``); not with FP8 maxima (another kernel), nor for LayerNorms."""
    if maxima or not torch.is_grad_enabled() or not isinstance(norm, FusedRMSNorm) or not y.numel():
        return _NOTHING  # (no_grad: nothing is saved for a backward, so nothing to make again)
    return norm.made_again(y, src)
