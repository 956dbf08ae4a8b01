"""CPU: the pointwise chain silu(x)·y + 0.5·sin(b), forward + backward, 4096×4096 fp32.

torchfuser.jit (MLIR regions) vs eager vs torch.compile (Inductor), in one process.
Writes benchmarks/results/archive/compiler-cpu-<date>.json (move it to latest/ when the docs cite it).

    python benchmarks/compiler_cpu.py [--n 4096] [--iters 10] [--out PATH]
"""
from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import statistics
import time
from pathlib import Path

import torch
import torch.nn.functional as F

import torchfuser


def chain(x, y, b):
    return F.silu(x) * y + 0.5 * torch.sin(b)


def step(fn, x, y, b, g):
    out = fn(x, y, b)
    out.backward(g)
    for t in (x, y, b):
        t.grad = None


def bench(fn, args, iters: int, warmup: int = 2) -> dict:
    t0 = time.perf_counter()
    step(fn, *args)  # the first call compiles
    first = time.perf_counter() - t0
    for _ in range(warmup):
        step(fn, *args)
    times = []
    for _ in range(iters):
        t0 = time.perf_counter()
        step(fn, *args)
        times.append(time.perf_counter() - t0)
    return {"median_ms": 1e3 * statistics.median(times), "min_ms": 1e3 * min(times), "first_call_s": first}


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--n", type=int, default=4096)
    ap.add_argument("--iters", type=int, default=10)
    ap.add_argument("--out", default=None, help="JSON path (default results/archive/compiler-cpu-<date>.json)")
    a = ap.parse_args()
    torch.manual_seed(0)
    args = [torch.randn(a.n, a.n, requires_grad=True) for _ in range(3)] + [torch.randn(a.n, a.n)]

    jitted = torchfuser.jit(chain)
    variants = {
        "eager": chain,
        "inductor": torch.compile(chain),
        "torchfuser.jit": jitted,
    }
    results = {}
    for name, fn in variants.items():
        results[name] = bench(fn, args, a.iters)
        print(f"{name:16s} {results[name]['median_ms']:8.2f} ms (min {results[name]['min_ms']:.2f}, first call {results[name]['first_call_s']:.1f} s)")
    # parity of the measured variants against eager
    ref = chain(*args[:3]).detach()
    for name in ("inductor", "torchfuser.jit"):
        results[name]["max_abs_err_vs_eager"] = (variants[name](*args[:3]).detach() - ref).abs().max().item()
    regions = [(r.graph, r.compiled_by) for rec in jitted.records for r in rec.regions]
    eager_ms = results["eager"]["median_ms"]
    summary = {
        "benchmark": "compiler_cpu pointwise chain silu(x)*y + 0.5*sin(b), fwd+bwd",
        "shape": [a.n, a.n], "dtype": "float32", "iters": a.iters,
        "date": datetime.date.today().isoformat(),
        "torch": torch.__version__, "cpu": platform.processor() or platform.machine(),
        "threads": torch.get_num_threads(), "cores": os.cpu_count(),
        "results": results,
        "speedup_vs_eager": {k: eager_ms / v["median_ms"] for k, v in results.items()},
        "torchfuser_regions": regions,
        "torchfuser_notes": [n for rec in jitted.records for n in rec.notes],
    }
    summary["load_avg"] = os.getloadavg()
    out = Path(a.out) if a.out else Path(__file__).parent / "results" / "archive" / f"compiler-cpu-{summary['date']}.json"
    out.write_text(json.dumps(summary, indent=2))
    print(json.dumps(summary["speedup_vs_eager"], indent=2))
    print("regions:", regions)
    print("wrote", out)


if __name__ == "__main__":
    main()
