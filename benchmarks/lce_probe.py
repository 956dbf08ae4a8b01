"""Where linear_cross_entropy's time goes on the GPU: the whole op at several chunk sizes, and each
step of one chunk (logits GEMM, CE kernel, dh GEMM, dW GEMM / accumulation) on its own.

    python benchmarks/lce_probe.py [--tokens 8192 --hidden 2048 --vocab 128256] [--out probe.jsonl]

A diagnostic for NOTES-triton.md, not a target check (ops.py and gpu_check_triton.py are).
"""
from __future__ import annotations

import argparse
import json
import os
import sys

import torch
from triton.testing import do_bench

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from torchfuser.backends.triton import linear_cross_entropy as lce  # noqa: E402


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--tokens", type=int, default=8192)
    p.add_argument("--hidden", type=int, default=2048)
    p.add_argument("--vocab", type=int, default=128256)
    p.add_argument("--rows", default="", help="also: the op with these tokens per chunk, e.g. 1536,2048")
    p.add_argument("--parts", action="store_true", help="also time each step of one chunk")
    p.add_argument("--layouts", default="", help="also: each GEMM with the logits as C×V and as V×C, with "
                   "cuBLAS and cuBLASLt, at these tokens per chunk, e.g. 1536,8192")
    p.add_argument("--overlap", default="", help="also: the op on two streams with two logits buffers of "
                   "these tokens each (the CE kernel of one chunk beside the GEMMs of the other), e.g. 768,1024")
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

    for rows in (1408, 2048, 4096, 8192) if a.parts else ():
        hc = h[:rows]
        z = torch.mm(hc, w.t())
        dw = torch.empty_like(w)
        dh = torch.empty(rows, hdim, device="cuda", dtype=dt)
        losses = torch.empty(rows, device="cuda")
        nvalid = torch.tensor(n, device="cuda")

        def ce_kernel():
            lce.ce_rows(z, None, labels[:rows], losses, nvalid, -100, None, True, True)

        steps = {
            "CE kernel": ce_kernel,
            "logits mm": lambda: torch.mm(hc, w.t()),
            "dh mm": lambda: torch.mm(z, w, out=dh),
            "dW mm": lambda: torch.mm(z.t(), hc, out=dw),
            "dW addmm_": lambda: dw.addmm_(z.t(), hc),
        }
        for name, fn in steps.items():
            ms = do_bench(fn, rep=200)
            flops = 0 if name == "CE kernel" else 2 * rows * hdim * v
            emit(what=name, rows=rows, ms=round(ms, 3), tflops=round(flops / ms / 1e9, 1),
                 gbps=round(3 * rows * v * 2 / ms / 1e6, 1),
                 ms_per_8192_tokens=round(ms * n / rows, 3))
        z = dw = dh = None  # free before the next size
        torch.cuda.empty_cache()
    if a.plans:
        plans(h, w, labels, emit)
    if a.dw_fp32:
        dw_fp32(h, w, emit)
    for rows in map(int, filter(None, a.layouts.split(","))):
        layouts(h, w, rows, emit)
    for rows in map(int, filter(None, a.overlap.split(","))):
        fn = lambda: two_streams(h, w, labels, rows)  # noqa: E731
        out, extra = extra_peak(fn)
        ref = lce.linear_cross_entropy_fwd(h, w, None, labels, -100, None, "mean", True)
        err = [float((x.float() - y.float()).abs().max()) for x, y in zip(out[:3], ref[:3])]
        del out, ref
        emit(what="op on two streams", rows=rows, ms=round(do_bench(fn, rep=300), 3), extra_gib=round(extra, 3),
             max_abs_diff_loss_dh_dw=err)
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


def two_streams(h, w, labels, rows):
    """The op (no bias, no softcap, mean) with two logits buffers on two streams: chunk i runs on
    stream i % 2 in buffer i % 2, so one chunk's CE kernel can run beside the other's GEMMs. dW's
    read-modify-writes stay in chunk order (events); dh slices are disjoint."""
    n, v = h.shape[0], w.shape[0]
    main = torch.cuda.current_stream()
    streams = (torch.cuda.Stream(), torch.cuda.Stream())
    losses = torch.empty(n, device=h.device)
    nvalid = (labels != -100).sum()
    dh, dw = torch.empty_like(h), torch.empty_like(w)
    bufs = [torch.empty(rows, v, device=h.device, dtype=h.dtype) for _ in range(2)]
    done_dw = None
    for s in streams:
        s.wait_stream(main)
    for i, start in enumerate(range(0, n, rows)):
        s, z = streams[i % 2], bufs[i % 2]
        with torch.cuda.stream(s):
            hc = h[start:start + rows]
            z = z[:hc.shape[0]]
            torch.mm(hc, w.t(), out=z)
            lce.ce_rows(z, None, labels[start:start + rows], losses[start:start + rows], nvalid, -100, None, True, True)
            torch.mm(z, w, out=dh[start:start + rows])
            if done_dw is not None:
                s.wait_event(done_dw)
            if start == 0:
                torch.mm(z.t(), hc, out=dw)
            else:
                dw.addmm_(z.t(), hc)
            done_dw = torch.cuda.Event()
            done_dw.record(s)
    for s in streams:
        main.wait_stream(s)
    for b in bufs:
        b.record_stream(main)
    return losses.sum() / nvalid, dh, dw


if __name__ == "__main__":
    main()
