"""Plain activations in Triton (elementwise, memory-bound):

    relu(x)  = max(x, 0),    relu'(x)  = [x > 0]
    relu2(x) = max(x, 0)²,   relu2'(x) = 2·max(x, 0)

Saved for the backward: the input only. Math in fp32, one rounding per output. Rows are read
through their stride (no copy of a strided view); contiguous tensors are walked flat (gated.py's
layout)."""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from ._common import Launcher, check_dtypes
from .gated import _layout, _tile

_KINDS = {"relu": 1, "relu2": 2}  # the power of max(x, 0)


def _power(kind: str) -> int:
    if kind not in _KINDS:
        raise ValueError(f"activation: kind must be one of {tuple(_KINDS)}, got {kind!r}")
    return _KINDS[kind]


@triton.jit
def _activation_fwd_kernel(X, Y, M, N, sx, POWER: tl.constexpr, ROWS: tl.constexpr, BLOCK_N: tl.constexpr):
    r, c, mask = _tile(M, N, ROWS, BLOCK_N)
    x = tl.load(X + r * sx + c, mask=mask, other=0.0).to(tl.float32)
    a = tl.maximum(x, 0.0)
    if POWER == 2:
        a = a * a
    tl.store(Y + r * N + c, a.to(Y.dtype.element_ty), mask=mask)


@triton.jit
def _activation_bwd_kernel(DY, X, DX, M, N, sdy, sx, POWER: tl.constexpr, ROWS: tl.constexpr, BLOCK_N: tl.constexpr):
    r, c, mask = _tile(M, N, ROWS, BLOCK_N)
    dy = tl.load(DY + r * sdy + c, mask=mask, other=0.0).to(tl.float32)
    x = tl.load(X + r * sx + c, mask=mask, other=0.0).to(tl.float32)
    if POWER == 2:
        d = 2.0 * tl.maximum(x, 0.0)
    else:
        d = tl.where(x > 0.0, 1.0, 0.0)
    tl.store(DX + r * N + c, (dy * d).to(DX.dtype.element_ty), mask=mask)


_fwd, _bwd = Launcher(_activation_fwd_kernel), Launcher(_activation_bwd_kernel)


def activation_fwd(x, kind):
    check_dtypes("activation", x=x)
    power = _power(kind)
    y = torch.empty(x.shape, dtype=x.dtype, device=x.device)
    if x.numel() == 0:
        return y
    ((xv, sx),), m, n, grid, rows, block, warps = _layout(x.shape[-1] if x.dim() else 1, x)
    _fwd(grid, xv, y, m, n, sx, POWER=power, ROWS=rows, BLOCK_N=block, num_warps=warps)
    return y


def activation_bwd(dy, x, kind):
    check_dtypes("activation", dy=dy, x=x)
    power = _power(kind)
    dx = torch.empty(x.shape, dtype=x.dtype, device=x.device)
    if x.numel() == 0:
        return dx
    ((d, sd), (xv, sx)), m, n, grid, rows, block, warps = _layout(x.shape[-1] if x.dim() else 1, dy, x)
    _bwd(grid, d, xv, dx, m, n, sd, sx, POWER=power, ROWS=rows, BLOCK_N=block, num_warps=warps)
    return dx
