"""A decoder layer whose norms normalise each block's output before its residual add (``ResidualNormSpec.post_block``:
OLMo-2, OLMo-3, EXAONE 4, FlexOlmo):

    x ─ attention ─ norm_in ─ (+ x) ─ h ─ MLP ─ norm_mid ─ (+ h) ─ out

Each norm and the add after it run as one forward kernel (``ops.rms_norm_add``: reads the block's output and the
residual, writes the sum and rstd; unfused, the norm writes its output and an add kernel reads it back). Backward:
the residual's gradient is the sum's, the block output's the norm's backward of it (``rms_norm_bwd``). h's two
gradients (from the MLP's input and from ``out``) are summed by autograd, as unfused.
"""
from __future__ import annotations

import torch
from torch import nn

from torchfuser import functional as F, ops
from torchfuser.modules._layer_blocks import as_class, attend, child
from torchfuser.modules.base import decided
from torchfuser.modules.norms import FusedRMSNorm, _out_dtype
from torchfuser.ops._call import autocast_enabled


def unfused(layer: nn.Module, spec) -> str | None:
    """Why the fused path cannot use the layer's norms' kernels, or None."""
    norms = (child(layer, spec.norm_in), child(layer, spec.norm_mid))
    for n in norms:
        if not isinstance(n, FusedRMSNorm):
            return "its post-block norms are no longer fused RMSNorms"
    if not as_class(*norms):
        return "hooks (or a forward of their own) on its norms: the fused path would skip them"
    return None


def norm_then_add(norm: FusedRMSNorm, a: torch.Tensor, residual: torch.Tensor) -> torch.Tensor:
    """``residual + norm(a)`` in one forward kernel: the norm in the dtype the original norm returns for a (its
    spec's rule, under autocast on a GPU its autocast rule), the sum in torch's promoted dtype."""
    s = norm.spec
    w = norm.kernel_weight(a)
    on = a.device.type != "cpu" and autocast_enabled(a.device.type)  # (read by _out_dtype: in the key)
    key = ("post_block", (type(a), a.dtype, a.device, a.shape), (type(residual), residual.dtype, residual.device),
           (type(w), w.dtype, w.device, w.shape), norm.backend, on)

    def decide():
        y_dtype = _out_dtype(s, a, w)
        return y_dtype, F.backend_for(norm.backend, F.check_rms_norm_add(a, residual, w, y_dtype))
    y_dtype, backend = decided(norm, key, decide)
    return ops.rms_norm_add(a, residual, w, float(s.eps), float(s.offset), backend, y_dtype)


def forward(fused, call: dict, x: torch.Tensor, attention, mlp) -> torch.Tensor:
    """The layer's output (``fused``: its ``ResidualNormForward``), from its input x and the attention's keywords."""
    layer, s = fused.layer, fused.spec
    a = attend(attention, (x,) * s.attention_repeats, s.attention_input, call)
    h = norm_then_add(child(layer, s.norm_in), a if s.attention_single else a[0], x)
    out = norm_then_add(child(layer, s.norm_mid), mlp(h), h)
    return fused._output(out, a)
