"""RMSNorm: y = x · rsqrt(mean(x²) + eps) · (offset + w), statistics in fp32, one rounding at the end."""
from __future__ import annotations

import torch

from ._autodiff import cast, compute_dtype, vjp, widened


def rms_norm(x, weight, eps: float, offset: float):
    """The definition. Returns (y, rstd); rstd has x's leading shape, in the compute dtype."""
    ct = compute_dtype(x, weight)
    xf = cast(x, ct)
    rstd = torch.rsqrt(xf.pow(2).mean(-1) + eps)
    w = cast(weight, ct)
    # offset 0 (all but Gemma-style norms): w itself, not w + 0 (the same values, one kernel less a call)
    y = xf * rstd.unsqueeze(-1) * (w + offset if offset else w)
    return cast(y, x.dtype), rstd


def rms_norm_fwd(x, weight, eps, offset, out_dtype=None):
    y, rstd = rms_norm(widened(x, out_dtype), weight, eps, offset)
    return cast(y, out_dtype or y.dtype).contiguous(), rstd.contiguous()


def rms_norm_infer(x, weight, eps, offset, out_dtype=None):
    """``rms_norm_fwd`` for a call with no backward (``ops._call.nograd_forward``): the same arithmetic, the
    statistic kept as a column (one ATen call less) and not returned (None). Tensors of their own, never views
    (``ops._call`` calls the ``_infer`` kernels unwrapped)."""
    x = widened(x, out_dtype)
    ct = compute_dtype(x, weight)
    xf = x if x.dtype == ct else x.to(ct)  # (inline, not cast(): host time, a decode step calls this per norm)
    w = weight if weight.dtype == ct else weight.to(ct)
    y = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps) * (w + offset if offset else w)
    if y.dtype != x.dtype:  # rounded to x's dtype first, as rms_norm_fwd
        y = y.to(x.dtype)
    return (y if out_dtype is None or out_dtype == y.dtype else y.to(out_dtype)), None


def add_rms_norm_infer(x, r, weight, eps, offset, out_dtype=None):
    return add_then_norm(rms_norm_infer, x, r, weight, eps, offset, out_dtype)


def add_then_norm(norm_fwd, x, r, weight, eps, offset, out_dtype):
    """add_rms_norm_fwd from a backend's ``rms_norm_fwd``: (s, y, rstd) with s = x + r in torch's
    promoted dtype, normalised as stored (rounded)."""
    if x.shape != r.shape:
        raise ValueError(f"add_rms_norm: x and r must have the same shape (no broadcasting), got {tuple(x.shape)} "
                         f"and {tuple(r.shape)}")
    s = torch.add(x, r).contiguous()
    return (s, *norm_fwd(s, weight, eps, offset, out_dtype))


def norm_bwd_then_cast(norm_bwd, dy, s, weight, rstd, eps, offset, ds, r_dtype):
    """add_rms_norm_bwd from a backend's ``rms_norm_bwd``: (dx, dr, dw), dr being dx (which includes
    ds) cast to the residual branch's dtype."""
    dx, dw = norm_bwd(dy, s, weight, rstd, eps, offset, ds)
    return dx, dx.to(r_dtype), dw


def add_rms_norm_fwd(x, r, weight, eps, offset, out_dtype=None):
    return add_then_norm(rms_norm_fwd, x, r, weight, eps, offset, out_dtype)


def add_rms_norm_bwd(dy, s, weight, rstd, eps, offset, ds, r_dtype):
    return norm_bwd_then_cast(rms_norm_bwd, dy, s, weight, rstd, eps, offset, ds, r_dtype)


def rms_norm_bwd(dy, x, weight, rstd, eps, offset, dres=None):
    """(dx, dw); with ``dres`` (the residual stream's gradient) dx + dres, summed in the compute dtype.
    dy may come in a lower precision than x (a norm whose output was asked for in bf16) or a higher one (a bf16
    x whose norm was asked for in fp32): dx is rounded once, to x's dtype."""
    wide = torch.promote_types(dy.dtype, x.dtype)
    dy = cast(dy, wide)
    if dres is None:
        dx, dw = vjp(lambda a, w: rms_norm(a, w, eps, offset)[0], (cast(x, wide), weight), dy)
        return cast(dx, x.dtype).contiguous(), dw.contiguous()
    if dres.shape != x.shape:
        raise ValueError(f"rms_norm_bwd: dres must have x's shape {tuple(x.shape)}, got {tuple(dres.shape)}")
    ct = compute_dtype(x, weight)
    # The vjp in the compute dtype (x upcast inside the graph), so dx is rounded once, after the add.
    dx, dw = vjp(lambda a, w: rms_norm(a, w, eps, offset)[0].to(ct), (x.to(ct), weight), dy.to(ct))
    return (dx + dres.to(ct)).to(x.dtype).contiguous(), dw.contiguous()
