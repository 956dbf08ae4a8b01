"""Norm then add: out = r + rms_norm(a)·(offset + w), the add after the norm (post-block norms, OLMo-2).

y = a · rsqrt(mean(a²) + eps) · (offset + w) is computed in fp32 and rounded once, to ``y_dtype`` (default a's):
the dtype the original norm returns. out = r + y in torch's promoted dtype of r and y, as the unfused
``residual + norm(a)``. Saved for the backward: a, w and rstd (fp32, one per row); out is not needed.
Backward: dr = dout (cast to r's dtype), dy = dout rounded to y's dtype, and (da, dw) the norm's backward of dy.
"""
from __future__ import annotations

import torch

from .rms_norm import rms_norm_bwd, rms_norm_fwd


def check_shapes(a, r):
    if a.shape != r.shape:
        raise ValueError(f"rms_norm_add: a and r must have the same shape (no broadcasting), got {tuple(a.shape)} "
                         f"and {tuple(r.shape)}")


def out_dtype(a_dtype: torch.dtype, r_dtype: torch.dtype, y_dtype: torch.dtype | None) -> torch.dtype:
    return torch.promote_types(r_dtype, y_dtype or a_dtype)


def norm_then_add(norm_fwd, a, r, weight, eps, offset, y_dtype):
    """(out, rstd) from a backend's ``rms_norm_fwd``: the norm rounded once to y's dtype (a widened first where
    y is wider than a, so the backend's kernel rounds nowhere else), then torch's add."""
    check_shapes(a, r)
    yd = y_dtype or a.dtype
    wide = torch.promote_types(a.dtype, yd)
    y, rstd = norm_fwd(a if wide == a.dtype else a.to(wide), weight, eps, offset, yd)
    return torch.add(r, y).contiguous(), rstd


def norm_bwd_of_sum(norm_bwd, dout, a, weight, rstd, eps, offset, y_dtype):
    """(da, dw) from a backend's ``rms_norm_bwd``: dout rounded to y's dtype (autograd's cast of the add's
    gradient), the norm's backward of it; a widened first where y is wider (da rounded once, to a's dtype)."""
    yd = y_dtype or a.dtype
    dy = dout if dout.dtype == yd else dout.to(yd)
    wide = torch.promote_types(a.dtype, yd)
    if wide == a.dtype:
        return norm_bwd(dy, a, weight, rstd, eps, offset)
    da, dw = norm_bwd(dy, a.to(wide), weight, rstd, eps, offset)
    return da.to(a.dtype), dw


def rms_norm_add_fwd(a, r, weight, eps, offset, y_dtype=None):
    return norm_then_add(rms_norm_fwd, a, r, weight, eps, offset, y_dtype)


def rms_norm_add_bwd(dout, a, weight, rstd, eps, offset, y_dtype=None):
    return norm_bwd_of_sum(rms_norm_bwd, dout, a, weight, rstd, eps, offset, y_dtype)
