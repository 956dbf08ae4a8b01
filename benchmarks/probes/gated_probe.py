"""SwiGLU's kernels at 8192×8192 bf16 under launch configurations and indexing variants, against
torch.compile's kernel for the same math, each replayed from a CUDA graph (kernel time, no host).
A diagnostic for NOTES-triton.md: the config rule in backends/triton/gated.py comes from here.

    python benchmarks/probes/gated_probe.py [--out probe.jsonl]
"""
from __future__ import annotations

import argparse
import json
import os
import sys

import torch
import triton
import triton.language as tl
from triton.testing import do_bench

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

from torchfuser.backends.reference import gated as ref  # noqa: E402
from torchfuser.backends.triton import gated  # noqa: E402


@triton.jit
def _flat_fwd(G, U, Y, N, BLOCK: tl.constexpr, EVEN: tl.constexpr, I64: tl.constexpr):
    pid = tl.program_id(0)
    if I64:
        pid = pid.to(tl.int64)
    offs = pid * BLOCK + tl.arange(0, BLOCK)
    if EVEN:
        g = tl.load(G + offs).to(tl.float32)
        u = tl.load(U + offs).to(tl.float32)
    else:
        g = tl.load(G + offs, mask=offs < N, other=0.0).to(tl.float32)
        u = tl.load(U + offs, mask=offs < N, other=0.0).to(tl.float32)
    y = (g * tl.sigmoid(g) * u).to(Y.dtype.element_ty)
    if EVEN:
        tl.store(Y + offs, y)
    else:
        tl.store(Y + offs, y, mask=offs < N)


@triton.jit
def _flat_bwd(DY, G, U, DG, DU, N, BLOCK: tl.constexpr, EVEN: tl.constexpr, I64: tl.constexpr):
    pid = tl.program_id(0)
    if I64:
        pid = pid.to(tl.int64)
    offs = pid * BLOCK + tl.arange(0, BLOCK)
    m = offs < N
    if EVEN:
        dy = tl.load(DY + offs).to(tl.float32)
        g = tl.load(G + offs).to(tl.float32)
        u = tl.load(U + offs).to(tl.float32)
    else:
        dy = tl.load(DY + offs, mask=m, other=0.0).to(tl.float32)
        g = tl.load(G + offs, mask=m, other=0.0).to(tl.float32)
        u = tl.load(U + offs, mask=m, other=0.0).to(tl.float32)
    s = tl.sigmoid(g)
    dg = (dy * u * s * (1.0 + g * (1.0 - s))).to(DG.dtype.element_ty)
    du = (dy * g * s).to(DU.dtype.element_ty)
    if EVEN:
        tl.store(DG + offs, dg)
        tl.store(DU + offs, du)
    else:
        tl.store(DG + offs, dg, mask=m)
        tl.store(DU + offs, du, mask=m)


def graphed_ms(fn) -> float:
    fn()
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        for _ in range(10):
            fn()
    return do_bench(g.replay, warmup=25, rep=200, return_mode="median") / 10


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", default=None)
    a = p.parse_args()
    m, n = 8192, 8192
    g, u, dy = (torch.randn(m, n, device="cuda", dtype=torch.bfloat16) for _ in range(3))
    y, dg, du = (torch.empty_like(g) for _ in range(3))
    numel = g.numel()
    rows = []

    def emit(**row):
        rows.append(row)
        print(json.dumps(row), flush=True)

    cf = torch.compile(lambda g, u: ref.swiglu(g, u))
    emit(what="compile fwd", ms=round(graphed_ms(lambda: cf(g, u)), 4))
    gq, uq = g.clone().requires_grad_(), u.clone().requires_grad_()
    cfb = torch.compile(lambda g, u, dy: torch.autograd.grad(ref.swiglu(g, u), (g, u), dy))
    emit(what="compile fwd+bwd", ms=round(graphed_ms(lambda: cfb(gq, uq, dy)), 4))
    emit(what="ours fwd (rule)", ms=round(graphed_ms(lambda: gated.swiglu_fwd(g, u)), 4))
    emit(what="ours bwd (rule)", ms=round(graphed_ms(lambda: gated.swiglu_bwd(dy, g, u)), 4))
    for block in (1024, 2048, 4096):
        for warps in (4, 8):
            for even, i64 in ((True, False), (False, False), (False, True)):
                grid = (triton.cdiv(numel, block),)
                f = lambda: _flat_fwd[grid](g, u, y, numel, BLOCK=block, EVEN=even, I64=i64, num_warps=warps)  # noqa: E731
                b = lambda: _flat_bwd[grid](dy, g, u, dg, du, numel, BLOCK=block, EVEN=even, I64=i64, num_warps=warps)  # noqa: E731
                f()
                b()
                ok = bool(torch.equal(y, gated.swiglu_fwd(g, u)))
                ok &= all(bool(torch.equal(x, r)) for x, r in zip((dg, du), gated.swiglu_bwd(dy, g, u)))
                emit(what="flat", block=block, same_bits_as_ours=ok, warps=warps, even=even, i64=i64,
                     fwd_ms=round(graphed_ms(f), 4), bwd_ms=round(graphed_ms(b), 4))
    if a.out:
        with open(a.out, "w") as fh:
            fh.writelines(json.dumps(r) + "\n" for r in rows)


if __name__ == "__main__":
    main()
