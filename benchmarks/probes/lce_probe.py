"""Where linear_cross_entropy's time goes on the GPU: the whole op at several chunk sizes, and each
step of one chunk (logits GEMM, CE kernel, dh GEMM, dW GEMM / accumulation) on its own.

    python benchmarks/probes/lce_probe.py [--tokens 8192 --hidden 2048 --vocab 128256] [--out probe.jsonl]

A diagnostic for NOTES-triton.md, not a target check (ops.py and gpu_check_triton.py are).
"""
from __future__ import annotations

import argparse
import json
import os
import sys

import torch
from triton.testing import do_bench

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

from torchfuser.backends.triton import linear_cross_entropy as lce  # noqa: E402


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--tokens", type=int, default=8192)
    p.add_argument("--hidden", type=int, default=2048)
    p.add_argument("--vocab", type=int, default=128256)
    p.add_argument("--rows", default="", help="also: the op with these tokens per chunk, e.g. 1536,2048")
    p.add_argument("--parts", default="", help="also time each step of one chunk of these tokens, e.g. 1536,2048")
    p.add_argument("--layouts", default="", help="also: each GEMM with the logits as C×V and as V×C, with "
                   "cuBLAS and cuBLASLt, at these tokens per chunk, e.g. 1536,8192")
    p.add_argument("--plans", action="store_true", help="also: balanced chunks against a fixed stride")
    p.add_argument("--dw-fp32", action="store_true", help="also: dW summed over the op's chunks in bf16 and "
                   "then cast to fp32 (autocast's gradient of an fp32 weight), against summed in fp32 by cuBLAS")
    p.add_argument("--out", default=None)
    a = p.parse_args()
    n, hdim, v, dt = a.tokens, a.hidden, a.vocab, torch.bfloat16
    h = torch.randn(n, hdim, device="cuda", dtype=dt)
    w = (torch.randn(v, hdim, device="cuda") * hdim**-0.5).to(dt)
    labels = torch.randint(0, v, (n,), device="cuda")
    rows_out = []

    def emit(**row):
        rows_out.append(row)
        print(json.dumps(row), flush=True)

    rule = lce.chunk_rows
    cases = [rule] + [lambda *_, r=r: r for r in map(int, filter(None, a.rows.split(",")))]
    for lce.chunk_rows in cases:  # the op's own rule, then each forced chunk size
        rows = lce.chunk_rows(n, v, 2, (n + v) * hdim * 2)
        fn = lambda: lce.linear_cross_entropy_fwd(h, w, None, labels, -100, None, "mean", True)  # noqa: E731
        extra = extra_peak(fn)[1]  # the outputs are dropped before the timing
        emit(what="op fwd+bwd", rule=lce.chunk_rows is rule, rows=rows, ms=round(do_bench(fn, rep=300), 3),
             extra_gib=round(extra, 3))
    lce.chunk_rows = rule

    for rows in map(int, filter(None, a.parts.split(","))):
        hc = h[:rows]
        z = torch.mm(hc, w.t())
        dw = torch.empty_like(w)
        dh, hs, g = torch.empty_like(hc), torch.empty_like(hc), lce._times_w(z, w)
        losses = torch.empty(rows, device="cuda")
        nvalid = torch.tensor(n, device="cuda")
        row_scale = torch.empty(rows, device="cuda")

        def ce_kernel():
            lce.ce_rows(z, None, labels[:rows], losses, row_scale, nvalid, -100, None, True, True)

        steps = {
            "CE kernel": ce_kernel,
            "logits mm": lambda: torch.mm(hc, w.t()),
            "dh mm (fp32 out)": lambda: lce._times_w(z, w),
            "dh mm (bf16 out)": lambda: torch.mm(z, w, out=dh),
            "dW mm": lambda: torch.mm(z.t(), hc, out=dw),
            "dW addmm_": lambda: dw.addmm_(z.t(), hc),
            "row scale": lambda: lce._row_scale((rows, lce.cdiv(hdim, 4096)), g, hdim, hc, hdim, row_scale, dh, hdim,
                                                hs, hdim, BLOCK_H=min(4096, lce.next_pow2(hdim)), num_warps=4),
        }
        for name, fn in steps.items():
            ms = do_bench(fn, rep=200)
            flops = 0 if name in ("CE kernel", "row scale") else 2 * rows * hdim * v
            emit(what=name, rows=rows, ms=round(ms, 3), tflops=round(flops / ms / 1e9, 1),
                 gbps=round(2 * rows * v * 2 / ms / 1e6, 1),
                 ms_per_8192_tokens=round(ms * n / rows, 3))
        z = dw = dh = hs = g = None  # free before the next size
        torch.cuda.empty_cache()
    if a.plans:
        plans(h, w, labels, emit)
    if a.dw_fp32:
        dw_fp32(h, w, emit)
    for rows in map(int, filter(None, a.layouts.split(","))):
        layouts(h, w, rows, emit)
    if a.out:
        with open(a.out, "w") as f:
            f.writelines(json.dumps(r) + "\n" for r in rows_out)


def extra_peak(fn):
    """fn()'s outputs and the GiB its call adds to the peak (after a warm-up call)."""
    fn()
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated()
    out = fn()
    torch.cuda.synchronize()
    return out, (torch.cuda.max_memory_allocated() - base) / 2**30


def plans(h, w, labels, emit):
    """The op with its chunk plan (sizes as even as multiples of 512 make them) against chunks of
    the same most rows and a short last one, in one run."""
    n, v = h.shape[0], w.shape[0]
    op = lambda: lce.linear_cross_entropy_fwd(h, w, None, labels, -100, None, "mean", True)  # noqa: E731
    balanced = lce.chunks
    most = lce.chunk_rows(n, v, h.element_size(), (n + v) * h.shape[1] * h.element_size())
    strided = lambda n, most: [(s, min(most, n - s)) for s in range(0, n, most)]  # noqa: E731
    for _ in range(2):
        for name, plan in (("balanced", balanced), ("fixed stride", strided)):
            lce.chunks = plan
            emit(what="op fwd+bwd, chunk plan", plan=name, sizes=[size for _, size in plan(n, most)],
                 ms=round(do_bench(op, rep=300), 3))
    lce.chunks = balanced


def dw_fp32(h, w, emit):
    """The dW products of the op's chunk plan, in two ways: bf16 sums then one cast to fp32, and an
    fp32 sum written by cuBLAS (``out_dtype``, in place with ``out=``); their error against float64."""
    n, v = h.shape[0], w.shape[0]
    plan = lce.chunks(n, lce.chunk_rows(n, v, h.element_size(), (n + v) * h.shape[1] * h.element_size()))
    z = torch.randn(plan[0][1], v, device="cuda", dtype=h.dtype) * 1e-4  # one chunk's dl, reused

    def bf16_then_cast():
        dw = torch.empty_like(w)
        for i, (start, size) in enumerate(plan):
            hc = h[start:start + size]
            torch.mm(z[:size].t(), hc, out=dw) if i == 0 else dw.addmm_(z[:size].t(), hc)
        return dw.float()

    def fp32_sum():
        dw = torch.empty(w.shape, device="cuda", dtype=torch.float32)
        for i, (start, size) in enumerate(plan):
            hc = h[start:start + size]
            if i == 0:
                torch.mm(z[:size].t(), hc, out_dtype=torch.float32, out=dw)
            else:
                torch.addmm(dw, z[:size].t(), hc, out_dtype=torch.float32, out=dw)
        return dw

    want = sum(z[:size].double().t() @ h[start:start + size].double() for start, size in plan)
    for name, fn in (("bf16 sums, then cast", bf16_then_cast), ("fp32 sum", fp32_sum)) * 2:
        err = float((fn().double() - want).abs().max())
        emit(what="dW over the chunks", how=name, chunks=[size for _, size in plan],
             ms=round(do_bench(fn, rep=200), 3), max_abs_err=err, extra_gib=round(extra_peak(fn)[1], 3))


def layouts(h, w, rows, emit):
    """The three GEMMs of one chunk with the logits stored as C×V (what the op does) and as V×C
    (the same products, transposed: cuBLAS picks other kernels), under both BLAS libraries."""
    n, v = h.shape[0], w.shape[0]
    hc = h[:rows]
    z = torch.mm(hc, w.t())  # C×V
    zt = torch.mm(w, hc.t())  # V×C
    dh = torch.empty_like(hc)
    dw = torch.mm(z.t(), hc)
    steps = {
        ("logits", "CxV"): lambda: torch.mm(hc, w.t(), out=z),
        ("logits", "VxC"): lambda: torch.mm(w, hc.t(), out=zt),
        ("dh", "CxV"): lambda: torch.mm(z, w, out=dh),
        ("dh", "VxC"): lambda: torch.mm(zt.t(), w, out=dh),
        ("dW addmm_", "CxV"): lambda: dw.addmm_(z.t(), hc),
        ("dW addmm_", "VxC"): lambda: dw.addmm_(zt, hc),
    }
    before = torch.backends.cuda.preferred_blas_library()
    for lib in ("cublas", "cublaslt"):
        torch.backends.cuda.preferred_blas_library(lib)
        for (step, layout), fn in steps.items():
            ms = do_bench(fn, rep=200)
            emit(what=f"{step} mm", layout=layout, blas=lib, rows=rows, ms=round(ms, 3),
                 tflops=round(2 * rows * h.shape[1] * v / ms / 1e9, 1), ms_per_8192_tokens=round(ms * n / rows, 3))
    torch.backends.cuda.preferred_blas_library(before)


if __name__ == "__main__":
    main()
