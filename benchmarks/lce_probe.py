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
        fn()
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        base = torch.cuda.memory_allocated()
        out = fn()
        torch.cuda.synchronize()
        extra = (torch.cuda.max_memory_allocated() - base) / 2**30
        del out
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
            lce._linear_cross_entropy_fwd_kernel[(rows,)](
                z, z.stride(0), w, labels[:rows], losses, nvalid, v, -100, 1.0, HAS_BIAS=False, SOFTCAP=False,
                NEED_GRAD=True, MEAN=True, BLOCK_V=lce._BLOCK_V, num_warps=lce._WARPS)

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
        del z, dw, dh
        torch.cuda.empty_cache()
    if a.out:
        with open(a.out, "w") as f:
            f.writelines(json.dumps(r) + "\n" for r in rows_out)


if __name__ == "__main__":
    main()
