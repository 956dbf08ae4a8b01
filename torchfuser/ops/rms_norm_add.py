"""Norm then add: ``rms_norm_add`` (out = r + rms_norm(a)·(offset + w), the add after the norm, in one forward
kernel), for layers that normalise each block's output before its residual add (OLMo-2's post-block norms).
The twin of ``ops.rms_norm``'s add_rms_norm, whose add comes before the norm. Saved: a, w and rstd (fp32, one
per row). Backward: dr = dout (in r's dtype), (da, dw) the norm's backward of dout rounded to y's dtype."""
from __future__ import annotations

import torch
from torch import Tensor

from ._call import autograd, empty, kernel, run


@torch.library.custom_op("torchfuser::rms_norm_add_fwd", mutates_args=())
def rms_norm_add_fwd(
    a: Tensor, r: Tensor, weight: Tensor, eps: float, offset: float, y_dtype: torch.dtype | None, backend: str
) -> tuple[Tensor, Tensor]:
    return kernel(backend, "rms_norm_add_fwd")(a, r, weight, eps, offset, y_dtype)


@rms_norm_add_fwd.register_fake
def _(a, r, weight, eps, offset, y_dtype, backend):
    out = a.new_empty(a.shape, dtype=torch.promote_types(r.dtype, y_dtype or a.dtype))
    return out, a.new_empty(a.shape[:-1], dtype=torch.float32)


@torch.library.custom_op("torchfuser::rms_norm_add_bwd", mutates_args=())
def rms_norm_add_bwd(
    dout: Tensor, a: Tensor, weight: Tensor, rstd: Tensor, eps: float, offset: float, y_dtype: torch.dtype | None,
    backend: str,
) -> tuple[Tensor, Tensor]:
    return kernel(backend, "rms_norm_add_bwd")(dout, a, weight, rstd, eps, offset, y_dtype)


@rms_norm_add_bwd.register_fake
def _(dout, a, weight, rstd, eps, offset, y_dtype, backend):
    return a.new_empty(a.shape), weight.new_empty(weight.shape)


def _setup(ctx, inputs, output):
    a, r, weight, eps, offset, y_dtype, backend = inputs
    ctx.save_for_backward(a, weight, output[1])
    ctx.args = (eps, offset, y_dtype, backend)
    ctx.r_dtype = r.dtype


def _backward(ctx, dout, _drstd):
    if dout is None:  # out unused
        return None, None, None, None, None, None, None
    a, weight, rstd = ctx.saved_tensors
    da, dw = run(rms_norm_add_bwd, dout, a, weight, rstd, *ctx.args)
    # r's gradient is out's (autograd's add would hand it on as it is, cast to r's dtype where that differs)
    dr = dout if dout.dtype == ctx.r_dtype else dout.to(ctx.r_dtype)
    return da, dr, dw, None, None, None, None


_rms_norm_add = autograd(rms_norm_add_fwd, _setup, _backward)


def rms_norm_add(a: Tensor, r: Tensor, weight: Tensor, eps: float, offset: float, backend: str,
                 y_dtype: torch.dtype | None = None) -> Tensor:
    """r + rms_norm(a): the norm rounded to ``y_dtype`` (default a's: the dtype the original norm returns), then
    added to r in torch's promoted dtype of r and y, as the unfused ``r + norm(a)``."""
    if a.shape != r.shape:
        raise ValueError(f"rms_norm_add: a and r must have the same shape (no broadcasting), got {tuple(a.shape)} "
                         f"and {tuple(r.shape)}")
    backend = "reference" if empty(a, r, weight) else backend
    return _rms_norm_add(a, r, weight, float(eps), float(offset), y_dtype, backend)[0]
