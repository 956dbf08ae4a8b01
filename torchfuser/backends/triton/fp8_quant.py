"""FP8 (e4m3) quantisation with current scaling, in Triton: the operands of modules/fp8/__init__.py's GEMMs.

For a 2-D s (bf16 / fp16 / fp32), every step in fp32:
    amax  = max |s| over each row of s (rowwise) or over all of s (tensorwise)
    scale = max(amax, 1e-12) / 448                 (448: e4m3's largest finite value; a true division)
    inv   = 448 / max(amax, 1e-12)                 (a true division, one a row or tensor)
    q     = e4m3(clamp(s · inv, −448, 448))        (a multiply; round to nearest even)
and ``fp8_quantize(t, tensorwise, transpose)`` returns (q row-major, scale: rows × 1 fp32, or ()),
for s = t or, with ``transpose``, s = tᵀ: the dW GEMM's operands dyᵀ and xᵀ, scaled per column of
dy and x, written transposed straight from t, no ``t.t().contiguous()`` copy. Nothing is saved for
a backward: quantisation is not differentiated (the FP8 GEMMs' autograd is modules/fp8/__init__.py's).

Bit for bit the PyTorch code it replaces (``t.float()``, abs, amax, clamp_min, two divisions, a multiply,
clamp, ``.to(torch.float8_e4m3fn)`` on the CPU): the divisions are ``div_rn`` (IEEE, as PyTorch's
tensor / tensor; Triton's ``/`` is an approximate division on NVIDIA), the cast is
``cvt.rn.satfinite.e4m3x2.f32`` (round to nearest even; saturation never acts after the clamp).
amax propagates NaN as ``torch.amax`` does (a NaN row gives NaN scales and values, not 448s): it is
an integer max of |s|'s bit patterns.
One caveat on CUDA: PyTorch's ``amax / 448.0`` there multiplies by fp32(1/448) (its division by a
CPU scalar does), so the old CUDA path's scales could differ from these by one fp32 ulp.

Kernels (one launch rowwise, two otherwise, two for both ways, with a memset tensorwise; no host sync,
so CUDA graphs capture them):
- ``_fp8_quant_rows_kernel``: rowwise, q in s's layout. ROWS rows a program held in registers up to
  MAX_FUSED elements a row (s read once), longer rows walked twice in chunks (the second read from L2).
  With PARTIALS (constexpr; off, it compiles to the same code as without it) it is fp8_quantize_both's
  rowwise first pass: ROWS_PER_PROG rows a program, which also writes its rows' column maxima of |s|
  (one row of K partials a program, as ``_fp8_amax_kernel``'s PER_COLUMN ones; looped rows max theirs
  into the program's own row of P, chunk by chunk).
- ``_fp8_amax_kernel`` + ``_fp8_quant_tiles_kernel``: a grid of (row chunk, BLOCK_B-column block)
  programs over u (the one of s, sᵀ whose last dim is dense). The first writes per-program partial
  amaxes: per column of u (the scales of a transposed rowwise quantisation) or one (tensorwise).
  The second reduces the partials its columns need (L2-resident; 1/16 of what a program reads at
  8192 × 2048 bf16),
  scales and casts its chunk, and writes q tiles transposed (TRANSPOSE: q = uᵀ row-major) or not.
  u is read twice, q written once; the transposition goes through shared memory as fp8 (1 byte).
- ``fp8_quantize_both(t, tensorwise)``: ``fp8_quantize(t, tw, False)`` and ``fp8_quantize(t, tw, True)``
  at once, for an operand two GEMMs need scaled along each dimension (x, dy, the weights).
  Rowwise, the switch ``fp8_rowwise_both`` (``torchfuser.switches``) picks among three paths, bit for bit the same:
  "atomic" (the default) and tensorwise: ``_fp8_amax_both_kernel`` + ``_fp8_quant_both_kernel`` on the
  same grid over u. The first maxes each tile's row and column maxima of |u| into one zeroed int32
  vector (A row entries, then B column ones; one entry tensorwise) with atomic integer max on the bit
  patterns: order-free, so the bits do not depend on the programs' order, and NaN propagates as above.
  The second reads each tile once and writes both q (row-major, per-row scales) and qᵀ (transposed as
  fp8 through shared memory, per-column scales), with the scales. t is read twice in all, where the two
  calls read it three times; each e4m3 copy is written once. In the swept geometry (``both_config``) its
  rowwise form is faster than the pair, alone and in whole llama1b steps (docs/performance/NOTES-fp8.md:
  the both-ways writer). A producer that took t's maxima as it wrote t (gated_fp8.py) leaves only the writer to run
  (``fp8_quantize_both_amax``). Tensorwise fp32 input (the
  master weights) takes one amax pass and a tiles pass for each copy instead (the Triton 3.6 fault at
  ``fp8_quantize_both``).
  "pair": the two separate calls.
  "rows+tiles": the rows kernel with PARTIALS (q and its scales, and the column partials), then
  ``_fp8_quant_tiles_kernel`` (PER_COLUMN, TRANSPOSE) reducing them into qᵀ's scales and writing qᵀ:
  t read twice, q and qᵀ written once, no memset, no atomics; alone no faster than the pair (NOTES-fp8.md).
"""
from __future__ import annotations

from functools import lru_cache

import torch
import triton
import triton.language as tl

from torchfuser.switches import SWITCHES

from . import targets as _targets
from ._common import (
    CPU, Launcher, Target, _live_sms, cdiv, check_dtypes, next_pow2, sms_of_index, target_of, warps_as_threads, warps_for,
)

E4M3 = torch.float8_e4m3fn
MAX_FUSED = 16384  # rows up to this many elements are held whole (as the norms' forward, rms_norm.py)
_CHUNK = 4096
_TILE = 4096  # elements a program in the one-pass rowwise case: short rows are packed several a program
# The tiled kernels: BLOCK_A rows × BLOCK_B columns of u a step. BLOCK_B = 64 columns are 128 bytes of a
# bf16 row (one full line read); BLOCK_A = 128 rows are 128 bytes of a q row when q is written transposed.
_BLOCK_A = 128
_BLOCK_B = 64
_PROGRAMS_PER_SM = 4
# The both-ways kernels' geometry, swept on an H200 (benchmarks/probes/fp8_both_ways_sweep_probe.py, timings in
# docs/performance/NOTES-fp8.md): the writer from 16-bit input in 32 × 64 tiles at 4 warps, 32 programs a SM
# (many small programs hide the transposing stores' latency; fp32 input keeps 64-row tiles at 16 warps, 4 a
# SM: no faster there); the amax pass in 128 × 64 tiles at 4 warps.
_BOTH_WRITER = (32, 4, 32)  # (rows a step, warps, programs a SM), 16-bit input
_BOTH_WRITER_FP32 = (64, 16, 4)
_BOTH_AMAX_WARPS = 4
_BLOCK_P = 16  # partial rows reduced a step (per-column scales)
# fp8_quantize_both rowwise: torchfuser.switches' fp8_rowwise_both, "atomic" (the both-ways kernels: the
# faster whole steps), "pair" (the two separate calls) or "rows+tiles" (rows kernel with column partials,
# then the transposed tiles kernel); train_step.py's torchfuser-fp8-pair variant runs whole steps with the pair.
# Row programs a SM of that first pass: more keeps more loads in flight, fewer means fewer partial rows
# for each tiles program to reduce (progs_a × programs × B fp32 read from L2 in all). Not yet timed.
_ROW_PROGRAMS_PER_SM = 2
_BLOCK_PT = 1024  # partials reduced a step (tensorwise)


# |x| as its fp32 bit pattern (sign bit cleared), an int32. For non-negative floats the integer order
# is the float order, with +inf above every finite value and NaN above +inf, so an integer max is
# amax with NaN propagating as torch.amax does, at the cost of an integer max (Triton's float max
# drops NaN on NVIDIA; a custom NaN-aware combine runs element by element under the interpreter).
@triton.jit
def _abs_bits(x):
    return x.to(tl.int32, bitcast=True) & 0x7FFFFFFF


@triton.jit
def _as_float(bits):
    return bits.to(tl.float32, bitcast=True)


@triton.jit
def _scales(amax):
    """(the dequantisation scale max(amax, 1e-12) / 448, the quantisation's multiplier 448 / max(amax,
    1e-12)): two true divisions a row (column, tensor), none an element."""
    a = tl.maximum(amax, 1e-12, propagate_nan=tl.PropagateNan.ALL)
    return tl.math.div_rn(a, 448.0), tl.math.div_rn(448.0, a)


@triton.jit
def _e4m3(x, inv, Q):
    q = tl.clamp(x * inv, -448.0, 448.0, propagate_nan=tl.PropagateNan.ALL)
    return q.to(Q.dtype.element_ty)


@triton.jit
def _rows_one_pass(X, Q, K, stride_x, rows, row_ok, cols):
    # ROWS rows held whole: (their scales, |x|'s bits of the tile).
    x_rows = X + rows[:, None] * stride_x
    q_rows = Q + rows[:, None] * K
    mask = row_ok[:, None] & (cols < K)[None, :]
    x = tl.load(x_rows + cols[None, :], mask=mask, other=0.0).to(tl.float32)
    bits = _abs_bits(x)
    scale, inv = _scales(_as_float(tl.max(bits, axis=1)))
    tl.store(q_rows + cols[None, :], _e4m3(x, inv[:, None], Q), mask=mask)
    return scale, bits


@triton.jit
def _rows_looped(X, Q, K, stride_x, rows, row_ok, cols, P_ROW, KEEP, PARTIALS: tl.constexpr):
    # Rows walked twice in BLOCK_K chunks: their scales. PARTIALS (one row a step): each chunk's |x| bits
    # maxed into the program's own partial row P_ROW, read back unless KEEP is false (the program's first row).
    x_rows = X + rows[:, None] * stride_x
    q_rows = Q + rows[:, None] * K
    # Per-lane maxima, reduced once at the end: fewer cross-warp reductions.
    acc = tl.zeros([rows.shape[0], cols.shape[0]], dtype=tl.int32)
    for start in range(0, K, cols.shape[0]):
        c = start + cols
        mask = row_ok[:, None] & (c < K)[None, :]
        bits = _abs_bits(tl.load(x_rows + c[None, :], mask=mask, other=0.0).to(tl.float32))
        acc = tl.maximum(acc, bits)
        if PARTIALS:
            p_ptr, p_ok = P_ROW + c[None, :], (c < K)[None, :]
            prev = _abs_bits(tl.load(p_ptr, mask=p_ok & KEEP, other=0.0))
            tl.store(p_ptr, _as_float(tl.maximum(prev, bits)), mask=p_ok)
    scale, inv = _scales(_as_float(tl.max(acc, axis=1)))
    for start in range(0, K, cols.shape[0]):
        c = start + cols
        mask = row_ok[:, None] & (c < K)[None, :]
        x = tl.load(x_rows + c[None, :], mask=mask, other=0.0).to(tl.float32)
        tl.store(q_rows + c[None, :], _e4m3(x, inv[:, None], Q), mask=mask)
    return scale


@triton.jit
def _fp8_quant_rows_kernel(
    X, Q, S, M, K, stride_x, P=None, ROWS_PER_PROG=None,  # P, ROWS_PER_PROG: PARTIALS only (positional)
    ROWS: tl.constexpr = 1, BLOCK_K: tl.constexpr = 1, ONE_PASS: tl.constexpr = True, PARTIALS: tl.constexpr = False,
):
    if PARTIALS:
        # fp8_quantize_both's first pass: ROWS_PER_PROG rows a program, and P[program] = its rows'
        # column maxima of |x| (as _fp8_amax_kernel's PER_COLUMN partials), written once, no atomics.
        pid = tl.program_id(0).to(tl.int64)
        first = pid * ROWS_PER_PROG
        cols = tl.arange(0, BLOCK_K)
        if ONE_PASS:
            acc = tl.zeros([ROWS, BLOCK_K], dtype=tl.int32)
            for r0 in range(0, ROWS_PER_PROG, ROWS):
                rows = first + r0 + tl.arange(0, ROWS)
                scale, bits = _rows_one_pass(X, Q, K, stride_x, rows, rows < M, cols)
                tl.store(S + rows, scale, mask=rows < M)
                acc = tl.maximum(acc, bits)
            tl.store(P + pid * K + cols, _as_float(tl.max(acc, axis=0)), mask=cols < K)
        else:
            tl.static_assert(ROWS == 1)  # the partial row is the chunk's bits; kept in P, not in registers
            for r in range(0, ROWS_PER_PROG):
                rows = first + r + tl.arange(0, 1)
                scale = _rows_looped(X, Q, K, stride_x, rows, rows < M, cols, P + pid * K, r > 0, True)
                tl.store(S + rows, scale, mask=rows < M)
                # Row r + 1 reads back what row r stored, maybe from other threads: a CTA barrier orders them.
                tl.debug_barrier()
    else:
        rows = (tl.program_id(0) * ROWS + tl.arange(0, ROWS)).to(tl.int64)
        row_ok = rows < M
        cols = tl.arange(0, BLOCK_K)
        if ONE_PASS:
            scale, _ = _rows_one_pass(X, Q, K, stride_x, rows, row_ok, cols)
        else:
            scale = _rows_looped(X, Q, K, stride_x, rows, row_ok, cols, P, False, False)
        tl.store(S + rows, scale, mask=row_ok)


@triton.jit
def _tile(X, start, A, cols, col_ok, stride_x, BLOCK_A: tl.constexpr):
    """BLOCK_A rows of u from ``start`` at the columns ``cols``, in fp32 (zeros past A and B): the step
    of the tiled kernels, with (rows, row_ok, mask) for their stores."""
    rows = start + tl.arange(0, BLOCK_A)
    row_ok = rows < A
    mask = row_ok[:, None] & col_ok[None, :]
    return rows, row_ok, mask, tl.load(X + rows[:, None] * stride_x + cols[None, :], mask=mask, other=0.0).to(tl.float32)


@triton.jit
def _fp8_amax_kernel(
    X, P, A, B, stride_x, ROWS_PER_PROG,
    BLOCK_A: tl.constexpr, BLOCK_B: tl.constexpr, PER_COLUMN: tl.constexpr,
):
    # P: PER_COLUMN, partial column maxima (programs along A) × B; else one partial a program.
    pa, pb = tl.program_id(0), tl.program_id(1)
    cols = pb * BLOCK_B + tl.arange(0, BLOCK_B)
    col_ok = cols < B
    first = pa.to(tl.int64) * ROWS_PER_PROG
    acc = tl.zeros([BLOCK_A, BLOCK_B], dtype=tl.int32)
    for r0 in range(0, ROWS_PER_PROG, BLOCK_A):
        _, _, _, x = _tile(X, first + r0, A, cols, col_ok, stride_x, BLOCK_A)
        acc = tl.maximum(acc, _abs_bits(x))
    col_max = tl.max(acc, axis=0)
    if PER_COLUMN:
        tl.store(P + pa.to(tl.int64) * B + cols, _as_float(col_max), mask=col_ok)
    else:
        tl.store(P + pa * tl.num_programs(1) + pb, _as_float(tl.max(col_max, axis=0)))


@triton.jit
def _fp8_quant_tiles_kernel(
    X, P, Q, S, A, B, stride_x, ROWS_PER_PROG, NP,
    BLOCK_A: tl.constexpr, BLOCK_B: tl.constexpr, BLOCK_P: tl.constexpr, PER_COLUMN: tl.constexpr,
    TRANSPOSE: tl.constexpr,
):
    pa, pb = tl.program_id(0), tl.program_id(1)
    cols = pb * BLOCK_B + tl.arange(0, BLOCK_B)
    col_ok = cols < B
    if PER_COLUMN:  # NP partial rows of B column maxima
        acc = tl.zeros([BLOCK_P, BLOCK_B], dtype=tl.int32)
        for p0 in range(0, NP, BLOCK_P):
            p = p0 + tl.arange(0, BLOCK_P)
            m = (p < NP)[:, None] & col_ok[None, :]
            acc = tl.maximum(acc, _abs_bits(tl.load(P + p[:, None].to(tl.int64) * B + cols[None, :], mask=m, other=0.0)))
        scale, inv = _scales(_as_float(tl.max(acc, axis=0)))  # [BLOCK_B]
        if pa == 0:
            tl.store(S + cols, scale, mask=col_ok)
        inv_tile = inv[None, :]
    else:  # NP partials of the whole tensor
        acc = tl.zeros([BLOCK_P], dtype=tl.int32)
        for p0 in range(0, NP, BLOCK_P):
            p = p0 + tl.arange(0, BLOCK_P)
            acc = tl.maximum(acc, _abs_bits(tl.load(P + p, mask=p < NP, other=0.0)))
        scale, inv_tile = _scales(_as_float(tl.max(acc, axis=0)))
        if (pa == 0) & (pb == 0):
            tl.store(S, scale)
    first = pa.to(tl.int64) * ROWS_PER_PROG
    for r0 in range(0, ROWS_PER_PROG, BLOCK_A):
        rows, row_ok, mask, x = _tile(X, first + r0, A, cols, col_ok, stride_x, BLOCK_A)
        q = _e4m3(x, inv_tile, Q)
        if TRANSPOSE:  # q = uᵀ: B rows of A; transposed as fp8, so rows of 128 bytes leave coalesced
            tl.store(Q + cols[:, None].to(tl.int64) * A + rows[None, :], tl.trans(q), mask=tl.trans(mask))
        else:
            tl.store(Q + rows[:, None] * B + cols[None, :], q, mask=mask)


@triton.jit
def _fp8_amax_both_kernel(
    X, AMAX, A, B, stride_x, ROWS_PER_PROG,
    BLOCK_A: tl.constexpr, BLOCK_B: tl.constexpr, TENSORWISE: tl.constexpr,
):
    # AMAX (int32, zeroed): |u|'s bit patterns maxed in, per row (A) then per column (B), or one in all.
    # An integer max is order-free, so the atomics give the same bits whatever order programs run in.
    pa, pb = tl.program_id(0), tl.program_id(1)
    cols = pb * BLOCK_B + tl.arange(0, BLOCK_B)
    col_ok = cols < B
    first = pa.to(tl.int64) * ROWS_PER_PROG
    acc = tl.zeros([BLOCK_A, BLOCK_B], dtype=tl.int32)
    for r0 in range(0, ROWS_PER_PROG, BLOCK_A):
        rows, row_ok, _, x = _tile(X, first + r0, A, cols, col_ok, stride_x, BLOCK_A)
        bits = _abs_bits(x)
        if not TENSORWISE:
            tl.atomic_max(AMAX + rows, tl.max(bits, axis=1), mask=row_ok, sem="relaxed")
        acc = tl.maximum(acc, bits)
    col_max = tl.max(acc, axis=0)
    if TENSORWISE:
        tl.atomic_max(AMAX, tl.max(col_max, axis=0), sem="relaxed")
    else:
        tl.atomic_max(AMAX + A + cols, col_max, mask=col_ok, sem="relaxed")


@triton.jit
def _fp8_quant_both_kernel(
    X, AMAX, Q, S, QT, ST, A, B, stride_x, ROWS_PER_PROG,
    BLOCK_A: tl.constexpr, BLOCK_B: tl.constexpr, TENSORWISE: tl.constexpr,
):
    pa, pb = tl.program_id(0), tl.program_id(1)
    cols = pb * BLOCK_B + tl.arange(0, BLOCK_B)
    col_ok = cols < B
    if TENSORWISE:
        scale, inv = _scales(_as_float(tl.load(AMAX)))
        if (pa == 0) & (pb == 0):
            tl.store(S, scale)
            tl.store(ST, scale)
        col_inv = inv
    else:
        col_scale, col_inv = _scales(_as_float(tl.load(AMAX + A + cols, mask=col_ok, other=0)))  # [BLOCK_B]
        if pa == 0:
            tl.store(ST + cols, col_scale, mask=col_ok)
        col_inv = col_inv[None, :]
    first = pa.to(tl.int64) * ROWS_PER_PROG
    for r0 in range(0, ROWS_PER_PROG, BLOCK_A):
        rows, row_ok, mask, x = _tile(X, first + r0, A, cols, col_ok, stride_x, BLOCK_A)
        if TENSORWISE:
            q = _e4m3(x, inv, Q)
            qt = q  # one scale: the same values, stored both ways (not from fp32 input: fp8_quantize_both)
        else:
            row_scale, row_inv = _scales(_as_float(tl.load(AMAX + rows, mask=row_ok, other=0)))  # [BLOCK_A]
            if pb == 0:
                tl.store(S + rows, row_scale, mask=row_ok)
            q = _e4m3(x, row_inv[:, None], Q)
            qt = _e4m3(x, col_inv, QT)
        tl.store(Q + rows[:, None] * B + cols[None, :], q, mask=mask)
        # qt = uᵀ: B rows of A, transposed as fp8 (through shared memory), rows of 128 bytes leave coalesced
        tl.store(QT + cols[:, None].to(tl.int64) * A + rows[None, :], tl.trans(qt), mask=tl.trans(mask))


@lru_cache(maxsize=None)
def rows_config(k: int, target: Target = CPU) -> tuple[int, int, bool, int]:
    """(BLOCK_K, ROWS, ONE_PASS, num_warps) of the rowwise kernel for rows of k elements."""
    if k <= MAX_FUSED:
        block = next_pow2(k)
        rows = max(1, min(64, _TILE // block))
        return block, rows, True, warps_for(rows * block, warp_size=target.warp_size)
    return _CHUNK, 1, False, warps_for(_CHUNK, warp_size=target.warp_size)


def tile_grid(a: int, b: int, block_a: int, block_b: int, per_sm: int, sms: int) -> tuple[tuple[int, int], int]:
    """(grid, rows a program) of a (row chunk, column block) grid over a × b: about ``per_sm`` programs a
    SM, each a whole number of ``block_a``-row steps."""
    blocks_b = cdiv(b, block_b)
    want_a = max(1, min(cdiv(a, block_a), cdiv(per_sm * sms, blocks_b)))
    per_prog = cdiv(cdiv(a, want_a), block_a) * block_a
    return (cdiv(a, per_prog), blocks_b), per_prog


@lru_cache(maxsize=None)
def tiles_config(a: int, b: int, sms: int, target: Target = CPU) -> tuple[int, int, int]:
    """(rows a program, programs along A, num_warps) of the tiled kernels over u (a × b): about
    _PROGRAMS_PER_SM programs a SM, each a whole number of BLOCK_A-row steps."""
    (progs_a, _), per_prog = tile_grid(a, b, _BLOCK_A, _BLOCK_B, _PROGRAMS_PER_SM, sms)
    return per_prog, progs_a, warps_for(_BLOCK_A * _BLOCK_B, warp_size=target.warp_size)


@lru_cache(maxsize=None)
def both_config(a: int, b: int, sms: int, wide: bool, target: Target = CPU) -> tuple[tuple, tuple]:
    """((grid, rows a program, warps) of the atomic amax pass, (grid, rows a program, rows a step, warps) of
    the both-ways writer) over u (a × b); ``wide``: fp32 input."""
    grid, per_prog = tile_grid(a, b, _BLOCK_A, _BLOCK_B, _PROGRAMS_PER_SM, sms)
    amax = grid, per_prog, warps_as_threads(_BOTH_AMAX_WARPS, target)
    step, warps, per_sm = _BOTH_WRITER_FP32 if wide else _BOTH_WRITER
    grid, per_prog = tile_grid(a, b, step, _BLOCK_B, per_sm, sms)
    return amax, (grid, per_prog, step, warps_as_threads(warps, target))


@lru_cache(maxsize=None)
def rows_partials_config(a: int, b: int, sms: int, target: Target = CPU) -> tuple[int, int, bool, int, int, int]:
    """(BLOCK_K, ROWS, ONE_PASS, num_warps, rows a program, programs) of the rows kernel writing column
    partials (fp8_quantize_both's first pass) over u (a × b): rows_config's tiles, about
    _ROW_PROGRAMS_PER_SM programs a SM, each a whole number of ROWS-row steps."""
    block, rows, one_pass, warps = rows_config(b, target)
    want = max(1, min(cdiv(a, rows), _ROW_PROGRAMS_PER_SM * sms))
    per_prog = cdiv(cdiv(a, want), rows) * rows
    return block, rows, one_pass, warps, per_prog, cdiv(a, per_prog)


_rows = Launcher(_fp8_quant_rows_kernel)
_amax = Launcher(_fp8_amax_kernel)
_tiles = Launcher(_fp8_quant_tiles_kernel)
_amax_both = Launcher(_fp8_amax_both_kernel)
_tiles_both = Launcher(_fp8_quant_both_kernel)


def _sms(t: torch.Tensor) -> int:
    """SMs (CUs) of t's device, asked once per device; the table's when simulating or on the CPU."""
    index = t.device.index if t.is_cuda else None
    return _live_sms(index) if index is not None and _targets._simulated is None else sms_of_index(index)


def _dense_last(t: torch.Tensor) -> bool:
    return t.stride(1) == 1 or t.shape[1] == 1


def fp8_quantize(t: torch.Tensor, tensorwise: bool, transpose: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """(q, scale) of s = tᵀ if ``transpose`` else t (2-D, any strides): q is s in e4m3, row-major;
    scale is s's rows' (M × 1, fp32) or, ``tensorwise``, one (a 0-dim fp32 tensor)."""
    check_dtypes("fp8_quantize", t=t)
    if t.dim() != 2:
        raise ValueError(f"fp8_quantize: t must be 2-D, got shape {tuple(t.shape)}")
    s = t.t() if transpose else t
    m, k = s.shape
    q = torch.empty((m, k), dtype=E4M3, device=t.device)
    scale = torch.empty((), dtype=torch.float32, device=t.device) if tensorwise else \
        torch.empty((m, 1), dtype=torch.float32, device=t.device)
    if q.numel() == 0:  # nothing to scale (the ops layer gives empty tensors to the reference backend)
        return q, scale.fill_(1.0)
    # u: the view of s or sᵀ whose last dim is dense, so the tiles are read along lines; sᵀ → flip.
    if _dense_last(s):
        u, flip = s, False
    elif _dense_last(s.t()):
        u, flip = s.t(), True
    else:
        u, flip = s.contiguous(), False
    target = target_of(t)
    if not tensorwise and not flip:
        block, rows, one_pass, warps = rows_config(k, target)
        _rows((cdiv(m, rows),), u, q, scale, m, k, u.stride(0),
              ROWS=rows, BLOCK_K=block, ONE_PASS=one_pass, num_warps=warps)
        return q, scale
    a, b = u.shape
    per_prog, progs_a, warps = tiles_config(a, b, _sms(t), target)
    grid = (progs_a, cdiv(b, _BLOCK_B))
    per_column = not tensorwise
    partials = torch.empty(progs_a * (b if per_column else grid[1]), dtype=torch.float32, device=t.device)
    _amax(grid, u, partials, a, b, u.stride(0), per_prog,
          BLOCK_A=_BLOCK_A, BLOCK_B=_BLOCK_B, PER_COLUMN=per_column, num_warps=warps)
    _tiles(grid, u, partials, q, scale, a, b, u.stride(0), per_prog, progs_a if per_column else partials.numel(),
           BLOCK_A=_BLOCK_A, BLOCK_B=_BLOCK_B, BLOCK_P=_BLOCK_P if per_column else _BLOCK_PT,
           PER_COLUMN=per_column, TRANSPOSE=flip, num_warps=warps)
    return q, scale


def fp8_quantize_both(t: torch.Tensor, tensorwise: bool) -> tuple[tuple[torch.Tensor, torch.Tensor], ...]:
    """((q, scale), (qt, scale_t)): ``fp8_quantize(t, tensorwise, False)`` and ``fp8_quantize(t, tensorwise,
    True)`` bit for bit, from two reads of t (2-D, any strides) in all: q is t in e4m3 and qt is tᵀ,
    both row-major; scale per row of t (M × 1) and scale_t per column (K × 1), or, ``tensorwise``, t's
    one scale twice (two 0-dim fp32 tensors)."""
    check_dtypes("fp8_quantize_both", t=t)
    if t.dim() != 2:
        raise ValueError(f"fp8_quantize_both: t must be 2-D, got shape {tuple(t.shape)}")
    if not tensorwise and SWITCHES.fp8_rowwise_both == "pair":
        return fp8_quantize(t, False, False), fp8_quantize(t, False, True)
    m, k = t.shape
    dev = t.device
    q, qt = torch.empty((m, k), dtype=E4M3, device=dev), torch.empty((k, m), dtype=E4M3, device=dev)
    shapes = ((), ()) if tensorwise else ((m, 1), (k, 1))
    s, st = (torch.empty(shape, dtype=torch.float32, device=dev) for shape in shapes)
    if q.numel() == 0:
        return (q, s.fill_(1.0)), (qt, st.fill_(1.0))
    # u: t or tᵀ, whichever has its last dim dense (the tiles are read along lines); for u = tᵀ the
    # two outputs swap roles: u's rowwise quantisation is tᵀ's, u's transposed one is t's.
    if _dense_last(t):
        u, (qu, su, qut, sut) = t, (q, s, qt, st)
    elif _dense_last(t.t()):
        u, (qu, su, qut, sut) = t.t(), (qt, st, q, s)
    else:
        u, (qu, su, qut, sut) = t.contiguous(), (q, s, qt, st)
    a, b = u.shape
    target = target_of(t)
    per_prog, progs_a, warps = tiles_config(a, b, _sms(t), target)
    grid = (progs_a, cdiv(b, _BLOCK_B))
    if not tensorwise and SWITCHES.fp8_rowwise_both == "rows+tiles":
        # u rowwise as fp8_quantize does, each program also writing its rows' column maxima; then u's
        # transposed quantisation reducing those partials, as fp8_quantize's own amax kernel's.
        block, rows, one_pass, rwarps, rows_per_prog, row_progs = rows_partials_config(a, b, _sms(t), target)
        partials = torch.empty(row_progs * b, dtype=torch.float32, device=dev)
        _rows((row_progs,), u, qu, su, a, b, u.stride(0), partials, rows_per_prog,
              ROWS=rows, BLOCK_K=block, ONE_PASS=one_pass, PARTIALS=True, num_warps=rwarps)
        _tiles(grid, u, partials, qut, sut, a, b, u.stride(0), per_prog, row_progs,
               BLOCK_A=_BLOCK_A, BLOCK_B=_BLOCK_B, BLOCK_P=_BLOCK_P, PER_COLUMN=True, TRANSPOSE=True, num_warps=warps)
        return (q, s), (qt, st)
    if tensorwise and t.dtype == torch.float32:
        # One tile stored both as it is and transposed came out wrong from fp32 input on an H200
        # (Triton 3.6: a quarter of qᵀ's values, bf16 input right, the interpreter right; NOTES-fp8.md;
        # a second cast of the tile did not help). So fp32 (the master weights) takes fp8_quantize's
        # kernels: one amax pass, then a pass for each copy (t read three times, not two).
        partials = torch.empty(progs_a * grid[1], dtype=torch.float32, device=dev)
        _amax(grid, u, partials, a, b, u.stride(0), per_prog,
              BLOCK_A=_BLOCK_A, BLOCK_B=_BLOCK_B, PER_COLUMN=False, num_warps=warps)
        for q_out, s_out, transpose in ((qu, su, False), (qut, sut, True)):
            _tiles(grid, u, partials, q_out, s_out, a, b, u.stride(0), per_prog, partials.numel(),
                   BLOCK_A=_BLOCK_A, BLOCK_B=_BLOCK_B, BLOCK_P=_BLOCK_PT, PER_COLUMN=False, TRANSPOSE=transpose,
                   num_warps=warps)
        return (q, s), (qt, st)
    amax = torch.zeros(1 if tensorwise else a + b, dtype=torch.int32, device=dev)
    (grid, per_prog, warps), writer = both_config(a, b, _sms(t), t.dtype == torch.float32, target)
    _amax_both(grid, u, amax, a, b, u.stride(0), per_prog,
               BLOCK_A=_BLOCK_A, BLOCK_B=_BLOCK_B, TENSORWISE=tensorwise, num_warps=warps)
    _write_both(u, amax, (qu, su, qut, sut), tensorwise, writer)
    return (q, s), (qt, st)


def _write_both(u, amax, outs, tensorwise: bool, config) -> None:
    grid, per_prog, step, warps = config
    a, b = u.shape
    _tiles_both(grid, u, amax, *outs, a, b, u.stride(0), per_prog,
                BLOCK_A=step, BLOCK_B=_BLOCK_B, TENSORWISE=tensorwise, num_warps=warps)


def fp8_quantize_both_amax(t: torch.Tensor, amax: torch.Tensor) -> tuple[tuple[torch.Tensor, torch.Tensor], ...]:
    """``fp8_quantize_both(t, False)`` bit for bit where t's maxima are taken already: amax (int32, M + K)
    holds |t|'s fp32 bit patterns maxed per row, then per column, as ``_fp8_amax_both_kernel`` leaves
    them (the producers' kernels write it, gated_fp8.py). The both-ways writer alone: one read of t."""
    check_dtypes("fp8_quantize_both", t=t)
    m, k = t.shape
    if not _dense_last(t) or amax.shape != (m + k,) or amax.dtype != torch.int32:
        raise ValueError(f"fp8_quantize_both_amax: t must be 2-D with a dense last dim and amax int32 of {m + k} "
                         f"entries, got t strides {t.stride()}, amax {amax.dtype} {tuple(amax.shape)}")
    dev = t.device
    q, qt = torch.empty((m, k), dtype=E4M3, device=dev), torch.empty((k, m), dtype=E4M3, device=dev)
    s, st = torch.empty((m, 1), dtype=torch.float32, device=dev), torch.empty((k, 1), dtype=torch.float32, device=dev)
    if q.numel() == 0:
        return (q, s.fill_(1.0)), (qt, st.fill_(1.0))
    _, writer = both_config(m, k, _sms(t), t.dtype == torch.float32, target_of(t))
    _write_both(t, amax, (q, s, qt, st), False, writer)
    return (q, s), (qt, st)
