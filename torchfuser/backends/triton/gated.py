"""Gated activations and GELU in Triton (elementwise, memory-bound).

    swiglu(g, u) = silu(g) · u,       silu(g) = g·σ(g),        silu'(g) = σ(g)·(1 + g·(1 − σ(g)))
    geglu(g, u)  = gelu_tanh(g) · u,  gelu_tanh(g) = ½g(1 + t), t = tanh(k0·(g + k1·g³)),
                   gelu_tanh'(g) = ½(1 + t) + ½g·(1 − t²)·k0·(1 + 3k1·g²)
    geglu_erf(g, u) = gelu(g) · u     (exact GELU, below)
    gelu(x)      = ½x(1 + erf(x/√2)), gelu'(x) = ½(1 + erf(x/√2)) + x·φ(x)   (or the tanh form)
Backward: dg = dy · u · act'(g), du = dy · act(g). Saved for the backward: the inputs only
(recomputing act(g) is cheaper than storing it). Math in fp32, one rounding per output.

Inputs are read through their row stride (gate and up are often the two halves of one fused
gate_up projection), so such views cost no copy; fully contiguous inputs are walked flat. The
``*_packed`` entry points take that [gate | up] tensor itself and write the backward's
[dgate | dup] as one tensor, so autograd never concatenates the two halves' gradients.
"""
from __future__ import annotations

from functools import lru_cache

import torch
import triton
import triton.language as tl

from ._common import CPU, Launcher, Target, cdiv, check_dtypes, next_pow2, rows_of, target_of, warps_for
from ._math import tanh

_TILE = 4096
_K0 = tl.constexpr(0.7978845608028654)  # sqrt(2/pi)
_K1 = tl.constexpr(0.044715)
_INV_SQRT2 = tl.constexpr(0.7071067811865476)
_INV_SQRT_2PI = tl.constexpr(0.3989422804014327)


@triton.jit
def _tile(M, N, ROWS: tl.constexpr, BLOCK_N: tl.constexpr):
    pid = tl.program_id(0).to(tl.int64)
    n_col = tl.cdiv(N, BLOCK_N)
    rows = (pid // n_col) * ROWS + tl.arange(0, ROWS)
    cols = (pid % n_col) * BLOCK_N + tl.arange(0, BLOCK_N)
    mask = (rows < M)[:, None] & (cols < N)[None, :]
    return rows[:, None], cols[None, :], mask


@triton.jit
def _silu(g):
    s = tl.sigmoid(g)
    return g * s, s * (1.0 + g * (1.0 - s))


@triton.jit
def _gelu_tanh(g):
    t = tanh(_K0 * (g + _K1 * g * g * g))
    d = 0.5 * (1.0 + t) + 0.5 * g * ((1.0 - t) * (1.0 + t)) * _K0 * (1.0 + 3.0 * _K1 * g * g)
    return 0.5 * g * (1.0 + t), d


@triton.jit
def _gelu_erf(x):
    cdf = 0.5 * (1.0 + tl.erf(x * _INV_SQRT2))
    return x * cdf, cdf + x * tl.exp(-0.5 * x * x) * _INV_SQRT_2PI


@triton.jit
def _gated_fwd_kernel(G, U, Y, M, N, sg, su, GELU: tl.constexpr, ROWS: tl.constexpr, BLOCK_N: tl.constexpr):
    # GELU picks the activation at compile time: False swiglu (silu), True geglu (tanh-GELU), 2 geglu_erf (erf GELU).
    r, c, mask = _tile(M, N, ROWS, BLOCK_N)
    g = tl.load(G + r * sg + c, mask=mask, other=0.0).to(tl.float32)
    u = tl.load(U + r * su + c, mask=mask, other=0.0).to(tl.float32)
    if GELU == 2:
        a, _ = _gelu_erf(g)
    elif GELU == 1:
        a, _ = _gelu_tanh(g)
    else:
        a, _ = _silu(g)
    tl.store(Y + r * N + c, (a * u).to(Y.dtype.element_ty), mask=mask)


@triton.jit
def _gated_bwd_kernel(DY, G, U, DG, DU, M, N, sdy, sg, su, sd,
                      GELU: tl.constexpr, ROWS: tl.constexpr, BLOCK_N: tl.constexpr):
    # sd: row stride of DG and DU (N, or 2N when they are the halves of one packed gradient)
    r, c, mask = _tile(M, N, ROWS, BLOCK_N)
    dy = tl.load(DY + r * sdy + c, mask=mask, other=0.0).to(tl.float32)
    g = tl.load(G + r * sg + c, mask=mask, other=0.0).to(tl.float32)
    u = tl.load(U + r * su + c, mask=mask, other=0.0).to(tl.float32)
    if GELU == 2:
        a, da = _gelu_erf(g)
    elif GELU == 1:
        a, da = _gelu_tanh(g)
    else:
        a, da = _silu(g)
    tl.store(DG + r * sd + c, (dy * u * da).to(DG.dtype.element_ty), mask=mask)
    tl.store(DU + r * sd + c, (dy * a).to(DU.dtype.element_ty), mask=mask)


@triton.jit
def _gelu_fwd_kernel(X, Y, M, N, sx, TANH: tl.constexpr, ROWS: tl.constexpr, BLOCK_N: tl.constexpr):
    r, c, mask = _tile(M, N, ROWS, BLOCK_N)
    x = tl.load(X + r * sx + c, mask=mask, other=0.0).to(tl.float32)
    if TANH:
        a, _ = _gelu_tanh(x)
    else:
        a, _ = _gelu_erf(x)
    tl.store(Y + r * N + c, a.to(Y.dtype.element_ty), mask=mask)


@triton.jit
def _gelu_bwd_kernel(DY, X, DX, M, N, sdy, sx, TANH: tl.constexpr, ROWS: tl.constexpr, BLOCK_N: tl.constexpr):
    r, c, mask = _tile(M, N, ROWS, BLOCK_N)
    dy = tl.load(DY + r * sdy + c, mask=mask, other=0.0).to(tl.float32)
    x = tl.load(X + r * sx + c, mask=mask, other=0.0).to(tl.float32)
    if TANH:
        _, d = _gelu_tanh(x)
    else:
        _, d = _gelu_erf(x)
    tl.store(DX + r * N + c, (dy * d).to(DX.dtype.element_ty), mask=mask)


@lru_cache(maxsize=None)
def _config(flat: bool, n: int, target: Target = CPU) -> tuple[int, int, int]:
    """(ROWS, BLOCK_N, num_warps); flat: one long row of n elements. Warps per the target's warp size."""
    block = min(_TILE, next_pow2(n))
    rows = 1 if flat else max(1, min(64, _TILE // block))
    return rows, block, warps_for(rows * block, hi=8, warp_size=target.warp_size)


def _layout(n: int, *ts: torch.Tensor):
    """The tensors as M×N matrices with dense rows (pointer, row stride), and (M, N, grid, ROWS,
    BLOCK_N, warps). Contiguous tensors are walked as one flat row, passed as they are."""
    if all(t.is_contiguous() for t in ts):
        m, n, flat = 1, ts[0].numel(), True
        views = [(t, n) for t in ts]
    else:
        views = [rows_of(t, n) for t in ts]
        m, flat = views[0][1], False
        views = [(t, stride) for t, _, stride in views]
    rows, block, warps = _config(flat, n, target_of(ts[0]))
    grid = cdiv(m, rows) * cdiv(n, block)
    return views, m, n, (grid,), rows, block, warps


_ACT = {"swiglu": False, "geglu": True, "geglu_erf": 2}  # bools as before: the recorded launches keep their keys
_gated_fwd_launch, _gated_bwd_launch = Launcher(_gated_fwd_kernel), Launcher(_gated_bwd_kernel)
_gelu_fwd, _gelu_bwd = Launcher(_gelu_fwd_kernel), Launcher(_gelu_bwd_kernel)


def _gated_fwd(op, gate, up):
    check_dtypes(op, gate=gate, up=up)
    y = torch.empty(gate.shape, dtype=gate.dtype, device=gate.device)
    if gate.numel() == 0:
        return y
    ((g, sg), (u, su)), m, n, grid, rows, block, warps = _layout(gate.shape[-1], gate, up)
    _gated_fwd_launch(grid, g, u, y, m, n, sg, su, GELU=_ACT[op], ROWS=rows, BLOCK_N=block, num_warps=warps)
    return y


def _gated_bwd(op, dy, gate, up, packed=None):
    """(dgate, dup); with ``packed`` (the [gate | up] tensor that gate and up are the halves of),
    the single [dgate | dup] tensor instead, written in place of a concatenation."""
    check_dtypes(op, dy=dy, gate=gate, up=up)
    n = gate.shape[-1]
    if packed is None:
        dg = torch.empty(gate.shape, dtype=gate.dtype, device=gate.device)
        du, outs, out_stride = torch.empty(up.shape, dtype=up.dtype, device=up.device), None, 0
    else:
        outs = torch.empty(packed.shape, dtype=packed.dtype, device=packed.device)
        dg, du, out_stride = outs[..., :n], outs[..., n:], 2 * n
    if gate.numel() == 0:
        return (dg, du) if outs is None else outs
    # Packed halves are never contiguous (but for one row), so they are walked row by row.
    ((d, sdy), (g, sg), (u, su)), m, n, grid, rows, block, warps = _layout(n, dy, gate, up)
    _gated_bwd_launch(grid, d, g, u, dg, du, m, n, sdy, sg, su, out_stride or n, GELU=_ACT[op],
                      ROWS=rows, BLOCK_N=block, num_warps=warps)
    return (dg, du) if outs is None else outs


def _packed_halves(gate_up):
    n = gate_up.shape[-1] // 2
    return gate_up[..., :n], gate_up[..., n:]


def swiglu_packed_fwd(gate_up):
    return _gated_fwd("swiglu", *_packed_halves(gate_up))


def swiglu_packed_bwd(dy, gate_up):
    return _gated_bwd("swiglu", dy, *_packed_halves(gate_up), packed=gate_up)


def geglu_packed_fwd(gate_up):
    return _gated_fwd("geglu", *_packed_halves(gate_up))


def geglu_packed_bwd(dy, gate_up):
    return _gated_bwd("geglu", dy, *_packed_halves(gate_up), packed=gate_up)


def swiglu_fwd(gate, up):
    return _gated_fwd("swiglu", gate, up)


def swiglu_bwd(dy, gate, up):
    return _gated_bwd("swiglu", dy, gate, up)


def geglu_fwd(gate, up):
    return _gated_fwd("geglu", gate, up)


def geglu_bwd(dy, gate, up):
    return _gated_bwd("geglu", dy, gate, up)


def geglu_erf_packed_fwd(gate_up):
    return _gated_fwd("geglu_erf", *_packed_halves(gate_up))


def geglu_erf_packed_bwd(dy, gate_up):
    return _gated_bwd("geglu_erf", dy, *_packed_halves(gate_up), packed=gate_up)


def geglu_erf_fwd(gate, up):
    return _gated_fwd("geglu_erf", gate, up)


def geglu_erf_bwd(dy, gate, up):
    return _gated_bwd("geglu_erf", dy, gate, up)


def _check_approximate(approximate):
    if approximate not in ("none", "tanh"):
        raise ValueError(f"gelu: approximate must be 'none' or 'tanh', got {approximate!r}")
    return approximate == "tanh"


def gelu_fwd(x, approximate):
    check_dtypes("gelu", x=x)
    tanh_form = _check_approximate(approximate)
    y = torch.empty(x.shape, dtype=x.dtype, device=x.device)
    if x.numel() == 0:
        return y
    ((xv, sx),), m, n, grid, rows, block, warps = _layout(x.shape[-1] if x.dim() else 1, x)
    _gelu_fwd(grid, xv, y, m, n, sx, TANH=tanh_form, ROWS=rows, BLOCK_N=block, num_warps=warps)
    return y


def gelu_bwd(dy, x, approximate):
    check_dtypes("gelu", dy=dy, x=x)
    tanh_form = _check_approximate(approximate)
    dx = torch.empty(x.shape, dtype=x.dtype, device=x.device)
    if x.numel() == 0:
        return dx
    ((d, sd), (xv, sx)), m, n, grid, rows, block, warps = _layout(x.shape[-1] if x.dim() else 1, dy, x)
    _gelu_bwd(grid, d, xv, dx, m, n, sd, sx, TANH=tanh_form, ROWS=rows, BLOCK_N=block, num_warps=warps)
    return dx
