from __future__ import annotations

from typing import Optional

import torch
from torch import Tensor

from ._call import autograd, kernel, run


@torch.library.custom_op("torchfuser::layer_norm_fwd", mutates_args=())
def layer_norm_fwd(
    x: Tensor, weight: Tensor, bias: Optional[Tensor], eps: float, backend: str
) -> tuple[Tensor, Tensor, Tensor]:
    return kernel(backend, "layer_norm_fwd")(x, weight, bias, eps)


@layer_norm_fwd.register_fake
def _(x, weight, bias, eps, backend):
    stat = x.new_empty(x.shape[:-1], dtype=torch.float32)
    return x.new_empty(x.shape), stat, stat.clone()


@torch.library.custom_op("torchfuser::layer_norm_bwd", mutates_args=())
def layer_norm_bwd(
    dy: Tensor, x: Tensor, weight: Tensor, bias: Optional[Tensor], mean: Tensor, rstd: Tensor, eps: float, backend: str
) -> tuple[Tensor, Tensor, Tensor]:
    """Returns (dx, dweight, dbias); dbias is empty when there is no bias."""
    return kernel(backend, "layer_norm_bwd")(dy, x, weight, bias, mean, rstd, eps)


@layer_norm_bwd.register_fake
def _(dy, x, weight, bias, mean, rstd, eps, backend):
    db = weight.new_empty(0) if bias is None else bias.new_empty(bias.shape)
    return x.new_empty(x.shape), weight.new_empty(weight.shape), db


def _setup(ctx, inputs, output):
    x, weight, bias, eps, backend = inputs
    ctx.save_for_backward(x, weight, bias, output[1], output[2])
    ctx.args = (eps, backend)


def _backward(ctx, dy, _dmean, _drstd):
    x, weight, bias, mean, rstd = ctx.saved_tensors
    dx, dw, db = run(layer_norm_bwd, dy, x, weight, bias, mean, rstd, *ctx.args)
    return dx, dw, (db if bias is not None else None), None, None


_layer_norm = autograd(layer_norm_fwd, _setup, _backward)


def layer_norm(x: Tensor, weight: Tensor, bias: Tensor | None, eps: float, backend: str) -> Tensor:
    return _layer_norm(x, weight, bias, eps, backend)[0]
