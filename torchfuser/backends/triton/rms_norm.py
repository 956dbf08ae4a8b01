"""RMSNorm in Triton, optionally fused with the residual add before it and the residual's gradient.

Forward, per row x of length N:   r = rsqrt(Σx²/N + eps),  y = x · r · (offset + w)
Saved for the backward: x, w and r (fp32, one value per row); y is not kept.
Backward, with w' = offset + w and g = dy · w':
    dx = r · (g − x · r² · Σ(g·x)/N)        dw = Σ_rows dy · x · r
All arithmetic in fp32; y and dx are rounded once, to x's dtype (y: or the dtype asked for), on the store.

With the residual add (add_rms_norm_fwd):  s = x + res, in torch.result_type(x, res), stored, and
normalised as rounded to that dtype, so (y, r) are exactly rms_norm_fwd(s)'s. Saved for the
backward: s (in place of x), w and r. s is the residual stream's next value, so the backward gets
its gradient dres (from the layers after) and, with it:
    dx = r · (g − s · r² · Σ(g·s)/N) + dres       (the gradient of s, hence of x and of res)
added in fp32 and rounded once to s's dtype.
"""
from __future__ import annotations

from functools import lru_cache

import torch
import triton
import triton.language as tl

from ._common import (
    CPU, Launcher, Target, bwd_stages, cdiv, check_dtypes, check_same_shape, device_key, next_pow2, num_programs_cap,
    rows_of, target_of, warps_as_threads, warps_for,
)

# Rows up to this many elements are held in registers whole (one read of x); longer rows are
# walked in chunks of _CHUNK, re-reading x from L2 instead of spilling.
MAX_FUSED = 16384
_CHUNK = 4096
_TILE = 4096  # elements per program in the one-pass case: short rows are packed several per program
_BWD_ROWS = 2
# A backward that also adds the residual stream's gradient (``dres``) holds a fifth row in registers
# (w, dw, x, dy, dres): past 8192 elements it spills thousands of bytes a thread on NVIDIA, and the
# looped kernel in 8192-element chunks at 16 warps is 3.9-4.6x faster (H200, 4096 rows of 12288 and
# 16384, fp32 residual; without dres the one-pass kernel stays the fastest at 16384).
# benchmarks/probes/norm_bwd_wide_probe.py, benchmarks/results/latest/*norm-bwd-wide*, NOTES-triton.md.
_MAX_FUSED_BWD_DRES = 8192
_BWD_CHUNK = 8192  # looped backwards: 8192-element chunks beat 4096 at 12288-16384 in every op measured


@lru_cache(maxsize=None)
def norm_config(n: int, backward: bool = False, target: Target = CPU, dres: bool = False) -> tuple[int, int, bool, int]:
    """(BLOCK_N, ROWS, ONE_PASS, num_warps) for rows of n elements; shared with layer_norm (``dres``:
    a backward that also adds the residual's gradient). The backwards' tiles hold at most _BWD_ROWS
    rows: at a decoder layer's fp32 residual stream pipelined 2-row tiles were the fastest (H200,
    benchmarks/probes/norm_bwd_probe.py, NOTES-triton.md)."""
    if n <= (_MAX_FUSED_BWD_DRES if backward and dres else MAX_FUSED):
        block = next_pow2(n)
        rows = max(1, min(_BWD_ROWS if backward else 64, _TILE // block))
        return block, rows, True, warps_for(rows * block, warp_size=target.warp_size)
    chunk = _BWD_CHUNK if backward else _CHUNK
    return chunk, 1, False, warps_for(chunk, warp_size=target.warp_size)


@triton.jit
def _row_input(x_rows, r_rows, s_rows, cols, mask, S, HAS_RES: tl.constexpr):
    """The rows normalised, in fp32: x, or with HAS_RES s = x + res, stored to S and rounded to S's dtype
    before the statistics (y and rstd are those of the s stored)."""
    x = tl.load(x_rows + cols[None, :], mask=mask, other=0.0).to(tl.float32)
    if HAS_RES:
        res = tl.load(r_rows + cols[None, :], mask=mask, other=0.0).to(tl.float32)
        s = (x + res).to(S.dtype.element_ty)
        tl.store(s_rows + cols[None, :], s, mask=mask)
        x = s.to(tl.float32)
    return x


@triton.jit
def _rstd(x, N, eps):
    return tl.rsqrt(tl.sum(x * x, axis=1) / N + eps)


@triton.jit
def _dx_rows(x, dy, w, rstd, N):
    """The norm's input gradient of whole rows (one-pass), before any residual gradient is added."""
    g = dy * w[None, :]
    c = tl.sum(g * x, axis=1) * rstd * rstd / N
    return rstd[:, None] * (g - x * c[:, None])


@triton.jit
def _rms_norm_fwd_kernel(
    X, R, W, Y, S, RSTD, M, N, stride_x, stride_r, eps, offset,
    HAS_RES: tl.constexpr, ROWS: tl.constexpr, BLOCK_N: tl.constexpr, ONE_PASS: tl.constexpr,
):
    # HAS_RES: the row normalised is s = x + res, res read from R (the residual branch, row stride
    # stride_r; not the formula's r), s stored to S (contiguous, like Y). Without it R, S are unused.
    rows = (tl.program_id(0) * ROWS + tl.arange(0, ROWS)).to(tl.int64)
    row_ok = rows < M
    cols = tl.arange(0, BLOCK_N)
    x_rows = X + rows[:, None] * stride_x
    r_rows = R + rows[:, None] * stride_r
    y_rows = Y + rows[:, None] * N
    s_rows = S + rows[:, None] * N
    if ONE_PASS:
        mask = row_ok[:, None] & (cols < N)[None, :]
        x = _row_input(x_rows, r_rows, s_rows, cols, mask, S, HAS_RES)
        rstd = _rstd(x, N, eps)
        w = tl.load(W + cols, mask=cols < N, other=0.0).to(tl.float32) + offset
        y = x * rstd[:, None] * w[None, :]
        tl.store(y_rows + cols[None, :], y.to(Y.dtype.element_ty), mask=mask)
    else:
        # Per-lane partial sums, reduced once at the end: fewer cross-warp reductions.
        acc = tl.zeros([ROWS, BLOCK_N], dtype=tl.float32)
        for start in range(0, N, BLOCK_N):
            c = start + cols
            mask = row_ok[:, None] & (c < N)[None, :]
            x = _row_input(x_rows, r_rows, s_rows, c, mask, S, HAS_RES)
            acc += x * x
        rstd = tl.rsqrt(tl.sum(acc, axis=1) / N + eps)
        for start in range(0, N, BLOCK_N):
            c = start + cols
            mask = row_ok[:, None] & (c < N)[None, :]
            x = tl.load(x_rows + c[None, :], mask=mask, other=0.0).to(tl.float32)
            if HAS_RES:
                # x + res recomputed, not S re-read: the add and its rounding are deterministic, so
                # this is bit-identical to the s stored, and the kernel never reads what it wrote.
                # Reading S back is right only if each thread loads exactly the elements it stored (a
                # layout coincidence Triton does not promise; no barrier orders other threads' stores
                # before these loads). Cost: this pass reads x and res (6 bytes an element for fp32 +
                # bf16) instead of s (4), mostly from L2, and only for rows longer than MAX_FUSED.
                res = tl.load(r_rows + c[None, :], mask=mask, other=0.0).to(tl.float32)
                x = (x + res).to(S.dtype.element_ty).to(tl.float32)
            w = tl.load(W + c, mask=c < N, other=0.0).to(tl.float32) + offset
            y = x * rstd[:, None] * w[None, :]
            tl.store(y_rows + c[None, :], y.to(Y.dtype.element_ty), mask=mask)
    tl.store(RSTD + rows, rstd, mask=row_ok)


@triton.jit
def _rms_norm_bwd_kernel(
    DY, X, W, RSTD, DRES, DX, DX2, DWP, M, N, stride_dy, stride_x, stride_dres, TILES_PER_PROG, offset,
    HAS_DRES: tl.constexpr, HAS_DX2: tl.constexpr, ROWS: tl.constexpr, BLOCK_N: tl.constexpr,
    ONE_PASS: tl.constexpr, STAGES: tl.constexpr,
):
    # HAS_DRES: dx += dres (the residual stream's gradient), in fp32 before dx's one rounding.
    # HAS_DX2: dx stored a second time, rounded to DX2's dtype (the gradient of a bf16 residual branch).
    # Persistent grid: each program walks row tiles pid, pid+G, ... and keeps its share of dw
    # in fp32; the G partial rows are summed on the host side (one small reduction launch).
    pid = tl.program_id(0)
    n_prog = tl.num_programs(0)
    cols = tl.arange(0, BLOCK_N)
    if ONE_PASS:
        col_ok = cols < N
        w = tl.load(W + cols, mask=col_ok, other=0.0).to(tl.float32) + offset
        dw = tl.zeros([BLOCK_N], dtype=tl.float32)
        for i in tl.range(0, TILES_PER_PROG, num_stages=STAGES):
            tile = pid + i * n_prog
            rows = (tile * ROWS + tl.arange(0, ROWS)).to(tl.int64)
            row_ok = rows < M
            mask = row_ok[:, None] & col_ok[None, :]
            x = tl.load(X + rows[:, None] * stride_x + cols[None, :], mask=mask, other=0.0).to(tl.float32)
            dy = tl.load(DY + rows[:, None] * stride_dy + cols[None, :], mask=mask, other=0.0).to(tl.float32)
            if HAS_DRES:  # loaded with x and dy, not after the row reduction: its latency overlaps theirs
                dres = tl.load(DRES + rows[:, None] * stride_dres + cols[None, :], mask=mask, other=0.0).to(tl.float32)
            rstd = tl.load(RSTD + rows, mask=row_ok, other=0.0)
            dx = _dx_rows(x, dy, w, rstd, N)
            if HAS_DRES:
                dx += dres
            tl.store(DX + rows[:, None] * N + cols[None, :], dx.to(DX.dtype.element_ty), mask=mask)
            if HAS_DX2:
                tl.store(DX2 + rows[:, None] * N + cols[None, :], dx.to(DX2.dtype.element_ty), mask=mask)
            dw += tl.sum(dy * x * rstd[:, None], axis=0)
        tl.store(DWP + pid * N + cols, dw, mask=col_ok)
    else:
        for i in range(0, TILES_PER_PROG):
            tile = pid + i * n_prog
            row = tile.to(tl.int64)
            row_ok = row < M  # the last round of tiles may run past M
            rstd = tl.load(RSTD + row, mask=row_ok, other=0.0)
            acc = tl.zeros([BLOCK_N], dtype=tl.float32)
            for start in range(0, N, BLOCK_N):
                c = start + cols
                m = (c < N) & row_ok
                x = tl.load(X + row * stride_x + c, mask=m, other=0.0).to(tl.float32)
                dy = tl.load(DY + row * stride_dy + c, mask=m, other=0.0).to(tl.float32)
                w = tl.load(W + c, mask=m, other=0.0).to(tl.float32) + offset
                acc += dy * w * x
            coef = tl.sum(acc, axis=0) * rstd * rstd / N
            for start in range(0, N, BLOCK_N):
                c = start + cols
                m = (c < N) & row_ok
                x = tl.load(X + row * stride_x + c, mask=m, other=0.0).to(tl.float32)
                dy = tl.load(DY + row * stride_dy + c, mask=m, other=0.0).to(tl.float32)
                w = tl.load(W + c, mask=m, other=0.0).to(tl.float32) + offset
                dx = rstd * (dy * w - x * coef)
                if HAS_DRES:
                    dx += tl.load(DRES + row * stride_dres + c, mask=m, other=0.0).to(tl.float32)
                tl.store(DX + row * N + c, dx.to(DX.dtype.element_ty), mask=m)
                if HAS_DX2:
                    tl.store(DX2 + row * N + c, dx.to(DX2.dtype.element_ty), mask=m)
                # This program's own partial row: no other program touches it, no atomics needed.
                p = DWP + pid * N + c
                tl.store(p, tl.load(p, mask=m, other=0.0) + dy * x * rstd, mask=m)


@triton.jit
def _sum_partials_kernel(P, OUT, Q, OUT_Q, G, N, TWO: tl.constexpr, BLOCK_G: tl.constexpr, BLOCK_N: tl.constexpr):
    # OUT = Σ_g P[g, :] (and OUT_Q = Σ_g Q[g, :]): the backwards' G fp32 partial rows of dw (db),
    # summed in fp32 and rounded once to the parameter's dtype; one launch instead of sum + cast.
    cols = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    col_ok = cols < N
    acc = tl.zeros([BLOCK_G, BLOCK_N], dtype=tl.float32)
    acc_q = tl.zeros([BLOCK_G, BLOCK_N], dtype=tl.float32)
    for g0 in range(0, G, BLOCK_G):
        g = (g0 + tl.arange(0, BLOCK_G)).to(tl.int64)
        mask = (g < G)[:, None] & col_ok[None, :]
        offs = g[:, None] * N + cols[None, :]
        acc += tl.load(P + offs, mask=mask, other=0.0)
        if TWO:
            acc_q += tl.load(Q + offs, mask=mask, other=0.0)
    tl.store(OUT + cols, tl.sum(acc, axis=0).to(OUT.dtype.element_ty), mask=col_ok)
    if TWO:
        tl.store(OUT_Q + cols, tl.sum(acc_q, axis=0).to(OUT_Q.dtype.element_ty), mask=col_ok)


_fwd = Launcher(_rms_norm_fwd_kernel)
_bwd = Launcher(_rms_norm_bwd_kernel)
_sum_partials = Launcher(_sum_partials_kernel)
# Narrow column blocks: more programs share the reduction (faster on an H200: NOTES-triton.md).
_SUM_BLOCK_N = 16
_SUM_BLOCK_G = 64


def sum_partials(p, dtype, q=None, q_dtype=None):
    """Column sums of the fp32 partial rows ``p`` (and ``q``) in ``dtype`` (``q_dtype``)."""
    g, n = p.shape
    out = torch.empty(n, dtype=dtype, device=p.device)
    out_q = torch.empty(n, dtype=q_dtype, device=p.device) if q is not None else out
    if n > 0:
        _sum_partials((cdiv(n, _SUM_BLOCK_N),), p, out, p if q is None else q, out_q, g, n,
                      TWO=q is not None, BLOCK_G=_SUM_BLOCK_G, BLOCK_N=_SUM_BLOCK_N,
                      num_warps=warps_as_threads(4, target_of(p)))
    return out if q is None else (out, out_q)


def _norm_fwd(x, r, s, weight, eps, offset, out_dtype):
    """y (in ``out_dtype``, default x's or s's dtype) and rstd of the rows of x, or with r of s = x + r
    (stored to s)."""
    n = x.shape[-1]
    x2, m, sx = rows_of(x, n)
    r2, _, sr = rows_of(r, n) if r is not None else (x2, m, sx)
    y = torch.empty(x.shape, dtype=out_dtype or (x.dtype if s is None else s.dtype), device=x.device)
    rstd = torch.empty(x.shape[:-1], dtype=torch.float32, device=x.device)
    if m == 0:
        return y, rstd
    block, rows, one_pass, warps = norm_config(n, False, target_of(x))
    _fwd(
        (cdiv(m, rows),), x2, r2, weight, y, y if s is None else s, rstd, m, n, sx, sr, float(eps), float(offset),
        HAS_RES=r is not None, ROWS=rows, BLOCK_N=block, ONE_PASS=one_pass, num_warps=warps,
    )
    return y, rstd


def rms_norm_fwd(x, weight, eps, offset, out_dtype=None):
    check_dtypes("rms_norm", x=x, weight=weight)
    return _norm_fwd(x, None, None, weight, eps, offset, out_dtype)


def add_rms_norm_fwd(x, r, weight, eps, offset, out_dtype=None):
    """(s, y, rstd): s = x + r in torch.result_type(x, r), and rms_norm_fwd(s, ..., out_dtype)."""
    return with_sum(_norm_fwd, x, r, weight, eps, offset, out_dtype)


def with_sum(norm_fwd, x, r, weight, eps, offset, out_dtype):
    """(s, *norm_fwd(x, r, s, ...)): add_rms_norm's checks and its s, for ``norm_fwd`` (``_norm_fwd`` or a
    producer's) to store s = x + r into."""
    check_dtypes("add_rms_norm", x=x, r=r, weight=weight)
    check_same_shape("add_rms_norm", x=x, r=r)
    s = torch.empty(x.shape, dtype=torch.result_type(x, r), device=x.device)
    return (s, *norm_fwd(x, r, s, weight, eps, offset, out_dtype))


def rms_norm_bwd(dy, x, weight, rstd, eps, offset, dres=None):
    dx, _, dw = _norm_bwd(dy, x, weight, rstd, offset, dres, None)
    return dx, dw


def add_rms_norm_bwd(dy, s, weight, rstd, eps, offset, ds, r_dtype):
    """(dx, dr, dw) of add_rms_norm: dx = the norm's ds + ds (``ds`` may be None), and the same
    gradient rounded to the residual branch's ``r_dtype`` by the same kernel."""
    return _norm_bwd(dy, s, weight, rstd, offset, ds, r_dtype)


def _norm_bwd(dy, x, weight, rstd, offset, dres, dx2_dtype):
    check_dtypes("rms_norm", dy=dy, x=x, weight=weight, dres=dres)
    if dres is not None:
        check_same_shape("rms_norm_bwd", x=x, dres=dres)
    n = x.shape[-1]
    (x2, m, sx), (dy2, _, sdy) = rows_of(x, n), rows_of(dy, n)
    dres2, _, sdres = rows_of(dres, n) if dres is not None else (x2, m, sx)
    target = target_of(x)
    block, rows, one_pass, warps = norm_config(n, True, target, dres is not None)
    grid = max(1, min(num_programs_cap(device_key(x)), cdiv(m, rows)))
    dx = torch.empty(x.shape, dtype=x.dtype, device=x.device)
    dx2 = None if dx2_dtype is None else torch.empty(x.shape, dtype=dx2_dtype, device=x.device)
    # The looped path accumulates into its partial row, so that row must start at zero.
    alloc = torch.empty if one_pass and m > 0 else torch.zeros
    dwp = alloc((grid, n), dtype=torch.float32, device=x.device)
    if m > 0:
        tiles = cdiv(cdiv(m, rows), grid)
        extra = dres.element_size() if dres is not None else 0  # a third staged tile
        stages = bwd_stages(tiles, rows, block, x.element_size(), extra, target) if one_pass else 1
        _bwd(
            (grid,), dy2, x2, weight, rstd if rstd.is_contiguous() else rstd.contiguous(), dres2, dx,
            dx if dx2 is None else dx2, dwp, m, n, sdy, sx, sdres, tiles, float(offset),
            HAS_DRES=dres is not None, HAS_DX2=dx2 is not None, ROWS=rows, BLOCK_N=block, ONE_PASS=one_pass,
            STAGES=stages, num_warps=warps,
        )
    return dx, dx2, sum_partials(dwp, weight.dtype)
