"""The RMSNorms (rms_norm.py's formulas) as producers of an FP8 GEMM's operand: each kernel writes what
rms_norm.py's does, bit for bit, and also takes the maxima of the output a GEMM takes both ways
(modules/fp8/__init__.py), as gated_fp8.py's kernels do, so no separate amax pass reads it again.

    rms_norm_fp8_fwd(x, w, ...) = (y, rstd, amax)                  y: the q/k/v projection's input
    add_rms_norm_fp8_fwd(x, r, w, ...) = (s, y, rstd, amax)         y: the gate/up projection's input
    rms_norm_fp8_bwd(dy, x, w, rstd, ..., dres) = (dx, dw, amax)    of dx
    add_rms_norm_fp8_bwd(dy, s, w, rstd, ..., ds, r_dtype) = (dx, dr, dw, amax)   of dr: the gradient of
        the residual branch, the output projection's dy

amax (int32, M + N entries for an M × N output): |out|'s fp32 bit patterns maxed per row, then per
column, of the output as rounded to its dtype; what fp8_quant.py's ``_fp8_amax_both_kernel`` leaves for
``fp8_quantize_both_amax``. A program owns its rows whole, so their maxima are stored, not atomics; the
column maxima are kept in registers over the program's rows and maxed in once a column a program.

Rows up to 8192 elements forward (``_MAX_FWD``) and rms_norm.py's one-pass widths backward
(_MAX_FUSED_BWD_DRES with a residual gradient): in the same tiles (rows a tile, block, warps) as rms_norm.py's
kernels, so that each row's sums reduce in the same order, and in a persistent grid that walks them.
Wider rows run rms_norm.py's kernels and give amax None: the GEMM then takes its own maxima.

Measured on an H200 (benchmarks/probes/fp8_norm_producer_probe.py; the numbers in
docs/performance/NOTES-fp8.md): slower than the plain kernels plus the amax pass they replace. So they
are off in the models (the switch fp8_norm_producers, torchfuser.switches), kept tested for wider rows and other hardware.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from ._common import (
    Launcher, bwd_stages, cdiv, check_dtypes, check_same_shape, device_key, num_programs_cap, rows_of, target_of,
)
from .fp8_quant import _abs_bits, _sms
from .rms_norm import _dx_rows, _norm_bwd, _norm_fwd, _row_input, _rstd, norm_config, sum_partials, with_sum

# The forward's persistent programs a SM (the backward's grid is rms_norm.py's): 2 the fastest of 1-16 on
# an H200 (NOTES-fp8.md), and still slower than the plain kernel plus the amax pass, so
# the switch fp8_norm_producers leaves these kernels off.
_FWD_PER_SM = 2
# Past 8192 elements a row the forward's register tile (x, w and the column maxima, 16384 wide) spills 96
# bytes a thread on sm_80 and sm_90 (benchmarks/triton_resources.py): those rows take the plain kernel.
_MAX_FWD = 8192


@triton.jit
def _maxima(out, AMAX, rows, row_ok, acc):
    """Store the tile's row maxima of |out| (as fp32 bits; masked entries are 0) and fold its columns'
    into ``acc``."""
    bits = _abs_bits(out.to(tl.float32))
    tl.store(AMAX + rows, tl.max(bits, axis=1), mask=row_ok)
    return tl.maximum(acc, tl.max(bits, axis=0))


@triton.jit
def _rms_norm_fwd_amax_kernel(
    X, R, W, Y, S, RSTD, AMAX, M, N, stride_x, stride_r, eps, offset, TILES_PER_PROG,
    HAS_RES: tl.constexpr, ROWS: tl.constexpr, BLOCK_N: tl.constexpr,
):
    # rms_norm.py's one-pass forward over tiles pid, pid + G, ...; AMAX: M + N int32, its N zeroed.
    pid, n_prog = tl.program_id(0), tl.num_programs(0)
    cols = tl.arange(0, BLOCK_N)
    col_ok = cols < N
    w = tl.load(W + cols, mask=col_ok, other=0.0).to(tl.float32) + offset
    acc = tl.zeros([BLOCK_N], dtype=tl.int32)
    for i in range(0, TILES_PER_PROG):
        rows = ((pid + i * n_prog) * ROWS + tl.arange(0, ROWS)).to(tl.int64)
        row_ok = rows < M
        mask = row_ok[:, None] & col_ok[None, :]
        x = _row_input(X + rows[:, None] * stride_x, R + rows[:, None] * stride_r, S + rows[:, None] * N,
                       cols, mask, S, HAS_RES)
        rstd = _rstd(x, N, eps)
        y = (x * rstd[:, None] * w[None, :]).to(Y.dtype.element_ty)
        tl.store(Y + rows[:, None] * N + cols[None, :], y, mask=mask)
        tl.store(RSTD + rows, rstd, mask=row_ok)
        acc = _maxima(y, AMAX, rows, row_ok, acc)
    tl.atomic_max(AMAX + M + cols, acc, mask=col_ok, sem="relaxed")


@triton.jit
def _rms_norm_bwd_amax_kernel(
    DY, X, W, RSTD, DRES, DX, DX2, DWP, AMAX, M, N, stride_dy, stride_x, stride_dres, TILES_PER_PROG, offset,
    HAS_DRES: tl.constexpr, HAS_DX2: tl.constexpr, ROWS: tl.constexpr, BLOCK_N: tl.constexpr,
    STAGES: tl.constexpr,
):
    # rms_norm.py's one-pass backward; AMAX: M + N int32, its N zeroed, the maxima of DX2 (of DX without).
    pid, n_prog = tl.program_id(0), tl.num_programs(0)
    cols = tl.arange(0, BLOCK_N)
    col_ok = cols < N
    w = tl.load(W + cols, mask=col_ok, other=0.0).to(tl.float32) + offset
    dw = tl.zeros([BLOCK_N], dtype=tl.float32)
    acc = tl.zeros([BLOCK_N], dtype=tl.int32)
    for i in tl.range(0, TILES_PER_PROG, num_stages=STAGES):
        rows = ((pid + i * n_prog) * ROWS + tl.arange(0, ROWS)).to(tl.int64)
        row_ok = rows < M
        mask = row_ok[:, None] & col_ok[None, :]
        x = tl.load(X + rows[:, None] * stride_x + cols[None, :], mask=mask, other=0.0).to(tl.float32)
        dy = tl.load(DY + rows[:, None] * stride_dy + cols[None, :], mask=mask, other=0.0).to(tl.float32)
        if HAS_DRES:
            dres = tl.load(DRES + rows[:, None] * stride_dres + cols[None, :], mask=mask, other=0.0).to(tl.float32)
        rstd = tl.load(RSTD + rows, mask=row_ok, other=0.0)
        dx = _dx_rows(x, dy, w, rstd, N)
        if HAS_DRES:
            dx += dres
        out = dx.to(DX.dtype.element_ty)
        tl.store(DX + rows[:, None] * N + cols[None, :], out, mask=mask)
        if HAS_DX2:
            out = dx.to(DX2.dtype.element_ty)
            tl.store(DX2 + rows[:, None] * N + cols[None, :], out, mask=mask)
        acc = _maxima(out, AMAX, rows, row_ok, acc)
        dw += tl.sum(dy * x * rstd[:, None], axis=0)
    tl.store(DWP + pid * N + cols, dw, mask=col_ok)
    tl.atomic_max(AMAX + M + cols, acc, mask=col_ok, sem="relaxed")


_fwd = Launcher(_rms_norm_fwd_amax_kernel)
_bwd = Launcher(_rms_norm_bwd_amax_kernel)


def _maxima_buffer(m: int, n: int, device) -> torch.Tensor:
    amax = torch.empty(m + n, dtype=torch.int32, device=device)
    amax[m:].zero_()  # the row maxima are stored, the column ones maxed into
    return amax


def _fp8_fwd(x, r, s, weight, eps, offset, out_dtype):
    n = x.shape[-1]
    block, rows, one_pass, warps = norm_config(n, False, target_of(x))
    x2, m, sx = rows_of(x, n)
    if not one_pass or n > _MAX_FWD or m == 0:
        return (*_norm_fwd(x, r, s, weight, eps, offset, out_dtype), None)
    r2, _, sr = rows_of(r, n) if r is not None else (x2, m, sx)
    y = torch.empty(x.shape, dtype=out_dtype or (x.dtype if s is None else s.dtype), device=x.device)
    rstd = torch.empty(x.shape[:-1], dtype=torch.float32, device=x.device)
    amax = _maxima_buffer(m, n, x.device)
    tiles = cdiv(m, rows)
    grid = max(1, min(tiles, _FWD_PER_SM * _sms(x)))
    _fwd((grid,), x2, r2, weight, y, y if s is None else s, rstd, amax, m, n, sx, sr, float(eps), float(offset),
         cdiv(tiles, grid), HAS_RES=r is not None, ROWS=rows, BLOCK_N=block, num_warps=warps)
    return y, rstd, amax


def rms_norm_fp8_fwd(x, weight, eps, offset, out_dtype=None):
    """rms_norm_fwd's (y, rstd), and y's maxima both ways (None past ``_MAX_FWD``)."""
    check_dtypes("rms_norm", x=x, weight=weight)
    return _fp8_fwd(x, None, None, weight, eps, offset, out_dtype)


def add_rms_norm_fp8_fwd(x, r, weight, eps, offset, out_dtype=None):
    """add_rms_norm_fwd's (s, y, rstd), and y's maxima both ways (None past ``_MAX_FWD``)."""
    return with_sum(_fp8_fwd, x, r, weight, eps, offset, out_dtype)


def _fp8_bwd(dy, x, weight, rstd, offset, dres, dx2_dtype):
    check_dtypes("rms_norm", dy=dy, x=x, weight=weight, dres=dres)
    if dres is not None:
        check_same_shape("rms_norm_bwd", x=x, dres=dres)
    n = x.shape[-1]
    target = target_of(x)
    block, rows, one_pass, warps = norm_config(n, True, target, dres is not None)
    (x2, m, sx), (dy2, _, sdy) = rows_of(x, n), rows_of(dy, n)
    if not one_pass or m == 0:
        return (*_norm_bwd(dy, x, weight, rstd, offset, dres, dx2_dtype), None)
    dres2, _, sdres = rows_of(dres, n) if dres is not None else (x2, m, sx)
    grid = max(1, min(num_programs_cap(device_key(x)), cdiv(m, rows)))
    dx = torch.empty(x.shape, dtype=x.dtype, device=x.device)
    dx2 = None if dx2_dtype is None else torch.empty(x.shape, dtype=dx2_dtype, device=x.device)
    dwp = torch.empty((grid, n), dtype=torch.float32, device=x.device)
    amax = _maxima_buffer(m, n, x.device)
    tiles = cdiv(cdiv(m, rows), grid)
    extra = dres.element_size() if dres is not None else 0
    _bwd((grid,), dy2, x2, weight, rstd if rstd.is_contiguous() else rstd.contiguous(), dres2, dx,
         dx if dx2 is None else dx2, dwp, amax, m, n, sdy, sx, sdres, tiles, float(offset),
         HAS_DRES=dres is not None, HAS_DX2=dx2 is not None, ROWS=rows, BLOCK_N=block,
         STAGES=bwd_stages(tiles, rows, block, x.element_size(), extra, target), num_warps=warps)
    return dx, dx2, sum_partials(dwp, weight.dtype), amax


def rms_norm_fp8_bwd(dy, x, weight, rstd, eps, offset, dres=None):
    """rms_norm_bwd's (dx, dw), and dx's maxima both ways (None past the one-pass widths)."""
    dx, _, dw, amax = _fp8_bwd(dy, x, weight, rstd, offset, dres, None)
    return dx, dw, amax


def add_rms_norm_fp8_bwd(dy, s, weight, rstd, eps, offset, ds, r_dtype):
    """add_rms_norm_bwd's (dx, dr, dw), and dr's maxima both ways (None past the one-pass widths)."""
    return _fp8_bwd(dy, s, weight, rstd, offset, ds, r_dtype)
