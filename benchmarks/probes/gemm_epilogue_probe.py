"""Would SwiGLU inside the MLP's GEMMs beat cuBLAS + TorchFuser's SwiGLU kernels? A scoping probe.

    python benchmarks/probes/gemm_epilogue_probe.py [--tokens 8192 --hidden 896 --inter 4864] [--out probe.jsonl]

At qwen05b's shapes the SwiGLU kernels take ≈ 3.9 ms of a 63 ms training step (forward 63 µs,
backward 98 µs a layer, at the copy bandwidth), moving bytes that a GEMM epilogue would not: the
forward's read of [gate | up] and the backward's write and read of dh. cuBLAS has no such epilogue,
so the fusion needs a GEMM of our own. This times, on one GPU, with Triton's plain ``tl.dot`` GEMM
(grouped tile order, a few tile configurations, the best one kept):
- the backward: dh = dy·W_down, then [dgate | dup] = swiglu'(gate, up, dh), as cuBLAS + our kernel
  and as one Triton GEMM whose epilogue reads gate and up and writes [dgate | dup];
- the forward: [gate | up] = x·W_gate_upᵀ, then h = silu(gate)·up, as cuBLAS + our kernel and as one
  Triton GEMM with two accumulators (gate and up tiles of the same columns) writing gate, up and h;
- the backward's GEMM alone, Triton against cuBLAS: how far the GEMM itself is from cuBLAS.
A diagnostic for NOTES-triton.md, not library code: its kernels have no edge handling, so the sizes
must be multiples of every tile tried (128, 256 and 64 along K).
"""
from __future__ import annotations

import argparse
import json
import os
import sys

import torch
import triton
import triton.language as tl

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

from torchfuser.backends.triton import gated  # noqa: E402

# (BM, BN, BK, warps, stages)
CONFIGS = [(128, 128, 64, 4, 4), (128, 128, 64, 8, 3), (128, 128, 64, 8, 4), (128, 128, 64, 8, 5), (128, 256, 64, 8, 3),
           (128, 256, 64, 8, 2), (256, 128, 64, 8, 3), (256, 128, 64, 8, 2), (64, 256, 64, 4, 4), (128, 128, 128, 8, 2),
           (128, 64, 64, 4, 4)]


@triton.jit
def _tile_start(M, N, BM: tl.constexpr, BN: tl.constexpr, GROUP: tl.constexpr):
    pid = tl.program_id(0)
    num_m, num_n = tl.cdiv(M, BM), tl.cdiv(N, BN)
    in_group = GROUP * num_n
    first_m = (pid // in_group) * GROUP
    size = min(num_m - first_m, GROUP)
    pm = first_m + (pid % in_group) % size
    pn = (pid % in_group) // size
    return pm * BM + tl.arange(0, BM), pn * BN + tl.arange(0, BN)


@triton.jit
def _mm_swiglu_bwd_kernel(A, B, GU, C, M, N, K, s_am, s_bk, s_gu, s_c,
                          BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr, GROUP: tl.constexpr,
                          EPILOGUE: tl.constexpr):
    # dh = A·B (A: M×K rows of dy, B: K×N = W_down); EPILOGUE: C = [dgate | dup] from GU = [gate | up].
    rm, rn = _tile_start(M, N, BM, BN, GROUP)
    rk = tl.arange(0, BK)
    a_ptr = A + rm[:, None].to(tl.int64) * s_am + rk[None, :]
    b_ptr = B + rk[:, None].to(tl.int64) * s_bk + rn[None, :]
    acc = tl.zeros((BM, BN), dtype=tl.float32)
    for _ in range(0, K, BK):
        acc = tl.dot(tl.load(a_ptr), tl.load(b_ptr), acc)
        a_ptr += BK
        b_ptr += BK * s_bk
    rows, cols = rm[:, None].to(tl.int64), rn[None, :]
    if EPILOGUE:
        dh = acc.to(C.dtype.element_ty).to(tl.float32)  # rounded as cuBLAS's bf16 dh would be
        g = tl.load(GU + rows * s_gu + cols).to(tl.float32)
        u = tl.load(GU + rows * s_gu + N + cols).to(tl.float32)
        s = tl.sigmoid(g)
        tl.store(C + rows * s_c + cols, (dh * u * s * (1 + g * (1 - s))).to(C.dtype.element_ty))
        tl.store(C + rows * s_c + N + cols, (dh * g * s).to(C.dtype.element_ty))
    else:
        tl.store(C + rows * s_c + cols, acc.to(C.dtype.element_ty))


@triton.jit
def _mm_swiglu_fwd_kernel(X, W, GU, H, M, N, K, s_x, s_w, s_gu, s_h,
                          BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr, GROUP: tl.constexpr):
    # gate = X·W[:N]ᵀ, up = X·W[N:]ᵀ for the same columns; GU = [gate | up], H = silu(gate)·up.
    rm, rn = _tile_start(M, N, BM, BN, GROUP)
    rk = tl.arange(0, BK)
    x_ptr = X + rm[:, None].to(tl.int64) * s_x + rk[None, :]
    wg_ptr = W + rn[None, :].to(tl.int64) * s_w + rk[:, None]
    wu_ptr = wg_ptr + N * s_w
    acc_g = tl.zeros((BM, BN), dtype=tl.float32)
    acc_u = tl.zeros((BM, BN), dtype=tl.float32)
    for _ in range(0, K, BK):
        x = tl.load(x_ptr)
        acc_g = tl.dot(x, tl.load(wg_ptr), acc_g)
        acc_u = tl.dot(x, tl.load(wu_ptr), acc_u)
        x_ptr += BK
        wg_ptr += BK
        wu_ptr += BK
    rows, cols = rm[:, None].to(tl.int64), rn[None, :]
    g, u = acc_g.to(GU.dtype.element_ty), acc_u.to(GU.dtype.element_ty)
    tl.store(GU + rows * s_gu + cols, g)
    tl.store(GU + rows * s_gu + N + cols, u)
    gf = g.to(tl.float32)
    tl.store(H + rows * s_h + cols, (gf * tl.sigmoid(gf) * u.to(tl.float32)).to(H.dtype.element_ty))


def grid(m, n, bm, bn):
    return (triton.cdiv(m, bm) * triton.cdiv(n, bn),)


def fused_bwd(dy, w_down, gu, cfg, epilogue=True):
    m, k = dy.shape
    n = w_down.shape[1]
    bm, bn, bk, warps, stages = cfg
    out = torch.empty(m, 2 * n if epilogue else n, device=dy.device, dtype=dy.dtype)
    _mm_swiglu_bwd_kernel[grid(m, n, bm, bn)](dy, w_down, gu, out, m, n, k, dy.stride(0), w_down.stride(0),
                                              gu.stride(0), out.stride(0), BM=bm, BN=bn, BK=bk, GROUP=8,
                                              EPILOGUE=epilogue, num_warps=warps, num_stages=stages)
    return out


def fused_fwd(x, w_gate_up, cfg):
    m, k = x.shape
    n = w_gate_up.shape[0] // 2
    bm, bn, bk, warps, stages = cfg
    gu = torch.empty(m, 2 * n, device=x.device, dtype=x.dtype)
    h = torch.empty(m, n, device=x.device, dtype=x.dtype)
    _mm_swiglu_fwd_kernel[grid(m, n, bm, bn)](x, w_gate_up, gu, h, m, n, k, x.stride(0), w_gate_up.stride(0),
                                              gu.stride(0), h.stride(0), BM=bm, BN=bn, BK=bk, GROUP=8,
                                              num_warps=warps, num_stages=stages)
    return gu, h


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--tokens", type=int, default=8192)
    p.add_argument("--hidden", type=int, default=896)
    p.add_argument("--inter", type=int, default=4864)
    p.add_argument("--backward-only", action="store_true")
    p.add_argument("--out")
    a = p.parse_args()
    from triton.testing import do_bench

    dev, dt, gen = torch.device("cuda"), torch.bfloat16, torch.Generator("cuda").manual_seed(0)
    m, hd, n = a.tokens, a.hidden, a.inter
    if m % 256 or n % 256 or hd % 128:
        raise SystemExit("gemm_epilogue_probe: --tokens and --inter must be multiples of 256, --hidden of 128")
    x = torch.randn(m, hd, device=dev, dtype=dt, generator=gen)
    w_gu = (torch.randn(2 * n, hd, device=dev, generator=gen) * hd**-0.5).to(dt)
    w_down = (torch.randn(hd, n, device=dev, generator=gen) * n**-0.5).to(dt)
    dy = torch.randn(m, hd, device=dev, dtype=dt, generator=gen)
    gu = torch.mm(x, w_gu.t())
    rows = []

    def emit(**row):
        rows.append(row)
        print(json.dumps(row), flush=True)

    def best(name, make, want):
        found = []
        for cfg in CONFIGS:
            try:
                got = make(cfg)
                err = max(float((g.float() - w.float()).abs().max()) for g, w in zip(got, want))
                found.append((do_bench(lambda: make(cfg), rep=200), cfg, err))
            except Exception as e:  # a tile too big for shared memory: skip it
                emit(what=name, config=cfg, error=f"{type(e).__name__}: {str(e)[:120]}")
        for ms, cfg, err in sorted(found)[:3]:
            emit(what=name, config=cfg, ms=round(ms, 4), max_abs_diff=err)

    dh = torch.mm(dy, w_down)
    want_bwd = (gated.swiglu_packed_bwd(dh, gu),)
    emit(what="bwd: cuBLAS dh + swiglu_packed_bwd",
         ms=round(do_bench(lambda: gated.swiglu_packed_bwd(torch.mm(dy, w_down), gu), rep=200), 4))
    emit(what="bwd: cuBLAS dh alone", ms=round(do_bench(lambda: torch.mm(dy, w_down), rep=200), 4),
         tflops=round(2 * m * hd * n / do_bench(lambda: torch.mm(dy, w_down), rep=200) / 1e9, 1))
    best("bwd: Triton GEMM with the SwiGLU-backward epilogue", lambda c: (fused_bwd(dy, w_down, gu, c),), want_bwd)
    best("bwd: Triton GEMM alone", lambda c: (fused_bwd(dy, w_down, gu, c, epilogue=False),), (dh,))

    if a.backward_only:
        return write(rows, a.out)
    want_fwd = (gu, gated.swiglu_packed_fwd(gu))
    emit(what="fwd: cuBLAS gate_up + swiglu_packed_fwd",
         ms=round(do_bench(lambda: gated.swiglu_packed_fwd(torch.mm(x, w_gu.t())), rep=200), 4))
    emit(what="fwd: cuBLAS gate_up alone", ms=round(do_bench(lambda: torch.mm(x, w_gu.t()), rep=200), 4))
    best("fwd: Triton GEMM with the SwiGLU epilogue", lambda c: fused_fwd(x, w_gu, c), want_fwd)
    write(rows, a.out)


def write(rows, path):
    if path:
        with open(path, "w") as f:
            f.writelines(json.dumps(r) + "\n" for r in rows)


if __name__ == "__main__":
    main()
