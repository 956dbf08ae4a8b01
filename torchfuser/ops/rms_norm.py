from __future__ import annotations

import torch
from torch import Tensor

from ._call import autograd, kernel, run


@torch.library.custom_op("torchfuser::rms_norm_fwd", mutates_args=())
def rms_norm_fwd(x: Tensor, weight: Tensor, eps: float, offset: float, backend: str) -> tuple[Tensor, Tensor]:
    return kernel(backend, "rms_norm_fwd")(x, weight, eps, offset)


@rms_norm_fwd.register_fake
def _(x, weight, eps, offset, backend):
    return x.new_empty(x.shape), x.new_empty(x.shape[:-1], dtype=torch.float32)


@torch.library.custom_op("torchfuser::rms_norm_bwd", mutates_args=())
def rms_norm_bwd(
    dy: Tensor, x: Tensor, weight: Tensor, rstd: Tensor, eps: float, offset: float, backend: str
) -> tuple[Tensor, Tensor]:
    return kernel(backend, "rms_norm_bwd")(dy, x, weight, rstd, eps, offset)


@rms_norm_bwd.register_fake
def _(dy, x, weight, rstd, eps, offset, backend):
    return x.new_empty(x.shape), weight.new_empty(weight.shape)


def _setup(ctx, inputs, output):
    x, weight, eps, offset, backend = inputs
    ctx.save_for_backward(x, weight, output[1])
    ctx.args = (eps, offset, backend)


def _backward(ctx, dy, _drstd):
    x, weight, rstd = ctx.saved_tensors
    dx, dw = run(rms_norm_bwd, dy, x, weight, rstd, *ctx.args)
    return dx, dw, None, None, None


_rms_norm = autograd(rms_norm_fwd, _setup, _backward)


def rms_norm(x: Tensor, weight: Tensor, eps: float, offset: float, backend: str) -> Tensor:
    return _rms_norm(x, weight, eps, offset, backend)[0]
