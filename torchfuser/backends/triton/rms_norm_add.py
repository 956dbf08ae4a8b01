"""Norm then add in Triton (post-block norms: OLMo-2's ``residual + norm(block(x))``).

Forward, per row a of length N, with the residual row r:
    rstd = rsqrt(Σa²/N + eps),   y = a · rstd · (offset + w)   (fp32, rounded once to y's dtype: Y_ROUND)
    out = r + y                                                 (fp32, rounded once to out's dtype)
One pass reads a and r and writes out and rstd: y is never stored (unfused: the norm writes y, the add reads
it back with r). y's rounding is kept (y rounded, then widened) so that out is bit for bit torch's r + y.
Saved for the backward: a, w and rstd (fp32, one per row). The backward has no kernel of its own:
dr = dout, and da, dw are ``rms_norm_bwd``'s of dout rounded to y's dtype (its kernel reads a wider a or dy).
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from ._common import Launcher, cdiv, check_dtypes, check_same_shape, rows_of, target_of
from .rms_norm import norm_config, rms_norm_bwd

_ROUND = {torch.float32: 0, torch.bfloat16: 1, torch.float16: 2}


@triton.jit
def _rounded(y, Y_ROUND: tl.constexpr):
    """y as rounded to the norm's output dtype (0: fp32, 1: bf16, 2: fp16), back in fp32."""
    if Y_ROUND == 1:
        y = y.to(tl.bfloat16).to(tl.float32)
    elif Y_ROUND == 2:
        y = y.to(tl.float16).to(tl.float32)
    return y


@triton.jit
def _rms_norm_add_fwd_kernel(
    A, R, W, OUT, RSTD, M, N, stride_a, stride_r, eps, offset,
    Y_ROUND: tl.constexpr, ROWS: tl.constexpr, BLOCK_N: tl.constexpr, ONE_PASS: tl.constexpr,
):
    rows = (tl.program_id(0) * ROWS + tl.arange(0, ROWS)).to(tl.int64)
    row_ok = rows < M
    cols = tl.arange(0, BLOCK_N)
    a_rows = A + rows[:, None] * stride_a
    r_rows = R + rows[:, None] * stride_r
    o_rows = OUT + rows[:, None] * N
    if ONE_PASS:
        mask = row_ok[:, None] & (cols < N)[None, :]
        a = tl.load(a_rows + cols[None, :], mask=mask, other=0.0).to(tl.float32)
        # r loaded with a, not after the row reduction: its latency overlaps a's
        r = tl.load(r_rows + cols[None, :], mask=mask, other=0.0).to(tl.float32)
        rstd = tl.rsqrt(tl.sum(a * a, axis=1) / N + eps)
        w = tl.load(W + cols, mask=cols < N, other=0.0).to(tl.float32) + offset
        y = _rounded(a * rstd[:, None] * w[None, :], Y_ROUND)
        tl.store(o_rows + cols[None, :], (r + y).to(OUT.dtype.element_ty), mask=mask)
    else:
        # Rows past MAX_FUSED: a read twice (the second time mostly from L2), per-lane partial sums reduced once.
        acc = tl.zeros([ROWS, BLOCK_N], dtype=tl.float32)
        for start in range(0, N, BLOCK_N):
            c = start + cols
            mask = row_ok[:, None] & (c < N)[None, :]
            a = tl.load(a_rows + c[None, :], mask=mask, other=0.0).to(tl.float32)
            acc += a * a
        rstd = tl.rsqrt(tl.sum(acc, axis=1) / N + eps)
        for start in range(0, N, BLOCK_N):
            c = start + cols
            mask = row_ok[:, None] & (c < N)[None, :]
            a = tl.load(a_rows + c[None, :], mask=mask, other=0.0).to(tl.float32)
            r = tl.load(r_rows + c[None, :], mask=mask, other=0.0).to(tl.float32)
            w = tl.load(W + c, mask=c < N, other=0.0).to(tl.float32) + offset
            y = _rounded(a * rstd[:, None] * w[None, :], Y_ROUND)
            tl.store(o_rows + c[None, :], (r + y).to(OUT.dtype.element_ty), mask=mask)
    tl.store(RSTD + rows, rstd, mask=row_ok)


_fwd = Launcher(_rms_norm_add_fwd_kernel)


def rms_norm_add_fwd(a, r, weight, eps, offset, y_dtype=None):
    """(out, rstd): out = r + rms_norm(a)·(offset + w), the norm rounded to ``y_dtype`` (default a's) first, out in
    torch.result_type of r and y."""
    check_dtypes("rms_norm_add", a=a, r=r, weight=weight)
    check_same_shape("rms_norm_add", a=a, r=r)
    yd = y_dtype or a.dtype
    n = a.shape[-1]
    (a2, m, sa), (r2, _, sr) = rows_of(a, n), rows_of(r, n)
    out = torch.empty(a.shape, dtype=torch.promote_types(r.dtype, yd), device=a.device)
    rstd = torch.empty(a.shape[:-1], dtype=torch.float32, device=a.device)
    if m == 0:
        return out, rstd
    block, rows, one_pass, warps = norm_config(n, False, target_of(a))
    _fwd((cdiv(m, rows),), a2, r2, weight, out, rstd, m, n, sa, sr, float(eps), float(offset),
         Y_ROUND=_ROUND[yd], ROWS=rows, BLOCK_N=block, ONE_PASS=one_pass, num_warps=warps)
    return out, rstd


def rms_norm_add_bwd(dout, a, weight, rstd, eps, offset, y_dtype=None):
    """(da, dw): rms_norm_bwd of dout rounded to y's dtype (as autograd casts the add's gradient). The kernel
    reads a and dy in their own dtypes and computes in fp32, so a narrower a than y needs no widening."""
    yd = y_dtype or a.dtype
    return rms_norm_bwd(dout if dout.dtype == yd else dout.to(yd), a, weight, rstd, eps, offset)
