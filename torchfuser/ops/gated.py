"""swiglu / geglu (gate, up → act(gate)·up) and gelu; nothing is saved but the inputs."""
from __future__ import annotations

import torch
from torch import Tensor

from ._call import autograd, kernel, run


def _define_gated(name: str):
    @torch.library.custom_op(f"torchfuser::{name}_fwd", mutates_args=())
    def fwd(gate: Tensor, up: Tensor, backend: str) -> Tensor:
        return kernel(backend, f"{name}_fwd")(gate, up)

    @fwd.register_fake
    def _(gate, up, backend):
        return gate.new_empty(gate.shape)

    @torch.library.custom_op(f"torchfuser::{name}_bwd", mutates_args=())
    def bwd(dy: Tensor, gate: Tensor, up: Tensor, backend: str) -> tuple[Tensor, Tensor]:
        return kernel(backend, f"{name}_bwd")(dy, gate, up)

    @bwd.register_fake
    def _(dy, gate, up, backend):
        return gate.new_empty(gate.shape), up.new_empty(up.shape)

    def setup(ctx, inputs, output):
        gate, up, backend = inputs
        ctx.save_for_backward(gate, up)
        ctx.backend = backend

    def backward(ctx, dy):
        gate, up = ctx.saved_tensors
        dgate, dup = run(bwd, dy, gate, up, ctx.backend)
        return dgate, dup, None

    return fwd, bwd, autograd(fwd, setup, backward)


swiglu_fwd, swiglu_bwd, _swiglu = _define_gated("swiglu")
geglu_fwd, geglu_bwd, _geglu = _define_gated("geglu")


def swiglu(gate: Tensor, up: Tensor, backend: str) -> Tensor:
    return _swiglu(gate, up, backend)


def geglu(gate: Tensor, up: Tensor, backend: str) -> Tensor:
    return _geglu(gate, up, backend)


@torch.library.custom_op("torchfuser::gelu_fwd", mutates_args=())
def gelu_fwd(x: Tensor, approximate: str, backend: str) -> Tensor:
    return kernel(backend, "gelu_fwd")(x, approximate)


@gelu_fwd.register_fake
def _(x, approximate, backend):
    return x.new_empty(x.shape)


@torch.library.custom_op("torchfuser::gelu_bwd", mutates_args=())
def gelu_bwd(dy: Tensor, x: Tensor, approximate: str, backend: str) -> Tensor:
    return kernel(backend, "gelu_bwd")(dy, x, approximate)


@gelu_bwd.register_fake
def _(dy, x, approximate, backend):
    return x.new_empty(x.shape)


def _gelu_setup(ctx, inputs, output):
    ctx.save_for_backward(inputs[0])
    ctx.args = inputs[1:]


def _gelu_backward(ctx, dy):
    (x,) = ctx.saved_tensors
    return run(gelu_bwd, dy, x, *ctx.args), None, None


_gelu = autograd(gelu_fwd, _gelu_setup, _gelu_backward)


def gelu(x: Tensor, approximate: str, backend: str) -> Tensor:
    return _gelu(x, approximate, backend)
