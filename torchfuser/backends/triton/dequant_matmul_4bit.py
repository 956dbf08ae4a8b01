"""A GEMM that dequantises its 4-bit weight operand tile by tile (NF4 / FP4, bitsandbytes' and torchao's layout):
QLoRA's base products without the transient dequantised weight.

Ŵ [rows × cols] is held as packed bytes P (two codes a byte over the row-major flattened weight, the first
element in the high nibble), a 16-entry fp32 code table C and one fp32 scale per ``blocksize`` elements:

    Ŵ[r, c] = wd(C[nibble(P, e)] · absmax[e // blocksize]),   e = r·cols + c

rounded once to ``wd`` (the weight's dtype: the values ``dequantize_4bit`` writes, bit for bit). Then

    forward  (TRANS_W):     y[m, r]  = Σ_c x[m, c] · Ŵ[r, c]      (x·Ŵᵀ, the base's output)
    backward (not TRANS_W): dx[m, c] = Σ_r dy[m, r] · Ŵ[r, c]     (dy·Ŵ, the input's gradient)

accumulated in fp32 by ``tl.dot`` (IEEE fp32 products for fp32 operands, no TF32), stored in the output dtype.
Only the summation order differs from dequantise-then-cuBLAS. Nothing is saved (the base is frozen).

Each program owns a [BLOCK_M × BLOCK_N] output tile and walks the reduction in BLOCK_K steps; each element of
the [BLOCK_K × BLOCK_N] weight tile gathers its byte (each byte read twice, the second time from L1), its
nibble, its code value and its block's scale (the code table is 64 bytes, the scales one per 64 elements:
both through L1). Decoding a tile of bytes once and interleaving the nibbles (join + reshape, + trans for the
forward) crashed Triton 3.6's TritonGPUOptimizeDotOperands pass for sm_90, so the gather it is. Programs are
grouped along M (GROUP_M) so consecutive programs share weight tiles in L2.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from ._common import Launcher, cdiv, target_of, warps_as_threads

# (BLOCK_M, BLOCK_N, BLOCK_K, warps on NVIDIA): 16-bit operands, and fp32 (IEEE products: smaller tiles, else spills)
_TILES = {2: (128, 128, 32, 8), 4: (32, 64, 16, 4)}
_GROUP_M = 8
_STAGES = {"cuda": 3, "hip": 2}  # AMD: its 64 KiB LDS


@triton.jit
def _weight_tile(P, ABSMAX, CODE, k0, n0, rows, cols, blocksize, TRANS_W: tl.constexpr, WD: tl.constexpr,
                 BK: tl.constexpr, BN: tl.constexpr):
    """B[k0:k0+BK, n0:n0+BN] in WD, B = Ŵᵀ (TRANS_W) or Ŵ (zeros outside the weight)."""
    k = k0 + tl.arange(0, BK)  # int32 offsets: the launcher checks the weight has < 2³¹ elements (registers)
    n = n0 + tl.arange(0, BN)
    if TRANS_W:  # B[k, n] = Ŵ[n, k]
        e = n[None, :] * cols + k[:, None]
        m = (n[None, :] < rows) & (k[:, None] < cols)
    else:  # B[k, n] = Ŵ[k, n]
        e = k[:, None] * cols + n[None, :]
        m = (k[:, None] < rows) & (n[None, :] < cols)
    byte = tl.load(P + e // 2, mask=m, other=0).to(tl.int32)  # each byte read for both its codes (L1)
    nibble = tl.where((e % 2) == 0, byte >> 4, byte & 15)
    scale = tl.load(ABSMAX + e // blocksize, mask=m, other=0.0)
    return (tl.load(CODE + nibble) * scale).to(WD)


@triton.jit
def _dequant_matmul_4bit_kernel(A, P, ABSMAX, CODE, OUT, M, N, K, stride_am, stride_om, rows, cols, blocksize,
                                TRANS_W: tl.constexpr, IEEE: tl.constexpr, BLOCK_M: tl.constexpr,
                                BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr):
    pid = tl.program_id(0)
    grid_m, grid_n = tl.cdiv(M, BLOCK_M), tl.cdiv(N, BLOCK_N)
    group = pid // (GROUP_M * grid_n)
    first_m = group * GROUP_M
    size_m = tl.minimum(grid_m - first_m, GROUP_M)
    pid_m = first_m + (pid % (GROUP_M * grid_n)) % size_m
    pid_n = (pid % (GROUP_M * grid_n)) // size_m
    m = pid_m.to(tl.int64) * BLOCK_M + tl.arange(0, BLOCK_M).to(tl.int64)
    n0 = pid_n * BLOCK_N
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    WD = OUT.dtype.element_ty
    for k0 in range(0, K, BLOCK_K):
        k = k0 + tl.arange(0, BLOCK_K)
        a = tl.load(A + m[:, None] * stride_am + k[None, :], mask=(m[:, None] < M) & (k[None, :] < K), other=0.0)
        b = _weight_tile(P, ABSMAX, CODE, k0, n0, rows, cols, blocksize, TRANS_W, WD, BLOCK_K, BLOCK_N)
        if IEEE:
            acc = tl.dot(a, b.to(a.dtype), acc, input_precision="ieee")
        else:
            acc = tl.dot(a, b.to(a.dtype), acc)
    n = n0 + tl.arange(0, BLOCK_N).to(tl.int64)
    tl.store(OUT + m[:, None] * stride_om + n[None, :], acc.to(OUT.dtype.element_ty),
             mask=(m[:, None] < M) & (n[None, :] < N))


_launch = Launcher(_dequant_matmul_4bit_kernel)


def _run(a: torch.Tensor, packed, absmax, code, blocksize, rows, cols, w_dtype, trans: bool) -> torch.Tensor:
    if cols % 2 or blocksize % 2:
        raise ValueError(f"dequant_matmul_4bit: the weight's columns ({cols}) and block size ({blocksize}) must be "
                         "even (a byte's two codes in one row and one block); use dequantize_4bit then a GEMM")
    if rows * cols >= 2 ** 31:
        raise ValueError(f"dequant_matmul_4bit: a weight of {rows} × {cols} elements (2³¹ or more; int32 offsets)")
    if a.dtype != w_dtype:
        raise TypeError(f"dequant_matmul_4bit: operand {a.dtype} and weight {w_dtype} differ (cast one first)")
    k_dim, n_dim = (cols, rows) if trans else (rows, cols)
    if a.shape[-1] != k_dim:
        raise ValueError(f"dequant_matmul_4bit: operand's last dim {a.shape[-1]} is not the weight's {k_dim}")
    a2 = a.reshape(-1, k_dim)
    if a2.stride(-1) != 1:
        a2 = a2.contiguous()
    M = a2.shape[0]
    out = torch.empty((M, n_dim), dtype=w_dtype, device=a.device)
    if M and n_dim:
        if not k_dim:
            return out.zero_().reshape(*a.shape[:-1], n_dim)
        bm, bn, bk, warps = _TILES[w_dtype.itemsize]
        grid, target = (cdiv(M, bm) * cdiv(n_dim, bn),), target_of(a2)
        _launch(grid, a2, packed.reshape(-1).view(torch.uint8), absmax.float().contiguous(),
                code.float().contiguous(), out, M, n_dim, k_dim, a2.stride(0), out.stride(0), rows, cols, blocksize,
                TRANS_W=trans, IEEE=w_dtype == torch.float32, BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=bk, GROUP_M=_GROUP_M,
                num_warps=warps_as_threads(warps, target), num_stages=_STAGES.get(target.backend, 1))
    return out.reshape(*a.shape[:-1], n_dim)


def dequant_matmul_4bit_fwd(x: torch.Tensor, packed: torch.Tensor, absmax: torch.Tensor, code: torch.Tensor,
                            blocksize: int, rows: int, cols: int, w_dtype: torch.dtype) -> torch.Tensor:
    """x [..., cols] · Ŵᵀ → [..., rows] in ``w_dtype`` (x's dtype must be it)."""
    return _run(x, packed, absmax, code, blocksize, rows, cols, w_dtype, True)


def dequant_matmul_4bit_bwd(dy: torch.Tensor, packed: torch.Tensor, absmax: torch.Tensor, code: torch.Tensor,
                            blocksize: int, rows: int, cols: int, w_dtype: torch.dtype) -> torch.Tensor:
    """dy [..., rows] · Ŵ → [..., cols] in ``w_dtype`` (the input's gradient)."""
    return _run(dy, packed, absmax, code, blocksize, rows, cols, w_dtype, False)
