"""Fused RMSNorm and LayerNorm. They own the original ``weight`` / ``bias`` parameters."""
from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor, nn

from torchfuser import functional as F, ops
from torchfuser.modules.base import FusedModule, adopt
from torchfuser.ops.rms_norm import add_rms_norm_fp8_producer


@dataclass(frozen=True)
class RMSNormSpec:
    """y = x · rsqrt(mean(x²) + eps) · (offset + w); Gemma-style norms have offset 1."""

    eps: float
    offset: float = 0.0
    weight: str = "weight"


@dataclass(frozen=True)
class LayerNormSpec:
    """y = (x − mean) · rsqrt(var + eps) · w + b; ``bias`` is None for bias-free norms."""

    eps: float
    weight: str = "weight"
    bias: str | None = "bias"


class FusedRMSNorm(FusedModule):
    def __init__(self, original: nn.Module, spec: RMSNormSpec, backend: str = "auto"):
        super().__init__(spec, backend)
        adopt(self, original, [spec.weight])

    def forward(self, x: Tensor) -> Tensor:
        s = self.spec
        return F.rms_norm(x, getattr(self, s.weight), s.eps, offset=s.offset, backend=self.backend)

    def add(self, x: Tensor, residual: Tensor, out_dtype: torch.dtype | None = None,
            maxima: tuple[bool, bool] = (False, False)) -> tuple[Tensor, Tensor]:
        """(x + residual, this norm of it) in one kernel, forward and backward; the norm in ``out_dtype``.
        ``maxima``: whether the norm's output, and residual's gradient, hand their FP8 maxima on to the
        GEMMs that take them (plain eager; ``modules.fp8.producer_maxima`` decides)."""
        s = self.spec
        if not any(maxima):
            return F.add_rms_norm(x, residual, getattr(self, s.weight), s.eps, offset=s.offset, out_dtype=out_dtype,
                                  backend=self.backend)
        weight = getattr(self, s.weight)
        backend = F.backend_for(self.backend, F.check_add_rms_norm(x, residual, weight, out_dtype))
        return add_rms_norm_fp8_producer(x, residual, weight, float(s.eps), float(s.offset), backend,
                                         out_dtype, *maxima)

    def opening_residual(self, x: Tensor, out_dtype: torch.dtype | None = None,
                         maxima: bool = False) -> tuple[Tensor, Tensor]:
        """(this norm of x in ``out_dtype``, x) for a block that adds x back: x's two gradients are summed
        in the norm's backward kernel (``ops.rms_norm_opening_residual``). ``maxima``: whether the norm's
        output hands its FP8 maxima on, as in ``add``."""
        s, weight = self.spec, getattr(self, self.spec.weight)
        device = F.check_rms_norm(x, weight)
        return ops.rms_norm_opening_residual(x, weight, float(s.eps), float(s.offset), F.backend_for(self.backend, device),
                                             out_dtype, maxima)


class FusedLayerNorm(FusedModule):
    def __init__(self, original: nn.Module, spec: LayerNormSpec, backend: str = "auto"):
        super().__init__(spec, backend)
        adopt(self, original, [n for n in (spec.weight, spec.bias) if n is not None])

    def forward(self, x: Tensor) -> Tensor:
        s = self.spec
        bias = None if s.bias is None else getattr(self, s.bias)
        return F.layer_norm(x, getattr(self, s.weight), bias, s.eps, backend=self.backend)
