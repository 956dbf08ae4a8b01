"""RMSNorm: y = x · rsqrt(mean(x²) + eps) · (offset + w), statistics in fp32, one rounding at the end."""
from __future__ import annotations

import torch

from ._autodiff import compute_dtype, vjp


def rms_norm(x, weight, eps: float, offset: float):
    """The definition. Returns (y, rstd); rstd has x's leading shape, in the compute dtype."""
    ct = compute_dtype(x, weight)
    xf = x.to(ct)
    rstd = torch.rsqrt(xf.pow(2).mean(-1) + eps)
    y = xf * rstd.unsqueeze(-1) * (weight.to(ct) + offset)
    return y.to(x.dtype), rstd


def rms_norm_fwd(x, weight, eps, offset):
    y, rstd = rms_norm(x, weight, eps, offset)
    return y.contiguous(), rstd.contiguous()


def rms_norm_bwd(dy, x, weight, rstd, eps, offset):
    dx, dw = vjp(lambda a, w: rms_norm(a, w, eps, offset)[0], (x, weight), dy)
    return dx.contiguous(), dw.contiguous()
