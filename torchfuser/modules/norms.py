"""Fused RMSNorm and LayerNorm. They own the original ``weight`` / ``bias`` parameters.

A weightless norm (NanoChat's RMS norm, OLMo-1's LayerNorm: spec ``weight`` None) runs the same kernels with a
weight of ones in the normed tensor's dtype (``kernel_weight``: w = 1 is exact in every dtype, so the output is
the weightless formula's; the kernels' dw is computed and dropped). A LayerNorm with ``offset`` (Nemotron's
``LayerNorm1P``: w + 1) hands the kernels ``w + offset`` rounded in w's dtype, as the original computes it; its
gradient reaches w through that add.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor, nn

from torchfuser import functional as F, ops
from torchfuser.modules import decode, recompute
from torchfuser.modules.base import FusedModule, adopt, decided
from torchfuser.ops._call import autocast_enabled, kernel
from torchfuser.ops.rms_norm import add_rms_norm_fp8_producer

_HALF = (torch.bfloat16, torch.float16)


def _at_least_fp32(d: torch.dtype) -> torch.dtype:
    return torch.promote_types(d, torch.float32)


# What dtype a norm returns for x's and its weight's, and autocast's dtype where it is on (the pattern probes
# which, patterns/_dtype_probe.py):
OUT_DTYPE_RULES = {
    "input": lambda x, w, a: x,  # Gemma's (…).type_as(x), nn.LayerNorm, nn.RMSNorm
    "promote": lambda x, w, a: torch.promote_types(x, w),  # Llama's weight * x.to(input_dtype): bf16 x, fp32 w → fp32
    "weight": lambda x, w, a: w if w in _HALF else _at_least_fp32(torch.promote_types(x, w)),  # T5's
    "float32": lambda x, w, a: _at_least_fp32(torch.promote_types(x, w)),  # (CUDA autocast's layer_norm)
    # Nemotron's LayerNorm1P under autocast: x, w + 1 and b cast to autocast's dtype, the norm run with it off.
    # (The kernels take x and w as they are and round the output once, to that dtype: no less accurate.)
    "autocast": lambda x, w, a: a,
}


def output_dtype(rule: str, x: torch.dtype, w: torch.dtype, autocast: torch.dtype | None = None) -> torch.dtype | None:
    return OUT_DTYPE_RULES[rule](x, w, autocast)


@dataclass(frozen=True)
class RMSNormSpec:
    """y = x · rsqrt(mean(x²) + eps) · (offset + w); Gemma-style norms have offset 1. y's dtype: ``out_dtype``'s
    rule (``OUT_DTYPE_RULES``) of x's and w's, or under autocast on a GPU ``autocast_out_dtype``'s where set."""

    eps: float
    offset: float = 0.0
    weight: str | None = "weight"  # None: a weightless norm (NanoChat's)
    out_dtype: str = "input"
    autocast_out_dtype: str | None = None


@dataclass(frozen=True)
class LayerNormSpec:
    """y = (x − mean) · rsqrt(var + eps) · (offset + w) + b; ``bias`` is None for bias-free norms, ``weight`` None
    (and bias None) for weightless ones (OLMo-1's); Nemotron's LayerNorm1P has offset 1. y's dtype as
    ``RMSNormSpec``'s (nn.LayerNorm: x's, but fp32 under CUDA autocast)."""

    eps: float
    weight: str | None = "weight"
    bias: str | None = "bias"
    out_dtype: str = "input"
    autocast_out_dtype: str | None = None
    offset: float = 0.0


def _absent(fused: nn.Module, original: nn.Module) -> None:
    """The original's parameters registered as None (``nn.LayerNorm(elementwise_affine=False)``'s weight and bias)
    read as None on the fused module too."""
    for name, p in original._parameters.items():
        if p is None:
            fused.register_parameter(name, None)


def ones_weight(module: nn.Module, like: Tensor, dtype: torch.dtype | None = None) -> Tensor:
    """A weightless norm's weight for the kernels: ones of like's width and device, in ``dtype`` (like's by
    default), made once per those (not while tracing or capturing a CUDA graph: the graph makes its own; a
    captured fill holds its values only in replays)."""
    key = (like.shape[-1], dtype or like.dtype, like.device)
    if torch.compiler.is_compiling() or like.is_cuda and torch.cuda.is_current_stream_capturing():
        return torch.ones(key[0], dtype=key[1], device=key[2])
    cache = module.__dict__.setdefault("_ones", {})
    w = cache.get(key)
    if w is None:
        w = cache[key] = torch.ones(key[0], dtype=key[1], device=key[2])
    return w


def _out_dtype(spec, x: Tensor, w: Tensor, x_dtype: torch.dtype | None = None) -> torch.dtype:
    """The dtype the original norm returns for this call (``x_dtype``: the dtype of what is normed, x's by
    default): its rule, under autocast on a GPU its autocast rule (CPU autocast changes none)."""
    rule, device = spec.out_dtype, x.device.type
    if spec.autocast_out_dtype is not None and device != "cpu" and autocast_enabled(device):
        return output_dtype(spec.autocast_out_dtype, x_dtype or x.dtype, w.dtype, torch.get_autocast_dtype(device))
    return output_dtype(rule, x_dtype or x.dtype, w.dtype)


def _in_dtype(x: Tensor, out: torch.dtype) -> Tensor:
    """x for a norm whose output is to be ``out``: x itself where the kernel's output (x's dtype) can be
    cast to ``out`` with no loss beyond out's rounding, else x widened, so the kernel's fp32 result is
    rounded once, to ``out`` (bf16 x with fp32 weights under Llama's rule: fp32 out, not bf16 cast up)."""
    wide = torch.promote_types(x.dtype, out)
    return x if wide == x.dtype else x.to(wide)


def _add_out_dtype(spec, x: Tensor, residual: Tensor, w: Tensor) -> torch.dtype | None:
    """The dtype the original norm returns for s = x + residual where it is not s's, else None."""
    s_dtype = torch.promote_types(x.dtype, residual.dtype)
    out = _out_dtype(spec, x, w, s_dtype)
    return None if out == s_dtype else out


class FusedRMSNorm(FusedModule):
    def __init__(self, original: nn.Module, spec: RMSNormSpec, backend: str = "auto"):
        super().__init__(spec, backend)
        adopt(self, original, [spec.weight] if spec.weight else [])
        _absent(self, original)

    def kernel_weight(self, like: Tensor, dtype: torch.dtype | None = None) -> Tensor:
        """The weight the kernels take for a norm of ``like`` (of ``dtype``): the original's, or ones."""
        name = self.spec.weight
        return getattr(self, name) if name else ones_weight(self, like, dtype)

    def forward(self, x: Tensor) -> Tensor:
        if not torch.is_grad_enabled() and (o := decode.original(self, x)) is not None:  # a decode step: unfused
            return o(x)
        s = self.spec
        w = self.kernel_weight(x)
        # The checks and the backend once per call signature (host time: a decode step calls every norm once a
        # token). Everything they read is in the key; a weight swapped for another object or dtype, autocast
        # turned on, another device or width gives another key; TRITON_INTERPRET is read at resolve time only.
        # (base.signature's tuples written inline here and below: one Python call less a tensor)
        key = ("forward", type(x), x.dtype, x.device, x.shape[-1], (type(w), w.dtype, w.device, w.shape),
               self.backend, x.device.type != "cpu" and autocast_enabled(x.device.type))

        def decide():
            return _out_dtype(s, x, w), F.backend_for(self.backend, F.check_rms_norm(x, w))
        out, backend = decided(self, key, decide)
        # One kernel either way: x read as it is, the norm rounded once, to the original's dtype (bf16 x with fp32
        # weights under Llama's rule: an fp32 norm, not bf16 widened; nor x widened by a cast kernel first)
        return ops.rms_norm(x, w, float(s.eps), float(s.offset), backend, None if out == x.dtype else out)

    def add(self, x: Tensor, residual: Tensor, out_dtype: torch.dtype | None = None,
            maxima: tuple[bool, bool] = (False, False)) -> tuple[Tensor, Tensor]:
        """(x + residual, this norm of it) in one kernel, forward and backward; the norm in ``out_dtype``.
        ``maxima``: whether the norm's output, and residual's gradient, hand their FP8 maxima on to the
        GEMMs that take them (plain eager; ``modules.fp8.producer_maxima`` decides)."""
        s = self.spec
        w = self.kernel_weight(x, torch.promote_types(x.dtype, residual.dtype))
        # The output dtype (where the caller gives none: the original norm's for s = x + residual, None where
        # that is s's own), the checks and the backend once per call signature, as in forward; autocast is
        # read by the dtype rule on a GPU, so its state is in the key.
        on = x.device.type != "cpu" and autocast_enabled(x.device.type)
        key = ("add", (type(x), x.dtype, x.device, x.shape),
               (type(residual), residual.dtype, residual.device, residual.shape), (type(w), w.dtype, w.device, w.shape),
               out_dtype, self.backend, on)

        def decide():
            out = _add_out_dtype(s, x, residual, w) if out_dtype is None else None
            return out, F.backend_for(self.backend, F.check_add_rms_norm(x, residual, w, out or out_dtype))
        out, backend = decided(self, key, decide)
        if out is not None:  # (the caller's maxima were asked for an output of s's dtype)
            out_dtype, maxima = out, (False, False)
        if not (maxima[0] or maxima[1]):
            return ops.add_rms_norm(x, residual, w, float(s.eps), float(s.offset), backend, out_dtype)
        weight = w
        backend = F.backend_for(self.backend, F.check_add_rms_norm(x, residual, weight, out_dtype))
        return add_rms_norm_fp8_producer(x, residual, weight, float(s.eps), float(s.offset), backend,
                                         out_dtype, *maxima)

    def opening_residual(self, x: Tensor, out_dtype: torch.dtype | None = None,
                         maxima: bool = False) -> tuple[Tensor, Tensor]:
        """(this norm of x in ``out_dtype``, x) for a block that adds x back: x's two gradients are summed
        in the norm's backward kernel (``ops.rms_norm_opening_residual``). ``maxima``: whether the norm's
        output hands its FP8 maxima on, as in ``add``."""
        s, weight = self.spec, self.kernel_weight(x)
        on = x.device.type != "cpu" and autocast_enabled(x.device.type)  # (read by _out_dtype: in the key)
        key = ("opening", (type(x), x.dtype, x.device, x.shape), (type(weight), weight.dtype, weight.device, weight.shape),
               self.backend, on)
        backend, out = decided(self, key,
                               lambda: (F.backend_for(self.backend, F.check_rms_norm(x, weight)), _out_dtype(s, x, weight)))
        if out_dtype is None and out != x.dtype:  # the original norm's dtype
            out_dtype, maxima = out, False
        return ops.rms_norm_opening_residual(x, weight, float(s.eps), float(s.offset), backend, out_dtype, maxima)

    def made_again(self, y: Tensor, src: Tensor):
        """While active, ``y`` — this norm of ``src`` from ``add`` (src: the sum it stored) or ``opening_residual``
        (src: x), in y's dtype, without FP8 maxima — is not kept by what saves it for the backward (the
        projections after the norm): the backward makes it again from src, which the norm's backward keeps. Bit
        for bit: every backend's ``add_rms_norm_fwd`` normalises the stored sum with its own ``rms_norm_fwd``, as
        this does (``modules.recompute``; a hidden-sized tensor a token less kept per norm)."""
        s, w = self.spec, self.kernel_weight(src)
        backend = decided(self, ("again", src.device, self.backend), lambda: F.backend_for(self.backend, src.device))
        eps, offset, dtype = float(s.eps), float(s.offset), y.dtype
        return recompute.made_again(y, lambda: kernel(backend, "rms_norm_fwd")(src, w, eps, offset, dtype)[0])


class FusedLayerNorm(FusedModule):
    def __init__(self, original: nn.Module, spec: LayerNormSpec, backend: str = "auto"):
        super().__init__(spec, backend)
        adopt(self, original, [n for n in (spec.weight, spec.bias) if n is not None])
        _absent(self, original)

    def forward(self, x: Tensor) -> Tensor:
        if not torch.is_grad_enabled() and (o := decode.original(self, x)) is not None:  # a decode step: unfused
            return o(x)
        s = self.spec
        w, bias = self._wb(x)
        out = _out_dtype(s, x, w)
        if out == x.dtype:
            return F.layer_norm(x, w, bias, s.eps, backend=self.backend)
        return F.layer_norm(_in_dtype(x, out), w, bias, s.eps, backend=self.backend).to(out)

    def _wb(self, like: Tensor, dtype: torch.dtype | None = None):
        """(weight, bias) the kernels take: w + offset (Nemotron's w + 1, in w's dtype as the original adds it),
        or ones for a weightless norm."""
        s = self.spec
        if s.weight is None:
            w = ones_weight(self, like, dtype)
        else:
            w = getattr(self, s.weight)
            w = w + s.offset if s.offset else w
        return w, None if s.bias is None else getattr(self, s.bias)

    def add(self, x: Tensor, residual: Tensor, out_dtype: torch.dtype | None = None,
            maxima: tuple[bool, bool] = (False, False)) -> tuple[Tensor, Tensor]:
        """(x + residual, this norm of it), the add inside the norm's kernel forward and backward
        (``ops.add_layer_norm``); the norm in ``out_dtype`` (default: the original norm's dtype for s).
        ``maxima`` is FusedRMSNorm's interface; LayerNorms produce no FP8 maxima."""
        w, b = self._wb(x, torch.promote_types(x.dtype, residual.dtype))
        F.check_add_rms_norm(x, residual, w, out_dtype)  # the same checks: floats, shapes, one device
        if b is not None:
            F._check_vector("layer_norm", "bias", b, x.shape[-1])
        s_dtype = torch.promote_types(x.dtype, residual.dtype)
        out = out_dtype or _out_dtype(self.spec, x, w, s_dtype)
        if torch.promote_types(s_dtype, out) != s_dtype:  # a wider output than s (CUDA autocast, bf16 s): plain path
            s = x + residual
            return s, self(s).to(out)
        s, y = ops.add_layer_norm(x, residual, w, b, float(self.spec.eps), F.backend_for(self.backend, x.device))
        return s, (y if out == y.dtype else y.to(out))

    def opening_residual(self, x: Tensor, out_dtype: torch.dtype | None = None,
                         maxima: bool = False) -> tuple[Tensor, Tensor]:
        """(this norm of x, x) for a block that adds x back: x's two gradients are summed in the norm's
        backward kernel (``ops.layer_norm_opening_residual``)."""
        w, b = self._wb(x)
        out = out_dtype or _out_dtype(self.spec, x, w)
        if out != x.dtype and torch.promote_types(x.dtype, out) != x.dtype:  # a wider output: the plain path
            return self(x).to(out), x
        device = F.check_rms_norm(x, w)
        y, x = ops.layer_norm_opening_residual(x, w, b, float(self.spec.eps), F.backend_for(self.backend, device))
        return (y if out == y.dtype else y.to(out)), x
