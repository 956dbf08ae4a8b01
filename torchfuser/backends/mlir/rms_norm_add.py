"""Norm then add on the MLIR backend: this backend's compiled rms_norm kernels, the add (forward) and the casts
of the gradient on the host, as the reference backend composes them (``reference.rms_norm_add``). Exact as the
unfused norm + add on this backend: the same kernels and the same roundings, one pass more over the rows than a
kernel of its own would make."""
from __future__ import annotations

from torchfuser.backends.reference import rms_norm_add as ref

from .ops import check_dtypes, rms_norm_bwd, rms_norm_fwd


def rms_norm_add_fwd(a, r, weight, eps, offset, y_dtype=None):
    check_dtypes("rms_norm_add", a, r, weight)
    return ref.norm_then_add(rms_norm_fwd, a, r, weight, eps, offset, y_dtype)


def rms_norm_add_bwd(dout, a, weight, rstd, eps, offset, y_dtype=None):
    check_dtypes("rms_norm_add", dout, a, weight)
    return ref.norm_bwd_of_sum(rms_norm_bwd, dout, a, weight, rstd, eps, offset, y_dtype)
