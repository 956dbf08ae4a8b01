"""activation (x → relu(x) or relu(x)², the plain MLP's hidden activation besides GELU); nothing is saved
but the input."""
from __future__ import annotations

import torch
from torch import Tensor

from ._call import autograd, kernel, run


@torch.library.custom_op("torchfuser::activation_fwd", mutates_args=())
def activation_fwd(x: Tensor, kind: str, backend: str) -> Tensor:
    return kernel(backend, "activation_fwd")(x, kind)


@activation_fwd.register_fake
def _(x, kind, backend):
    return x.new_empty(x.shape)


@torch.library.custom_op("torchfuser::activation_bwd", mutates_args=())
def activation_bwd(dy: Tensor, x: Tensor, kind: str, backend: str) -> Tensor:
    return kernel(backend, "activation_bwd")(dy, x, kind)


@activation_bwd.register_fake
def _(dy, x, kind, backend):
    return x.new_empty(x.shape)


def _setup(ctx, inputs, output):
    ctx.save_for_backward(inputs[0])
    ctx.args = inputs[1:]


def _backward(ctx, dy):
    (x,) = ctx.saved_tensors
    return run(activation_bwd, dy, x, *ctx.args), None, None


_activation = autograd(activation_fwd, _setup, _backward)


def activation(x: Tensor, kind: str, backend: str) -> Tensor:
    return _activation(x, kind, backend)
