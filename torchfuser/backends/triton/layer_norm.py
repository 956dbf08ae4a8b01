"""LayerNorm in Triton.

Forward, per row x of length N:
    μ = Σx/N,  r = rsqrt(Σ(x−μ)²/N + eps),  y = (x−μ) · r · w + b
Saved for the backward: x, w, b and μ, r (fp32, one value per row).
Backward, with x̂ = (x−μ)·r and g = dy · w:
    dx = r · (g − x̂ · Σ(g·x̂)/N − Σg/N)      dw = Σ_rows dy · x̂      db = Σ_rows dy
The variance is taken around the mean (two passes over the row, in registers when it fits),
not as E[x²]−μ², which cancels catastrophically when |μ| ≫ σ.
With a residual (``add_layer_norm_fwd``) the row normalised is s = x + res, stored (rounded to s's dtype)
and normalised as stored; the backward can add the residual stream's gradient dres to dx in fp32, before
dx's one rounding (``layer_norm_res_bwd``): the residual adds of a pre-norm layer inside its norms.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from ._common import Launcher, bwd_stages, cdiv, check_dtypes, check_same_shape, device_key, num_programs_cap, rows_of, target_of
from .rms_norm import _row_input, norm_config, sum_partials


@triton.jit
def _layer_norm_fwd_kernel(
    X, R, W, B, Y, S, MEAN, RSTD, M, N, stride_x, stride_r, eps,
    HAS_BIAS: tl.constexpr, HAS_RES: tl.constexpr, ROWS: tl.constexpr, BLOCK_N: tl.constexpr, ONE_PASS: tl.constexpr,
):
    # HAS_RES: s = x + res (R: the residual branch, row stride stride_r), stored to S (contiguous) and
    # normalised as stored; later passes recompute x + res rather than read S back (rms_norm's reason).
    rows = (tl.program_id(0) * ROWS + tl.arange(0, ROWS)).to(tl.int64)
    row_ok = rows < M
    cols = tl.arange(0, BLOCK_N)
    x_rows = X + rows[:, None] * stride_x
    y_rows = Y + rows[:, None] * N
    r_rows = R + rows[:, None] * stride_r
    s_rows = S + rows[:, None] * N
    if ONE_PASS:
        col_ok = cols < N
        mask = row_ok[:, None] & col_ok[None, :]
        x = _row_input(x_rows, r_rows, s_rows, cols, mask, S, HAS_RES)
        mean = tl.sum(x, axis=1) / N
        xc = tl.where(mask, x - mean[:, None], 0.0)
        rstd = tl.rsqrt(tl.sum(xc * xc, axis=1) / N + eps)
        w = tl.load(W + cols, mask=col_ok, other=0.0).to(tl.float32)
        y = xc * rstd[:, None] * w[None, :]
        if HAS_BIAS:
            y += tl.load(B + cols, mask=col_ok, other=0.0).to(tl.float32)[None, :]
        tl.store(y_rows + cols[None, :], y.to(Y.dtype.element_ty), mask=mask)
    else:
        acc = tl.zeros([ROWS, BLOCK_N], dtype=tl.float32)
        for start in range(0, N, BLOCK_N):
            c = start + cols
            mask = row_ok[:, None] & (c < N)[None, :]
            acc += _row_input(x_rows, r_rows, s_rows, c, mask, S, HAS_RES)
        mean = tl.sum(acc, axis=1) / N
        acc = tl.zeros([ROWS, BLOCK_N], dtype=tl.float32)
        for start in range(0, N, BLOCK_N):
            c = start + cols
            mask = row_ok[:, None] & (c < N)[None, :]
            x = tl.load(x_rows + c[None, :], mask=mask, other=0.0).to(tl.float32)
            if HAS_RES:
                x = (x + tl.load(r_rows + c[None, :], mask=mask, other=0.0).to(tl.float32)).to(S.dtype.element_ty).to(tl.float32)
            xc = tl.where(mask, x - mean[:, None], 0.0)
            acc += xc * xc
        rstd = tl.rsqrt(tl.sum(acc, axis=1) / N + eps)
        for start in range(0, N, BLOCK_N):
            c = start + cols
            mask = row_ok[:, None] & (c < N)[None, :]
            x = tl.load(x_rows + c[None, :], mask=mask, other=0.0).to(tl.float32)
            if HAS_RES:
                x = (x + tl.load(r_rows + c[None, :], mask=mask, other=0.0).to(tl.float32)).to(S.dtype.element_ty).to(tl.float32)
            w = tl.load(W + c, mask=c < N, other=0.0).to(tl.float32)
            y = (x - mean[:, None]) * rstd[:, None] * w[None, :]
            if HAS_BIAS:
                y += tl.load(B + c, mask=c < N, other=0.0).to(tl.float32)[None, :]
            tl.store(y_rows + c[None, :], y.to(Y.dtype.element_ty), mask=mask)
    tl.store(MEAN + rows, mean, mask=row_ok)
    tl.store(RSTD + rows, rstd, mask=row_ok)


@triton.jit
def _layer_norm_bwd_kernel(
    DY, X, W, MEAN, RSTD, DRES, DX, DWP, DBP, M, N, stride_dy, stride_x, stride_dres, TILES_PER_PROG,
    HAS_BIAS: tl.constexpr, HAS_DRES: tl.constexpr, ROWS: tl.constexpr, BLOCK_N: tl.constexpr, ONE_PASS: tl.constexpr, STAGES: tl.constexpr,
):
    # Persistent grid as in rms_norm: fp32 partial dw/db per program, summed afterwards.
    pid = tl.program_id(0)
    n_prog = tl.num_programs(0)
    cols = tl.arange(0, BLOCK_N)
    if ONE_PASS:
        col_ok = cols < N
        w = tl.load(W + cols, mask=col_ok, other=0.0).to(tl.float32)
        dw = tl.zeros([BLOCK_N], dtype=tl.float32)
        db = tl.zeros([BLOCK_N], dtype=tl.float32)
        for i in tl.range(0, TILES_PER_PROG, num_stages=STAGES):
            tile = pid + i * n_prog
            rows = (tile * ROWS + tl.arange(0, ROWS)).to(tl.int64)
            row_ok = rows < M
            mask = row_ok[:, None] & col_ok[None, :]
            x = tl.load(X + rows[:, None] * stride_x + cols[None, :], mask=mask, other=0.0).to(tl.float32)
            dy = tl.load(DY + rows[:, None] * stride_dy + cols[None, :], mask=mask, other=0.0).to(tl.float32)
            if HAS_DRES:  # the residual stream's gradient, added in fp32 before dx's rounding
                dres = tl.load(DRES + rows[:, None] * stride_dres + cols[None, :], mask=mask, other=0.0).to(tl.float32)
            mean = tl.load(MEAN + rows, mask=row_ok, other=0.0)
            rstd = tl.load(RSTD + rows, mask=row_ok, other=0.0)
            xhat = tl.where(mask, (x - mean[:, None]) * rstd[:, None], 0.0)
            g = dy * w[None, :]
            c1 = tl.sum(g * xhat, axis=1) / N
            c2 = tl.sum(g, axis=1) / N
            dx = rstd[:, None] * (g - xhat * c1[:, None] - c2[:, None])
            if HAS_DRES:
                dx += dres
            tl.store(DX + rows[:, None] * N + cols[None, :], dx.to(DX.dtype.element_ty), mask=mask)
            dw += tl.sum(dy * xhat, axis=0)
            db += tl.sum(dy, axis=0)
        tl.store(DWP + pid * N + cols, dw, mask=col_ok)
        if HAS_BIAS:
            tl.store(DBP + pid * N + cols, db, mask=col_ok)
    else:
        for i in range(0, TILES_PER_PROG):
            tile = pid + i * n_prog
            row = tile.to(tl.int64)
            row_ok = row < M  # the last round of tiles may run past M
            mean = tl.load(MEAN + row, mask=row_ok, other=0.0)
            rstd = tl.load(RSTD + row, mask=row_ok, other=0.0)
            acc1 = tl.zeros([BLOCK_N], dtype=tl.float32)
            acc2 = tl.zeros([BLOCK_N], dtype=tl.float32)
            for start in range(0, N, BLOCK_N):
                c = start + cols
                m = (c < N) & row_ok
                x = tl.load(X + row * stride_x + c, mask=m, other=0.0).to(tl.float32)
                dy = tl.load(DY + row * stride_dy + c, mask=m, other=0.0).to(tl.float32)
                g = dy * tl.load(W + c, mask=m, other=0.0).to(tl.float32)
                acc1 += tl.where(m, g * (x - mean) * rstd, 0.0)
                acc2 += g
            c1 = tl.sum(acc1, axis=0) / N
            c2 = tl.sum(acc2, axis=0) / N
            for start in range(0, N, BLOCK_N):
                c = start + cols
                m = (c < N) & row_ok
                x = tl.load(X + row * stride_x + c, mask=m, other=0.0).to(tl.float32)
                dy = tl.load(DY + row * stride_dy + c, mask=m, other=0.0).to(tl.float32)
                xhat = (x - mean) * rstd
                g = dy * tl.load(W + c, mask=m, other=0.0).to(tl.float32)
                dx = rstd * (g - xhat * c1 - c2)
                if HAS_DRES:
                    dx += tl.load(DRES + row * stride_dres + c, mask=m, other=0.0).to(tl.float32)
                tl.store(DX + row * N + c, dx.to(DX.dtype.element_ty), mask=m)
                p = DWP + pid * N + c
                tl.store(p, tl.load(p, mask=m, other=0.0) + dy * xhat, mask=m)
                if HAS_BIAS:
                    p = DBP + pid * N + c
                    tl.store(p, tl.load(p, mask=m, other=0.0) + dy, mask=m)


_fwd = Launcher(_layer_norm_fwd_kernel)
_bwd = Launcher(_layer_norm_bwd_kernel)


def _dense(t):
    return t if t.is_contiguous() else t.contiguous()


def layer_norm_fwd(x, weight, bias, eps):
    return _norm_fwd(x, None, None, weight, bias, eps)


def add_layer_norm_fwd(x, r, weight, bias, eps):
    """(s, y, mean, rstd): s = x + r (torch's promoted dtype) and its LayerNorm, in one kernel."""
    check_dtypes("add_layer_norm", x=x, r=r, weight=weight, bias=bias)
    check_same_shape("add_layer_norm", x=x, r=r)
    s = torch.empty(x.shape, dtype=torch.result_type(x, r), device=x.device)
    return (s, *_norm_fwd(x, r, s, weight, bias, eps))


def _norm_fwd(x, r, s, weight, bias, eps):
    check_dtypes("layer_norm", x=x, weight=weight, bias=bias)
    n = x.shape[-1]
    x2, m, sx = rows_of(x, n)
    r2, _, sr = rows_of(r, n) if r is not None else (x2, m, sx)
    y = torch.empty(x.shape, dtype=x.dtype if s is None else s.dtype, device=x.device)
    mean = torch.empty(x.shape[:-1], dtype=torch.float32, device=x.device)
    rstd = torch.empty(x.shape[:-1], dtype=torch.float32, device=x.device)
    if m == 0:
        return y, mean, rstd
    block, rows, one_pass, warps = norm_config(n, False, target_of(x))
    _fwd(
        (cdiv(m, rows),), x2, r2, weight, weight if bias is None else bias, y, y if s is None else s, mean, rstd,
        m, n, sx, sr, float(eps), HAS_BIAS=bias is not None, HAS_RES=r is not None, ROWS=rows, BLOCK_N=block, ONE_PASS=one_pass, num_warps=warps,
    )
    return y, mean, rstd


def layer_norm_bwd(dy, x, weight, bias, mean, rstd, eps):
    return layer_norm_res_bwd(dy, x, weight, bias, mean, rstd, eps)


def layer_norm_res_bwd(dy, x, weight, bias, mean, rstd, eps, dres=None):
    check_dtypes("layer_norm", dy=dy, x=x, weight=weight, bias=bias, dres=dres)
    if dres is not None:
        check_same_shape("layer_norm_bwd", x=x, dres=dres)
    n = x.shape[-1]
    (x2, m, sx), (dy2, _, sdy) = rows_of(x, n), rows_of(dy, n)
    dres2, _, sdres = rows_of(dres, n) if dres is not None else (x2, m, sx)
    target = target_of(x)
    block, rows, one_pass, warps = norm_config(n, True, target, dres is not None)
    grid = max(1, min(num_programs_cap(device_key(x)), cdiv(m, rows)))
    dx = torch.empty(x.shape, dtype=x.dtype, device=x.device)
    alloc = torch.empty if one_pass and m > 0 else torch.zeros
    dwp = alloc((grid, n), dtype=torch.float32, device=x.device)
    dbp = alloc((grid, n), dtype=torch.float32, device=x.device) if bias is not None else dwp
    if m > 0:
        tiles = cdiv(cdiv(m, rows), grid)
        extra = dres.element_size() if dres is not None else 0
        stages = bwd_stages(tiles, rows, block, x.element_size(), extra, target) if one_pass else 1
        _bwd(
            (grid,), dy2, x2, weight, _dense(mean), _dense(rstd), dres2, dx, dwp, dbp, m, n, sdy, sx, sdres,
            tiles, HAS_BIAS=bias is not None, HAS_DRES=dres is not None, ROWS=rows, BLOCK_N=block, ONE_PASS=one_pass, STAGES=stages,
            num_warps=warps,
        )
    if bias is None:
        return dx, sum_partials(dwp, weight.dtype), weight.new_empty(0)
    dw, db = sum_partials(dwp, weight.dtype, dbp, bias.dtype)
    return dx, dw, db
