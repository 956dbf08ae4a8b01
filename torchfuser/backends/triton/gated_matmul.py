"""A gated MLP's down-projection input gradient and SwiGLU's backward as one Triton GEMM.

    dh    = dy · W                                    (dy: M×K, W: K×N; fp32 accumulation,
                                                       rounded to dy's dtype, as cuBLAS writes it)
    dgate = dh · up · σ(g)·(1 + g·(1 − σ(g))),  dup = dh · g·σ(g)      (g = gate; fp32 math)
Output: the packed [dgate | dup] (M×2N) that ``swiglu_packed_bwd`` writes; nothing is saved.

Each program computes one BM×BN tile of dh and, in the epilogue, reads the matching gate and up
tiles and writes dgate and dup: dh itself (M×N) is never written or read back. On an H200 at
qwen05b's MLP (8192×896 · 896×4864, bf16; benchmarks/gemm_epilogue_probe.py, NOTES-triton.md):
0.189 ms against 0.210 ms for cuBLAS's dh and then ``swiglu_packed_bwd``, though this GEMM alone
is 9 % slower than cuBLAS's. fp32 inputs are left to the two-step path (Triton's fp32 dot would
round its operands to TF32).
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from ._common import Launcher, cdiv, check_dtypes, next_pow2, rows_of
from .gated import _silu, swiglu_packed_bwd

_GROUP = 8  # tiles of 8 row blocks walk the columns together: W's and dy's tiles stay in L2


@triton.jit
def _swiglu_packed_matmul_bwd_kernel(
    DY, W, GU, D, M, N, K, s_dy, s_w, s_gu,
    BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr, GROUP: tl.constexpr, EVEN_K: tl.constexpr,
):
    pid = tl.program_id(0)
    num_m, num_n = tl.cdiv(M, BM), tl.cdiv(N, BN)
    in_group = GROUP * num_n
    first_m = (pid // in_group) * GROUP
    size = tl.minimum(num_m - first_m, GROUP)
    pm = first_m + (pid % in_group) % size
    pn = (pid % in_group) // size
    rm, rn, rk = pm * BM + tl.arange(0, BM), pn * BN + tl.arange(0, BN), tl.arange(0, BK)
    # Rows and columns past the edge read a valid row or column again (modulo) and are not stored:
    # no masks in the main loop but for a K that is not a multiple of BK.
    a_ptr = DY + (rm % M)[:, None].to(tl.int64) * s_dy + rk[None, :]
    b_ptr = W + rk[:, None].to(tl.int64) * s_w + (rn % N)[None, :]
    acc = tl.zeros((BM, BN), dtype=tl.float32)
    for k in range(0, K, BK):
        if EVEN_K:
            a, b = tl.load(a_ptr), tl.load(b_ptr)
        else:
            a = tl.load(a_ptr, mask=(k + rk < K)[None, :], other=0.0)
            b = tl.load(b_ptr, mask=(k + rk < K)[:, None], other=0.0)
        acc = tl.dot(a, b, acc)
        a_ptr += BK
        b_ptr += BK * s_w
    dh = acc.to(DY.dtype.element_ty).to(tl.float32)
    rows, cols = rm[:, None].to(tl.int64), rn[None, :]
    mask = (rm < M)[:, None] & (rn < N)[None, :]
    g = tl.load(GU + rows * s_gu + cols, mask=mask, other=0.0).to(tl.float32)
    u = tl.load(GU + rows * s_gu + N + cols, mask=mask, other=0.0).to(tl.float32)
    a, da = _silu(g)
    tl.store(D + rows * (2 * N) + cols, (dh * u * da).to(D.dtype.element_ty), mask=mask)
    tl.store(D + rows * (2 * N) + N + cols, (dh * a).to(D.dtype.element_ty), mask=mask)


_launch = Launcher(_swiglu_packed_matmul_bwd_kernel)


def _tile(n: int, most: int) -> int:
    return max(16, min(most, next_pow2(n)))  # tl.dot takes dims of 16 and more


def swiglu_packed_matmul_bwd(dy: torch.Tensor, weight: torch.Tensor, gate_up: torch.Tensor) -> torch.Tensor:
    """``swiglu_packed_bwd(dy @ weight, gate_up)``: dy M×K, weight K×N, gate_up M×2N → M×2N."""
    check_dtypes("swiglu_packed_matmul_bwd", dy=dy, weight=weight, gate_up=gate_up)
    m, k = dy.shape
    n = weight.shape[1]
    if dy.dtype == torch.float32 or weight.dtype != dy.dtype or m == 0 or n == 0 or k == 0:
        return swiglu_packed_bwd(torch.mm(dy, weight), gate_up)
    dy, _, s_dy = rows_of(dy, k)
    gate_up, _, s_gu = rows_of(gate_up, 2 * n)
    weight = weight if weight.stride(1) == 1 else weight.contiguous()
    out = torch.empty((m, 2 * n), dtype=gate_up.dtype, device=gate_up.device)
    bm, bn, bk = _tile(m, 128), _tile(n, 128), _tile(k, 64)
    _launch((cdiv(m, bm) * cdiv(n, bn),), dy, weight, gate_up, out, m, n, k, s_dy, weight.stride(0), s_gu,
            BM=bm, BN=bn, BK=bk, GROUP=_GROUP, EVEN_K=k % bk == 0, num_warps=8 if bm * bn >= 128 * 128 else 4,
            num_stages=3)
    return out
