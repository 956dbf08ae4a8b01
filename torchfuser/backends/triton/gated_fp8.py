"""The packed gated activations (gated.py's formulas) as producers of an FP8 GEMM's operand: each kernel
writes its output as gated.py's does, bit for bit, and also takes that output's maxima for the GEMM's
rowwise quantisation both ways (modules/fp8/__init__.py), so no separate amax pass reads it again.

    swiglu_packed_fp8_fwd(gu) = (h, amax)      h = act(g)·u, the down projection's input
    swiglu_packed_fp8_bwd(dh, gu) = (d, amax)  d = [dg | du], the gate/up projection's output gradient

amax (int32, M + N entries for an M × N output): |out|'s fp32 bit patterns maxed per row (M entries),
then per column (N), of the output as rounded to its dtype; exactly what fp8_quant.py's
``_fp8_amax_both_kernel`` leaves for ``fp8_quantize_both_amax``, the both-ways writer run alone. As
there, an integer max on the bit patterns is order-free (the same bits whatever order the programs'
atomics land in) and propagates NaN as ``torch.amax`` does.

Tiles of BLOCK_A rows × BLOCK_B columns, a grid of (row chunk, column block) programs, each walking its
chunk's rows: one atomic max a row a tile, one a column a program. Nothing is saved for a backward
beyond what gated.py's ops save (the [gate | up] input).

Geometry, swept on an H200 (benchmarks/probes/fp8_both_ways_sweep_probe.py; the times against the plain
kernels and the amax pass they replace are in docs/performance/NOTES-fp8.md): the forward in 64 × 64 tiles at
4 warps, 4 programs a SM; the backward (three tiles in, two out) in 16 × 64 at 4 warps, 32 a SM.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from ._common import Launcher, check_dtypes, target_of, warps_as_threads
from .fp8_quant import _abs_bits, _sms, tile_grid
from .gated import _gelu_tanh, _silu

_BLOCK_B = 64
_FWD = (64, 4, 4)  # (rows a step, warps, programs a SM)
_BWD = (16, 4, 32)


@triton.jit
def _step(first, r0, cols, col_ok, M, BLOCK_A: tl.constexpr):
    rows = first + r0 + tl.arange(0, BLOCK_A)
    row_ok = rows < M
    return rows, row_ok, row_ok[:, None] & col_ok[None, :]


@triton.jit
def _gated_fwd_amax_kernel(GU, Y, AMAX, M, N, sgu, ROWS_PER_PROG,
                           GELU: tl.constexpr, BLOCK_A: tl.constexpr, BLOCK_B: tl.constexpr):
    # GU: M × 2N [gate | up], row stride sgu; Y: M × N contiguous; AMAX: M + N int32, zeroed.
    pa, pb = tl.program_id(0), tl.program_id(1)
    cols = pb * BLOCK_B + tl.arange(0, BLOCK_B)
    col_ok = cols < N
    first = pa.to(tl.int64) * ROWS_PER_PROG
    acc = tl.zeros([BLOCK_A, BLOCK_B], dtype=tl.int32)
    for r0 in range(0, ROWS_PER_PROG, BLOCK_A):
        rows, row_ok, mask = _step(first, r0, cols, col_ok, M, BLOCK_A)
        g_ptr = GU + rows[:, None] * sgu + cols[None, :]
        g = tl.load(g_ptr, mask=mask, other=0.0).to(tl.float32)
        u = tl.load(g_ptr + N, mask=mask, other=0.0).to(tl.float32)
        if GELU:
            a, _ = _gelu_tanh(g)
        else:
            a, _ = _silu(g)
        y = (a * u).to(Y.dtype.element_ty)  # act(0)·0 = 0 where masked: no effect on a maximum
        tl.store(Y + rows[:, None] * N + cols[None, :], y, mask=mask)
        bits = _abs_bits(y.to(tl.float32))
        tl.atomic_max(AMAX + rows, tl.max(bits, axis=1), mask=row_ok, sem="relaxed")
        acc = tl.maximum(acc, bits)
    tl.atomic_max(AMAX + M + cols, tl.max(acc, axis=0), mask=col_ok, sem="relaxed")


@triton.jit
def _gated_bwd_amax_kernel(DY, GU, D, AMAX, M, N, sdy, sgu, ROWS_PER_PROG,
                           GELU: tl.constexpr, BLOCK_A: tl.constexpr, BLOCK_B: tl.constexpr):
    # D: M × 2N [dg | du] contiguous; AMAX: M + 2N int32, zeroed (rows, then D's 2N columns).
    pa, pb = tl.program_id(0), tl.program_id(1)
    cols = pb * BLOCK_B + tl.arange(0, BLOCK_B)
    col_ok = cols < N
    first = pa.to(tl.int64) * ROWS_PER_PROG
    acc_g = tl.zeros([BLOCK_A, BLOCK_B], dtype=tl.int32)
    acc_u = tl.zeros([BLOCK_A, BLOCK_B], dtype=tl.int32)
    for r0 in range(0, ROWS_PER_PROG, BLOCK_A):
        rows, row_ok, mask = _step(first, r0, cols, col_ok, M, BLOCK_A)
        dy = tl.load(DY + rows[:, None] * sdy + cols[None, :], mask=mask, other=0.0).to(tl.float32)
        g_ptr = GU + rows[:, None] * sgu + cols[None, :]
        g = tl.load(g_ptr, mask=mask, other=0.0).to(tl.float32)
        u = tl.load(g_ptr + N, mask=mask, other=0.0).to(tl.float32)
        if GELU:
            a, da = _gelu_tanh(g)
        else:
            a, da = _silu(g)
        dg = (dy * u * da).to(D.dtype.element_ty)  # gated.py's expressions: the same bits
        du = (dy * a).to(D.dtype.element_ty)
        d_ptr = D + rows[:, None] * (2 * N) + cols[None, :]
        tl.store(d_ptr, dg, mask=mask)
        tl.store(d_ptr + N, du, mask=mask)
        bg, bu = _abs_bits(dg.to(tl.float32)), _abs_bits(du.to(tl.float32))
        tl.atomic_max(AMAX + rows, tl.max(tl.maximum(bg, bu), axis=1), mask=row_ok, sem="relaxed")
        acc_g = tl.maximum(acc_g, bg)
        acc_u = tl.maximum(acc_u, bu)
    tl.atomic_max(AMAX + M + cols, tl.max(acc_g, axis=0), mask=col_ok, sem="relaxed")
    tl.atomic_max(AMAX + M + N + cols, tl.max(acc_u, axis=0), mask=col_ok, sem="relaxed")


_fwd = Launcher(_gated_fwd_amax_kernel)
_bwd = Launcher(_gated_bwd_amax_kernel)


def _launch(kernel, config, t: torch.Tensor, m: int, n: int, *args, gelu: bool) -> None:
    step, warps, per_sm = config
    grid, per_prog = tile_grid(m, n, step, _BLOCK_B, per_sm, _sms(t))
    kernel(grid, *args, per_prog, GELU=gelu, BLOCK_A=step, BLOCK_B=_BLOCK_B,
           num_warps=warps_as_threads(warps, target_of(t)))


def _rows(op: str, gate_up: torch.Tensor) -> tuple[torch.Tensor, int, int]:
    """gate_up as M × 2N rows with a dense last dim (a view where it can be), M, N."""
    check_dtypes(op, gate_up=gate_up)
    n = gate_up.shape[-1] // 2
    gu = gate_up.reshape(-1, 2 * n)
    if gu.stride(-1) != 1:
        gu = gu.contiguous()
    return gu, gu.shape[0], n


def _packed_fp8_fwd(op: str, gate_up: torch.Tensor):
    gu, m, n = _rows(op, gate_up)
    y = torch.empty((*gate_up.shape[:-1], n), dtype=gate_up.dtype, device=gate_up.device)
    amax = torch.zeros(m + n, dtype=torch.int32, device=gate_up.device)
    if y.numel():
        _launch(_fwd, _FWD, gate_up, m, n, gu, y, amax, m, n, gu.stride(0), gelu=op == "geglu")
    return y, amax


def _packed_fp8_bwd(op: str, dy: torch.Tensor, gate_up: torch.Tensor):
    gu, m, n = _rows(op, gate_up)
    check_dtypes(op, dy=dy)
    d = torch.empty(gate_up.shape, dtype=gate_up.dtype, device=gate_up.device)
    amax = torch.zeros(m + 2 * n, dtype=torch.int32, device=gate_up.device)
    if d.numel():
        dy2 = dy.reshape(m, n)
        if dy2.stride(-1) != 1:
            dy2 = dy2.contiguous()
        _launch(_bwd, _BWD, gate_up, m, n, dy2, gu, d, amax, m, n, dy2.stride(0), gu.stride(0), gelu=op == "geglu")
    return d, amax


def swiglu_packed_fp8_fwd(gate_up):
    return _packed_fp8_fwd("swiglu", gate_up)


def swiglu_packed_fp8_bwd(dy, gate_up):
    return _packed_fp8_bwd("swiglu", dy, gate_up)


def geglu_packed_fp8_fwd(gate_up):
    return _packed_fp8_fwd("geglu", gate_up)


def geglu_packed_fp8_bwd(dy, gate_up):
    return _packed_fp8_bwd("geglu", dy, gate_up)
