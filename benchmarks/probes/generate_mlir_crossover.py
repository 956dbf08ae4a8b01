"""Per-call host cost of the MLIR backend's forward kernels against the reference backend's, by row count
(thread CPU time, one thread, median of 3 × N calls): where a call is so small that the MLIR kernel's fixed
call cost (argument packing, the ExecutionEngine's call) is more than the reference kernel's whole work. It
set ``ops._call.MLIR_SMALL`` (no-grad calls of at most that many elements run the reference kernel).

    PYTHONPATH=. python benchmarks/probes/generate_mlir_crossover.py [--hidden 128] [--inter 352]
"""
from __future__ import annotations

import argparse
import json
import statistics
import time

import torch

from torchfuser.backends import kernel


def _per_call_us(fn, n: int) -> float:
    fn()
    t0 = time.thread_time()
    for _ in range(n):
        fn()
    return (time.thread_time() - t0) / n * 1e6


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--hidden", type=int, default=128)
    parser.add_argument("--inter", type=int, default=352)
    parser.add_argument("--heads", type=int, default=4)
    parser.add_argument("--head-dim", type=int, default=32)
    parser.add_argument("--rows", type=int, nargs="+", default=[1, 8, 32, 128, 512, 2048])
    parser.add_argument("--calls", type=int, default=300)
    args = parser.parse_args()
    torch.set_num_threads(1)
    h, d = args.hidden, args.head_dim
    for rows in args.rows:
        x, r, w = torch.randn(rows, h), torch.randn(rows, h), torch.randn(h)
        g, u = torch.randn(rows, args.inter), torch.randn(rows, args.inter)
        q, k = torch.randn(rows, args.heads, 1, d), torch.randn(rows, max(1, args.heads // 2), 1, d)
        cos, sin = torch.randn(rows, 1, d), torch.randn(rows, 1, d)
        cases = {"rms_norm_fwd": (x, w, 1e-6, 0.0), "add_rms_norm_fwd": (x, r, w, 1e-6, 0.0),
                 "swiglu_fwd": (g, u), "rope_fwd": (q, k, cos, sin)}
        for name, call in cases.items():
            ref, mlir = kernel("reference", name), kernel("mlir", name)
            tr, tm = [], []
            for _ in range(3):  # interleaved
                tr.append(_per_call_us(lambda: ref(*call), args.calls))
                tm.append(_per_call_us(lambda: mlir(*call), args.calls))
            print(json.dumps(dict(probe="generate_mlir_crossover", op=name, rows=rows, elements=call[0].numel(),
                                  reference_us=round(statistics.median(tr), 1), mlir_us=round(statistics.median(tm), 1))))


if __name__ == "__main__":
    main()
