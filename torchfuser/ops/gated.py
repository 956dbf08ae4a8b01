"""swiglu / geglu / geglu_erf (gate, up → act(gate)·up; or one packed [gate | up] tensor) and gelu; nothing
is saved but the inputs."""
from __future__ import annotations

import torch
from torch import Tensor

from . import fp8_quant
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


def _define_packed(name: str):
    """The same activation on one [gate | up] tensor; its backward returns one [dgate | dup]."""

    @torch.library.custom_op(f"torchfuser::{name}_packed_fwd", mutates_args=())
    def fwd(gate_up: Tensor, backend: str) -> Tensor:
        return kernel(backend, f"{name}_packed_fwd")(gate_up)

    @fwd.register_fake
    def _(gate_up, backend):
        return gate_up.new_empty((*gate_up.shape[:-1], gate_up.shape[-1] // 2))

    @torch.library.custom_op(f"torchfuser::{name}_packed_bwd", mutates_args=())
    def bwd(dy: Tensor, gate_up: Tensor, backend: str) -> Tensor:
        return kernel(backend, f"{name}_packed_bwd")(dy, gate_up)

    @bwd.register_fake
    def _(dy, gate_up, backend):
        return gate_up.new_empty(gate_up.shape)

    def setup(ctx, inputs, output):
        ctx.save_for_backward(inputs[0])
        ctx.backend = inputs[1]

    def backward(ctx, dy):
        (gate_up,) = ctx.saved_tensors
        return run(bwd, dy, gate_up, ctx.backend), None

    return fwd, bwd, autograd(fwd, setup, backward)


swiglu_fwd, swiglu_bwd, _swiglu = _define_gated("swiglu")
geglu_fwd, geglu_bwd, _geglu = _define_gated("geglu")
swiglu_packed_fwd, swiglu_packed_bwd, _swiglu_packed = _define_packed("swiglu")
geglu_packed_fwd, geglu_packed_bwd, _geglu_packed = _define_packed("geglu")
geglu_erf_fwd, geglu_erf_bwd, _geglu_erf = _define_gated("geglu_erf")  # exact (erf) GELU
geglu_erf_packed_fwd, geglu_erf_packed_bwd, _geglu_erf_packed = _define_packed("geglu_erf")


def swiglu(gate: Tensor, up: Tensor, backend: str) -> Tensor:
    return _swiglu(gate, up, backend)


def geglu(gate: Tensor, up: Tensor, backend: str) -> Tensor:
    return _geglu(gate, up, backend)


def geglu_erf(gate: Tensor, up: Tensor, backend: str) -> Tensor:
    return _geglu_erf(gate, up, backend)


def geglu_erf_packed(gate_up: Tensor, backend: str) -> Tensor:
    return _geglu_erf_packed(gate_up, backend)


def swiglu_packed(gate_up: Tensor, backend: str) -> Tensor:
    return _swiglu_packed(gate_up, backend)


def geglu_packed(gate_up: Tensor, backend: str) -> Tensor:
    return _geglu_packed(gate_up, backend)


class _PackedFP8(torch.autograd.Function):
    """The packed activation (eager only) as the producer of an FP8 GEMM's operand: its output, and with
    ``grad_amax`` its gradient, carries its maxima to the GEMM that takes it (``fp8_quant.attach_amax``);
    bit for bit the packed op's values."""

    @staticmethod
    def forward(ctx, gate_up, name, backend, grad_amax):
        ctx.save_for_backward(gate_up)
        ctx.name, ctx.backend, ctx.grad_amax = name, backend, grad_amax
        return fp8_quant.attach_amax(*fp8_quant.producer(backend, f"{name}_packed_fwd")(gate_up))

    @staticmethod
    def backward(ctx, dy):
        (gate_up,) = ctx.saved_tensors
        if ctx.grad_amax:
            d = fp8_quant.attach_amax(*fp8_quant.producer(ctx.backend, f"{ctx.name}_packed_bwd")(dy, gate_up))
        else:
            d = kernel(ctx.backend, f"{ctx.name}_packed_bwd")(dy, gate_up)
        return d, None, None, None


def packed_fp8_producer(name: str, gate_up: Tensor, backend: str, grad_amax: bool) -> Tensor:
    """``{name}_packed(gate_up)`` whose output (and with ``grad_amax`` gradient) hands its FP8 maxima on.
    Plain eager only: the caller checks (``_call.plain_eager``)."""
    return _PackedFP8.apply(gate_up, name, backend, grad_amax)


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
