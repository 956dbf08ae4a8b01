"""The MLIR backend's plain activations (relu, relu²): the reference definition and its vjp, compiled
per (kind, dtypes, row width) as ops.py's gelu is."""
from __future__ import annotations

from torchfuser.backends.reference import activation as ref_act
from torchfuser.backends.reference._autodiff import vjp

from .capture import ROW, ArgSpec
from .compile import kernel_for
from .ops import _hidden, _rows, check_dtypes


def activation_fwd(x, kind):
    check_dtypes("activation", x)
    h = _hidden(x)
    k = kernel_for("activation_fwd", {"kind": kind}, lambda a: ref_act.activation(a, kind), [ArgSpec(ROW, (h,), x.dtype)])
    (y,) = k(_rows(x))
    return y.view(x.shape)


def activation_bwd(dy, x, kind):
    check_dtypes("activation", dy, x)
    h = _hidden(x)
    k = kernel_for(
        "activation_bwd", {"kind": kind},
        lambda g, a: vjp(ref_act.activation, (a,), g, kind)[0],
        [ArgSpec(ROW, (h,), dy.dtype), ArgSpec(ROW, (h,), x.dtype)],
    )
    (dx,) = k(_rows(dy), _rows(x))
    return dx.view(x.shape)
