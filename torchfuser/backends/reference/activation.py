"""Plain (ungated) activations of an MLP's hidden layer, fc_out(act(fc_in(x))), besides GELU:

    relu(x)  = max(x, 0),    relu'(x)  = [x > 0]
    relu2(x) = max(x, 0)²,   relu2'(x) = 2·max(x, 0)      (squared ReLU: Nemotron, Persimmon, Arcee)

Math in fp32 (float64 stays float64), one rounding to the input's dtype."""
from __future__ import annotations

import torch.nn.functional as F

from ._autodiff import compute_dtype, vjp

KINDS = ("relu", "relu2")


def activation(x, kind: str):
    if kind not in KINDS:
        raise ValueError(f"activation: kind must be one of {KINDS}, got {kind!r}")
    r = F.relu(x.to(compute_dtype(x)))
    return (r if kind == "relu" else r * r).to(x.dtype)


def activation_fwd(x, kind):
    return activation(x, kind).contiguous()


def activation_bwd(dy, x, kind):
    (dx,) = vjp(activation, (x,), dy, kind)
    return dx.contiguous()
