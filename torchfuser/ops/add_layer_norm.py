"""Residual adds inside LayerNorm: ``add_layer_norm`` (s = x + r and its norm in one kernel, forward and
backward) and ``layer_norm_opening_residual`` (a norm whose input is also a residual, its two gradients
summed in the norm's backward kernel). The LayerNorm twins of ``ops.rms_norm``'s add_rms_norm and
rms_norm_opening_residual. Saved: s (or x), w, b and mean, rstd (fp32, one per row)."""
from __future__ import annotations

from typing import Optional

import torch
from torch import Tensor

from ._call import autograd, empty, kernel, plain_eager, run
from .layer_norm import layer_norm


@torch.library.custom_op("torchfuser::add_layer_norm_fwd", mutates_args=())
def add_layer_norm_fwd(
    x: Tensor, r: Tensor, weight: Tensor, bias: Optional[Tensor], eps: float, backend: str
) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    return kernel(backend, "add_layer_norm_fwd")(x, r, weight, bias, eps)


@add_layer_norm_fwd.register_fake
def _(x, r, weight, bias, eps, backend):
    s = x.new_empty(x.shape, dtype=torch.result_type(x, r))
    stat = x.new_empty(x.shape[:-1], dtype=torch.float32)
    return s, s.new_empty(s.shape), stat, stat.clone()


@torch.library.custom_op("torchfuser::layer_norm_res_bwd", mutates_args=())
def layer_norm_res_bwd(
    dy: Tensor, x: Tensor, weight: Tensor, bias: Optional[Tensor], mean: Tensor, rstd: Tensor, eps: float,
    dres: Optional[Tensor], backend: str,
) -> tuple[Tensor, Tensor, Tensor]:
    """(dx + dres, dw, db); db is empty when there is no bias."""
    return kernel(backend, "layer_norm_res_bwd")(dy, x, weight, bias, mean, rstd, eps, dres)


@layer_norm_res_bwd.register_fake
def _(dy, x, weight, bias, mean, rstd, eps, dres, backend):
    db = weight.new_empty(0) if bias is None else bias.new_empty(bias.shape)
    return x.new_empty(x.shape), weight.new_empty(weight.shape), db


def _setup(ctx, inputs, output):
    x, r, weight, bias, eps, backend = inputs
    ctx.save_for_backward(output[0], weight, bias, output[2], output[3])
    ctx.args = (eps, backend)
    ctx.dtypes = (x.dtype, r.dtype)


def _backward(ctx, ds, dy, _dmean, _drstd):
    # s feeds the norm and the next residual add: its two gradients are summed in the norm's backward kernel.
    s, weight, bias, mean, rstd = ctx.saved_tensors
    x_dtype, r_dtype = ctx.dtypes
    eps, backend = ctx.args
    if dy is None:
        dx, dr = (None, None) if ds is None else (ds.to(x_dtype), ds.to(r_dtype))
        return dx, dr, None, None, None, None
    dsum, dw, db = run(layer_norm_res_bwd, dy, s, weight, bias, mean, rstd, eps, ds, backend)
    return dsum.to(x_dtype), dsum.to(r_dtype), dw, (db if bias is not None else None), None, None


# Not elementwise for Inductor: under torch.compile the custom op runs (the residual layer's forward
# hands traced calls to the original forward anyway).
_add_layer_norm = autograd(add_layer_norm_fwd, _setup, _backward, elementwise=False)


def add_layer_norm(x: Tensor, r: Tensor, weight: Tensor, bias: Tensor | None, eps: float,
                   backend: str) -> tuple[Tensor, Tensor]:
    """(s, layer_norm(s)) with s = x + r (torch's promoted dtype); the norm in s's dtype."""
    if x.shape != r.shape:
        raise ValueError(f"add_layer_norm: x and r must have the same shape (no broadcasting), got {tuple(x.shape)} "
                         f"and {tuple(r.shape)}")
    backend = "reference" if empty(x, r, weight) else backend
    s, y, _, _ = _add_layer_norm(x, r, weight, bias, float(eps), backend)
    return s, y


class _LayerNormOpeningResidual(torch.autograd.Function):
    """y = layer_norm(x), and x itself (see ``rms_norm._NormOpeningResidual``): the residual's gradient
    comes back into this node and is added inside the norm's backward kernel."""

    @staticmethod
    def forward(ctx, x, weight, bias, eps, backend):
        ctx.set_materialize_grads(False)
        y, mean, rstd = kernel(backend, "layer_norm_fwd")(x, weight, bias, eps)
        ctx.save_for_backward(x, weight, bias, mean, rstd)
        ctx.args = (eps, backend)
        return y, x.view_as(x)

    @staticmethod
    def backward(ctx, dy, dres):
        x, weight, bias, mean, rstd = ctx.saved_tensors
        if dy is None:
            return dres, None, None, None, None
        dx, dw, db = run(layer_norm_res_bwd, dy, x, weight, bias, mean, rstd, *ctx.args[:1], dres, ctx.args[1])
        return dx, dw, (db if bias is not None else None), None, None


def layer_norm_opening_residual(x: Tensor, weight: Tensor, bias: Tensor | None, eps: float,
                                backend: str) -> tuple[Tensor, Tensor]:
    """(layer_norm(x), x) for a block that adds x back to its output. Only plain eager calls take the
    joint backward: traced and compiled code sees two uses of x."""
    backend = "reference" if empty(x, weight) else backend
    if plain_eager((x, weight, bias)):
        return _LayerNormOpeningResidual.apply(x, weight, bias, float(eps), backend)
    return layer_norm(x, weight, bias, float(eps), backend), x
