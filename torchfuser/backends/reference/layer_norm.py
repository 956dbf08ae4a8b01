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


def add_layer_norm_fwd(x, r, weight, bias, eps):
    """(s, y, mean, rstd) with s = x + r in torch's promoted dtype, normalised as stored (rounded)."""
    if x.shape != r.shape:
        raise ValueError(f"add_layer_norm: x and r must have the same shape (no broadcasting), got {tuple(x.shape)} "
                         f"and {tuple(r.shape)}")
    s = torch.add(x, r).contiguous()
    return (s, *layer_norm_fwd(s, weight, bias, eps))


def layer_norm_res_bwd(dy, x, weight, bias, mean, rstd, eps, dres=None):
    """layer_norm_bwd's (dx, dw, db), with ``dres`` (the residual stream's gradient) added to dx in the
    compute dtype, before dx's one rounding."""
    if dres is None:
        return layer_norm_bwd(dy, x, weight, bias, mean, rstd, eps)
    if dres.shape != x.shape:
        raise ValueError(f"layer_norm_bwd: dres must have x's shape {tuple(x.shape)}, got {tuple(dres.shape)}")
    ct = compute_dtype(x, weight)
    dx, dw, db = vjp(lambda a, w, b: layer_norm(a, w, b, eps)[0].to(ct), (x.to(ct), weight, bias), dy.to(ct))
    if db is None:
        db = weight.new_empty(0)
    return (dx + dres.to(ct)).to(x.dtype).contiguous(), dw.contiguous(), db.contiguous()
