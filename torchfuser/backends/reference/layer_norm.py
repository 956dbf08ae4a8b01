"""LayerNorm: y = (x − mean) · rsqrt(var + eps) · w + b, statistics in fp32."""
from __future__ import annotations

import torch

from ._autodiff import compute_dtype, vjp


def layer_norm(x, weight, bias, eps: float):
    """The definition. Returns (y, mean, rstd)."""
    ct = compute_dtype(x, weight)
    xf = x.to(ct)
    mean = xf.mean(-1)
    xc = xf - mean.unsqueeze(-1)
    rstd = torch.rsqrt(xc.pow(2).mean(-1) + eps)
    y = xc * rstd.unsqueeze(-1) * weight.to(ct)
    if bias is not None:
        y = y + bias.to(ct)
    return y.to(x.dtype), mean, rstd


def layer_norm_fwd(x, weight, bias, eps):
    y, mean, rstd = layer_norm(x, weight, bias, eps)
    return y.contiguous(), mean.contiguous(), rstd.contiguous()


def layer_norm_bwd(dy, x, weight, bias, mean, rstd, eps):
    dx, dw, db = vjp(lambda a, w, b: layer_norm(a, w, b, eps)[0], (x, weight, bias), dy)
    if db is None:
        db = weight.new_empty(0)
    return dx.contiguous(), dw.contiguous(), db.contiguous()
