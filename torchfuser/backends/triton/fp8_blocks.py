"""Blockwise FP8 (e4m3) quantisation in Triton, ``fp8="blockwise"``: bit for bit
backends/reference/fp8_blocks.py (its module docstring is the spec: shapes, layouts, strides).

Per block b of 128 elements (1 × 128, 128 × 1, or a weight's 128 × 128), every step in fp32:
    amax_b = max |t| over b                       (NaN propagates: an integer max of |t|'s bit patterns)
    scale  = max(amax_b, 1e-12) / 448             (a true division, div_rn)
    inv    = 448 / max(amax_b, 1e-12)             (a true division)
    q      = e4m3(clamp(t · inv, −448, 448))      (a multiply; round to nearest even)
with fp8_quant.py's jit helpers (_abs_bits, _as_float, _scales, _e4m3), which give
backends/reference/fp8_quant.py's bits. Nothing is saved for a backward (quantisation is not
differentiated).

``fp8_quantize_blocks(t, rows, cols)`` → (q, s, qt, st): ``_fp8_quant_blocks_kernel``, one launch, one
program a 128 × 128 tile of u (t, or tᵀ when t's first dim is the dense one), the tile read once. Every
scale is local to the tile (a row's 128 columns, a column's 128 rows), so there is no amax pass, no
memset, no atomics: ROWS writes q row-major and s (column-major, strides (1, M)); COLS writes qᵀ
(transposed through shared memory as fp8, 1 byte an element) and st (strides (1, K)).
``fp8_quantize_weight_blocks(w)`` → (q, s_fwd, qt, s_bwd): ``_fp8_quant_weight_blocks_kernel``, one
launch, one program a 128 × 128 block: one scale, q and qᵀ (the same values, qᵀ cast apart: see the
kernel), the scale into both of scaled_mm's padded layouts, and the round-up entries' 1.0.

Tile: a whole 128 × 128 block a program, at 16 warps (32 fp32 values a thread; warps_for), every mode.
Row scales need a row's 128 columns and column scales a column's 128 rows, so a tile that serves both
must span 128 × 128: a 128-row × 64-column step has its column amaxes complete but only half of each
row's, and the row-scaled q of the first half would wait on the second (held in registers anyway, or
read again). The integer max would keep such a split bit-exact; it would save nothing, so the tile is
not split; nor widened (128 × 256 would double the registers of the both-ways tile). Compiled for
sm_90 (_crosscompile.resources, Triton 3.6): both ways 120 registers a thread, no spills, 16 KiB of
shared memory (qᵀ's fp8 tile), one program an SM; rows only 60 (two an SM); the weight kernel 95 (fp32)
/ 112 (bf16); on gfx942 38–68 VGPRs, no spills. Not yet timed on a GPU.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from ..reference.fp8_blocks import BLOCK, _check, _column_major
from ._common import Launcher, check_dtypes, target_of, warps_for
from .fp8_quant import E4M3, _abs_bits, _as_float, _dense_last, _e4m3, _scales

_PAD = 4  # scaled_mm's 128 × 128 scale layouts round the inner blocks up to a multiple of 4


@triton.jit
def _block_tile(X, stride_x, BLOCK: tl.constexpr):
    # The program's 128 × 128 tile of u, in fp32, with its rows and columns (int64: q's and qᵀ's offsets
    # pass 2³¹ for large operands). No mask: both sides are multiples of 128 (checked by the launchers).
    rows = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    cols = tl.program_id(1).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    return rows, cols, tl.load(X + rows[:, None] * stride_x + cols[None, :]).to(tl.float32)


@triton.jit
def _fp8_quant_blocks_kernel(
    X, Q, S, QT, ST, A, B, stride_x,
    ROWS: tl.constexpr, COLS: tl.constexpr, BLOCK: tl.constexpr,
):
    # u: A × B. ROWS: Q = u (A × B), S[a, b / 128] at S + (b / 128)·A + a (A × B/128, column-major).
    # COLS: QT = uᵀ (B × A), ST[b, a / 128] at ST + (a / 128)·B + b (B × A/128, column-major).
    rows, cols, x = _block_tile(X, stride_x, BLOCK)
    bits = _abs_bits(x)
    if ROWS:
        s, inv = _scales(_as_float(tl.max(bits, axis=1)))  # [BLOCK]: each row's 128 columns
        tl.store(S + tl.program_id(1).to(tl.int64) * A + rows, s)
        tl.store(Q + rows[:, None] * B + cols[None, :], _e4m3(x, inv[:, None], Q))
    if COLS:
        st, inv_t = _scales(_as_float(tl.max(bits, axis=0)))  # [BLOCK]: each column's 128 rows
        tl.store(ST + tl.program_id(0).to(tl.int64) * B + cols, st)
        # Its own cast (another multiplier than q's), transposed as fp8: qᵀ's rows of 128 bytes leave coalesced.
        qt = _e4m3(x, inv_t[None, :], QT)
        tl.store(QT + cols[:, None] * A + rows[None, :], tl.trans(qt))


@triton.jit
def _fp8_quant_weight_blocks_kernel(
    X, Q, QT, SF, SB, A, B, stride_x, PAD_B, PAD_A,
    BLOCK: tl.constexpr, PAD: tl.constexpr,
):
    # u: A × B, blocks (i, j) of 128 × 128. Q = u, QT = uᵀ. SF[i, j] at SF + i·PAD_B + j and SB[i, j] at
    # SB + j·PAD_A + i, with PAD_B = round_up(B/128, 4), PAD_A = round_up(A/128, 4): scaled_mm's layouts
    # (u = w: SF is s_fwd, SB is s_bwd; u = wᵀ: the other way round).
    rows, cols, x = _block_tile(X, stride_x, BLOCK)
    i, j = tl.program_id(0).to(tl.int64), tl.program_id(1).to(tl.int64)
    bits = _abs_bits(x)
    scale, inv = _scales(_as_float(tl.max(tl.max(bits, axis=1), axis=0)))
    # qᵀ gets a cast of its own, not q's e4m3 tile transposed: one e4m3 tile stored both as it is and
    # transposed came out wrong from fp32 input on an H200 (Triton 3.6, fp8_quant.py's tensorwise
    # both-ways writer: a quarter of qᵀ; NOTES-fp8.md), where two casts by different multipliers (its rowwise
    # form) were right. Compiled for sm_90 from fp32, the two forms' PTX differ there only: the faulty one
    # sends the registers q is stored from through shared memory too. A second cast by the same scale, or
    # by the same reduction recomputed, is merged into the first (CSE: 16 e4m3x2 conversions a thread, not
    # 32; "a second cast did not help" on the H200), so qᵀ's multiplier is from the amax reduced in the other
    # order: the same bits (an integer max is order-free), not provably the same value, so qᵀ is cast
    # apart and only its own registers are transposed, as in the rowwise form. Not yet run on a GPU.
    _, inv_t = _scales(_as_float(tl.max(tl.max(bits, axis=0), axis=0)))
    tl.store(Q + rows[:, None] * B + cols[None, :], _e4m3(x, inv, Q))
    tl.store(QT + cols[:, None] * A + rows[None, :], tl.trans(_e4m3(x, inv_t, QT)))
    tl.store(SF + i * PAD_B + j, scale)
    tl.store(SB + j * PAD_A + i, scale)
    # The round-up entries (1.0, as the reference's torch.ones): written here by the last block of each
    # row / column of blocks, so the scales need no fill launch before this one (one launch in all, and
    # none of an extra kernel in a CUDA graph); at most 3 floats a program, masked off where there are none.
    pad = tl.arange(0, PAD)
    ones = tl.full([PAD], 1.0, tl.float32)
    nb, na = B // BLOCK, A // BLOCK
    if j == nb - 1:
        tl.store(SF + i * PAD_B + nb + pad, ones, mask=nb + pad < PAD_B)
    if i == na - 1:
        tl.store(SB + j * PAD_A + na + pad, ones, mask=na + pad < PAD_A)


_blocks = Launcher(_fp8_quant_blocks_kernel)
_weight_blocks = Launcher(_fp8_quant_weight_blocks_kernel)


def _dense(t: torch.Tensor) -> tuple[torch.Tensor, bool]:
    """(u, flipped): t, or tᵀ when only t's first dim is dense (a transposed view: read as it lies), or a
    dense copy of t when neither is."""
    if _dense_last(t):
        return t, False
    if _dense_last(t.t()):
        return t.t(), True
    return t.contiguous(), False


def _warps(t: torch.Tensor) -> int:
    return warps_for(BLOCK * BLOCK, warp_size=target_of(t).warp_size)


def fp8_quantize_blocks(t: torch.Tensor, rows: bool, cols: bool) -> tuple[torch.Tensor, ...]:
    """(q, s, qt, st) of an activation t (M × K, multiples of 128, any strides), as the reference's:
    q = t in e4m3 (M × K) with s (M × K/128, strides (1, M)) if ``rows``; qt = tᵀ in e4m3 (K × M) with st
    (K × M/128, strides (1, K)) if ``cols``; empty tensors for what is not asked."""
    m, k = _check(t, "fp8_quantize_blocks")
    check_dtypes("fp8_quantize_blocks", t=t)
    dev = t.device
    empty = lambda dtype: torch.empty(0, dtype=dtype, device=dev)  # noqa: E731  (the reference's new_empty(0))
    q, s = (torch.empty(m, k, dtype=E4M3, device=dev), _column_major(m, k // BLOCK, dev)) if rows else \
        (empty(E4M3), empty(torch.float32))
    qt, st = (torch.empty(k, m, dtype=E4M3, device=dev), _column_major(k, m // BLOCK, dev)) if cols else \
        (empty(E4M3), empty(torch.float32))
    if not (rows or cols) or t.numel() == 0:
        return q, s, qt, st
    u, flip = _dense(t)
    # u = tᵀ: u's rows are t's columns, so u's row quantisation is t's qt (with st: u's A = K, the same
    # column-major layout) and u's transposed one is t's q; the constexprs swap with them.
    qu, su, qut, sut, r, c = (qt, st, q, s, cols, rows) if flip else (q, s, qt, st, rows, cols)
    a, b = u.shape
    _blocks((a // BLOCK, b // BLOCK), u, qu, su, qut, sut, a, b, u.stride(0),
            ROWS=r, COLS=c, BLOCK=BLOCK, num_warps=_warps(t))
    return q, s, qt, st


def _padded(r: int, c: int, device) -> torch.Tensor:
    """The reference's _padded layout of an R × C block grid, uninitialised (the kernel writes all of it)."""
    return torch.empty(r, -(-c // _PAD) * _PAD, dtype=torch.float32, device=device).t()


def fp8_quantize_weight_blocks(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """(q, s_fwd, qt, s_bwd) of a weight w (N × K, multiples of 128, any strides), as the reference's: one
    scale per 128 × 128 block; q = w and qt = wᵀ in e4m3; s_fwd (round_up(K/128, 4) × N/128, strides
    (1, round_up(K/128, 4))) and s_bwd (round_up(N/128, 4) × K/128), the round-up rows 1."""
    n, k = _check(w, "fp8_quantize_weight_blocks")
    check_dtypes("fp8_quantize_weight_blocks", w=w)
    dev = w.device
    q, qt = torch.empty(n, k, dtype=E4M3, device=dev), torch.empty(k, n, dtype=E4M3, device=dev)
    s_fwd, s_bwd = _padded(n // BLOCK, k // BLOCK, dev), _padded(k // BLOCK, n // BLOCK, dev)
    if w.numel() == 0:  # no blocks: both scale layouts are empty too (R = 0 or C = 0, round_up(0, 4) = 0)
        return q, s_fwd, qt, s_bwd
    u, flip = _dense(w)
    # u = wᵀ: its q is w's qt, and its block (i, j) is w's (j, i), so SF / SB land in s_bwd / s_fwd.
    qu, qut, sf, sb = (qt, q, s_bwd, s_fwd) if flip else (q, qt, s_fwd, s_bwd)
    a, b = u.shape
    _weight_blocks((a // BLOCK, b // BLOCK), u, qu, qut, sf, sb, a, b, u.stride(0),
                   sf.stride(1), sb.stride(1), BLOCK=BLOCK, PAD=_PAD, num_warps=_warps(w))
    return q, s_fwd, qt, s_bwd
