from __future__ import annotations

import torch
from torch import Tensor

from . import fp8_quant
from ._call import _plain_rows, autograd, empty, kernel, nograd_forward, plain_eager, run


@torch.library.custom_op("torchfuser::rms_norm_fwd", mutates_args=())
def rms_norm_fwd(
    x: Tensor, weight: Tensor, eps: float, offset: float, out_dtype: torch.dtype | None, backend: str
) -> tuple[Tensor, Tensor]:
    return kernel(backend, "rms_norm_fwd")(x, weight, eps, offset, out_dtype)


@rms_norm_fwd.register_fake
def _(x, weight, eps, offset, out_dtype, backend):
    return x.new_empty(x.shape, dtype=out_dtype or x.dtype), x.new_empty(x.shape[:-1], dtype=torch.float32)


@torch.library.custom_op("torchfuser::add_rms_norm_fwd", mutates_args=())
def add_rms_norm_fwd(
    x: Tensor, r: Tensor, weight: Tensor, eps: float, offset: float, out_dtype: torch.dtype | None, backend: str
) -> tuple[Tensor, Tensor, Tensor]:
    return kernel(backend, "add_rms_norm_fwd")(x, r, weight, eps, offset, out_dtype)


@add_rms_norm_fwd.register_fake
def _(x, r, weight, eps, offset, out_dtype, backend):
    s = x.new_empty(x.shape, dtype=torch.result_type(x, r))
    return s, s.new_empty(s.shape, dtype=out_dtype or s.dtype), x.new_empty(x.shape[:-1], dtype=torch.float32)


@torch.library.custom_op("torchfuser::rms_norm_bwd", mutates_args=())
def rms_norm_bwd(
    dy: Tensor, x: Tensor, weight: Tensor, rstd: Tensor, eps: float, offset: float, backend: str,
    dres: Tensor | None = None,
) -> tuple[Tensor, Tensor]:
    return kernel(backend, "rms_norm_bwd")(dy, x, weight, rstd, eps, offset, dres)


@rms_norm_bwd.register_fake
def _(dy, x, weight, rstd, eps, offset, backend, dres=None):
    return x.new_empty(x.shape), weight.new_empty(weight.shape)


@torch.library.custom_op("torchfuser::add_rms_norm_bwd", mutates_args=())
def add_rms_norm_bwd(
    dy: Tensor, s: Tensor, weight: Tensor, rstd: Tensor, eps: float, offset: float, backend: str,
    ds: Tensor | None, r_dtype: torch.dtype,
) -> tuple[Tensor, Tensor, Tensor]:
    return kernel(backend, "add_rms_norm_bwd")(dy, s, weight, rstd, eps, offset, ds, r_dtype)


@add_rms_norm_bwd.register_fake
def _(dy, s, weight, rstd, eps, offset, backend, ds, r_dtype):
    return s.new_empty(s.shape), s.new_empty(s.shape, dtype=r_dtype), weight.new_empty(weight.shape)


def _setup(ctx, inputs, output):
    x, weight, eps, offset, _, backend = inputs
    ctx.save_for_backward(x, weight, output[1])
    ctx.args = (eps, offset, backend)


def _backward(ctx, dy, _drstd):
    x, weight, rstd = ctx.saved_tensors
    dx, dw = run(rms_norm_bwd, dy, x, weight, rstd, *ctx.args)  # dx in x's dtype, whatever dy's
    return dx, dw, None, None, None, None


_rms_norm = autograd(rms_norm_fwd, _setup, _backward)


def rms_norm(
    x: Tensor, weight: Tensor, eps: float, offset: float, backend: str, out_dtype: torch.dtype | None = None
) -> Tensor:
    """The norm of x in ``out_dtype`` (default x's), computed in fp32 and rounded once, to it, and x's gradient
    rounded once, to x's dtype: a bf16 x whose norm is to be fp32 (Llama's rule with fp32 weights, Qwen3's q/k
    norms under autocast) is read as it is, neither widened by a cast kernel first nor saved widened.

    Rows that are not evenly strided (a head's rows of a joint projection's output, per-head q/k norms) are copied
    dense once, here, and that copy is what the backward reads: the kernels take one row stride, and would
    otherwise copy them in the forward and again in the backward."""
    if not x.is_contiguous() and not _evenly_strided_rows(x):
        x = x.contiguous()
    return _rms_norm(x, weight, eps, offset, out_dtype, backend)[0]


def _evenly_strided_rows(t: Tensor) -> bool:
    """Whether ``t`` reads as rows of its last dim (dense) one row stride apart: ``t.view(-1, n)`` works."""
    if t.dim() == 0 or t.stride(-1) != 1:
        return False
    try:
        t.view(-1, t.shape[-1])
    except RuntimeError:
        return False
    return True


def _add_setup(ctx, inputs, output):
    x, r, weight, eps, offset, _, backend = inputs
    ctx.save_for_backward(output[0], weight, output[2])
    ctx.args = (eps, offset, backend)
    ctx.dtypes = (x.dtype, r.dtype)


def _add_backward(ctx, ds, dy, _drstd):
    # s feeds both the norm and whatever the caller does with it (the next residual add): its two
    # gradients are summed inside the norm's backward kernel, then handed to x and r alike.
    s, weight, rstd = ctx.saved_tensors
    x_dtype, r_dtype = ctx.dtypes
    if dy is None:  # the norm's output is unused: s's gradient goes to both addends as it is
        dx, dr = (None, None) if ds is None else (ds.to(x_dtype), ds.to(r_dtype))
        return dx, dr, None, None, None, None, None
    if r_dtype == s.dtype:
        dsum, dw = run(rms_norm_bwd, dy, s, weight, rstd, *ctx.args, ds)
        dr = dsum
    else:  # the residual branch's lower-precision gradient written by the same kernel, not a cast after it
        dsum, dr, dw = run(add_rms_norm_bwd, dy, s, weight, rstd, *ctx.args, ds, r_dtype)
    return dsum.to(x_dtype), dr, dw, None, None, None, None


_add_rms_norm = autograd(add_rms_norm_fwd, _add_setup, _add_backward)


def add_rms_norm(
    x: Tensor, r: Tensor, weight: Tensor, eps: float, offset: float, backend: str, out_dtype: torch.dtype | None = None
) -> tuple[Tensor, Tensor]:
    """(s, rms_norm(s)) with s = x + r; the norm's output in ``out_dtype`` (default s's dtype)."""
    s, y, _ = _add_rms_norm(x, r, weight, eps, offset, out_dtype, backend)
    return s, y


class _AddRMSNormFP8(torch.autograd.Function):
    """add_rms_norm (eager only) as the producer of FP8 GEMM operands: with ``y_amax`` the norm's output,
    with ``dr_amax`` r's gradient, carries its maxima to the GEMM that takes it (``fp8_quant.attach_amax``);
    bit for bit add_rms_norm's values, the same saved tensors and backward otherwise."""

    @staticmethod
    def forward(ctx, x, r, weight, eps, offset, out_dtype, backend, y_amax, dr_amax):
        ctx.set_materialize_grads(False)
        args = (x, r, weight, eps, offset, out_dtype)
        if y_amax:
            s, y, rstd, amax = fp8_quant.producer(backend, "add_rms_norm_fwd", 1)(*args)
            fp8_quant.attach_amax(y, amax)
        else:
            s, y, rstd = kernel(backend, "add_rms_norm_fwd")(*args)
        _add_setup(ctx, (*args, backend), (s, y, rstd))
        ctx.dr_amax = dr_amax
        return s, y

    @staticmethod
    def backward(ctx, ds, dy):
        if not ctx.dr_amax or dy is None:
            return (*_add_backward(ctx, ds, dy, None), None, None)
        s, weight, rstd = ctx.saved_tensors
        x_dtype, r_dtype = ctx.dtypes
        eps, offset, backend = ctx.args
        if r_dtype == s.dtype:  # one gradient for x and r, as _add_backward's
            dsum, dw, amax = fp8_quant.producer(backend, "rms_norm_bwd")(dy, s, weight, rstd, eps, offset, ds)
            dr = dsum
        else:
            dsum, dr, dw, amax = fp8_quant.producer(backend, "add_rms_norm_bwd", 1)(
                dy, s, weight, rstd, eps, offset, ds, r_dtype)
        fp8_quant.attach_amax(dr, amax)
        return dsum.to(x_dtype), dr, dw, None, None, None, None, None, None


def add_rms_norm_fp8_producer(
    x: Tensor, r: Tensor, weight: Tensor, eps: float, offset: float, backend: str, out_dtype: torch.dtype | None,
    y_amax: bool, dr_amax: bool,
) -> tuple[Tensor, Tensor]:
    """``add_rms_norm`` whose output (``y_amax``) and r's gradient (``dr_amax``) hand their FP8 maxima on.
    Plain eager only: the caller checks (``_call.plain_eager``)."""
    return _AddRMSNormFP8.apply(x, r, weight, eps, offset, out_dtype, backend, y_amax, dr_amax)


class _NormOpeningResidual(torch.autograd.Function):
    """y = rms_norm(x), and x itself: the norm that opens a pre-norm residual block, whose input is
    also the block's residual. Autograd would sum x's two gradients with an add kernel of its own;
    here the residual's gradient comes back into this node and is added inside the norm's backward
    kernel. Saved: x, w and rstd, as for rms_norm."""

    @staticmethod
    def forward(ctx, x, weight, eps, offset, backend, out_dtype, y_amax):
        ctx.set_materialize_grads(False)
        if y_amax:  # y hands its maxima on to the FP8 GEMM that takes it (fp8_quant.attach_amax)
            y, rstd, amax = fp8_quant.producer(backend, "rms_norm_fwd")(x, weight, eps, offset, out_dtype)
            fp8_quant.attach_amax(y, amax)
        else:
            y, rstd = kernel(backend, "rms_norm_fwd")(x, weight, eps, offset, out_dtype)
        ctx.save_for_backward(x, weight, rstd)
        ctx.args = (eps, offset, backend)
        return y, x.view_as(x)

    @staticmethod
    def backward(ctx, dy, dres):
        x, weight, rstd = ctx.saved_tensors
        if dy is None:
            return dres, None, None, None, None, None, None
        dx, dw = run(rms_norm_bwd, dy, x, weight, rstd, *ctx.args, dres)
        return dx, dw, None, None, None, None, None


def rms_norm_opening_residual(
    x: Tensor, weight: Tensor, eps: float, offset: float, backend: str, out_dtype: torch.dtype | None = None,
    y_amax: bool = False,
) -> tuple[Tensor, Tensor]:
    """(rms_norm(x), x), for a block that adds x back to its output; see ``_NormOpeningResidual``.
    The norm's output in ``out_dtype`` (default x's); with ``y_amax`` it hands its FP8 maxima on (plain
    eager only: the caller checks). Only plain eager calls take the joint backward: traced and compiled
    code sees two uses of x."""
    if not y_amax and not torch.is_grad_enabled() and _plain_rows((x, weight)):  # decode: one pass of checks
        return nograd_forward("rms_norm_fwd", (x, weight, eps, offset, out_dtype, backend))[0], x
    backend = "reference" if empty(x, weight) else backend
    if plain_eager((x, weight)):
        if not torch.is_grad_enabled() and not y_amax:  # no graph to record (decode): the kernel alone
            return nograd_forward("rms_norm_fwd", (x, weight, eps, offset, out_dtype, backend))[0], x
        return _NormOpeningResidual.apply(x, weight, eps, offset, backend, out_dtype, y_amax)
    return rms_norm(x, weight, eps, offset, backend, out_dtype), x
