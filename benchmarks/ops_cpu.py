"""CPU op benchmark: the mlir backend vs eager PyTorch vs torch.compile (Inductor), same process.

    python benchmarks/ops_cpu.py [--rows 4096] [--hidden 4096] [--reps 10]

Each op runs a forward + backward step (fp32) in three variants; the median and min of
``--reps`` timed runs after warm-up are reported, plus mlir compile / cache-load times.
Writes benchmarks/results/cpu-ops-<date>.json.
"""
from __future__ import annotations

import argparse
import datetime
import json
import os
import statistics
import time

import torch

import torchfuser.functional as F
from torchfuser.backends.reference import gated, rms_norm as ref_rms


def eager_rms(x, w):
    return ref_rms.rms_norm(x, w, 1e-6, 0.0)[0]


def eager_swiglu(g, u):
    return gated.swiglu(g, u)


OPS = {
    "rms_norm": (eager_rms, lambda x, w: F.rms_norm(x, w, 1e-6, backend="mlir"), lambda r, h: [torch.randn(r, h), torch.randn(h)]),
    "swiglu": (eager_swiglu, lambda g, u: F.swiglu(g, u, backend="mlir"), lambda r, h: [torch.randn(r, h), torch.randn(r, h)]),
    "layer_norm": (
        lambda x, w, b: torch.nn.functional.layer_norm(x, (x.shape[-1],), w, b, 1e-5),
        lambda x, w, b: F.layer_norm(x, w, b, 1e-5, backend="mlir"),
        lambda r, h: [torch.randn(r, h), torch.randn(h), torch.randn(h)],
    ),
    "gelu_tanh": (
        lambda x: torch.nn.functional.gelu(x, approximate="tanh"),
        lambda x: F.gelu(x, "tanh", backend="mlir"),
        lambda r, h: [torch.randn(r, h)],
    ),
}


def step_time(fn, inputs, reps):
    xs = [t.clone().requires_grad_(True) for t in inputs]
    dy = torch.randn(inputs[0].shape)

    def step():
        for x in xs:
            x.grad = None
        fn(*xs).backward(dy)

    for _ in range(2):
        step()
    ts = []
    for _ in range(reps):
        t = time.perf_counter()
        step()
        ts.append(time.perf_counter() - t)
    return statistics.median(ts) * 1e3, min(ts) * 1e3


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--rows", type=int, default=4096)
    ap.add_argument("--hidden", type=int, default=4096)
    ap.add_argument("--reps", type=int, default=10)
    ap.add_argument("--ops", default=",".join(OPS))
    args = ap.parse_args()
    from torchfuser.backends.mlir import cache

    results = []
    for name in args.ops.split(","):
        eager, mlir, make = OPS[name]
        inputs = make(args.rows, args.hidden)
        row = {"op": name, "shape": [args.rows, args.hidden], "dtype": "float32", "threads": torch.get_num_threads()}
        cache.clear_memory()
        t = time.perf_counter()
        step_time(mlir, [i[:8] if i.dim() > 1 else i for i in inputs], 1)  # compile or load fwd+bwd kernels
        row["mlir_first_call_s"] = time.perf_counter() - t
        row["mlir_kernel_sources"] = {k: v for k, v in cache.stats.last.items() if k.startswith(name.split("_tanh")[0])}
        compiled = torch.compile(eager)
        t = time.perf_counter()
        step_time(compiled, inputs, 1)
        row["inductor_compile_s"] = time.perf_counter() - t
        for variant, fn in (("eager", eager), ("inductor", compiled), ("mlir", mlir)):
            med, best = step_time(fn, inputs, args.reps)
            row[f"{variant}_ms"] = round(med, 2)
            row[f"{variant}_min_ms"] = round(best, 2)
        row["speedup_vs_eager"] = round(row["eager_ms"] / row["mlir_ms"], 2)
        row["speedup_vs_inductor"] = round(row["inductor_ms"] / row["mlir_ms"], 2)
        results.append(row)
        print(json.dumps(row))
    print(f"\n{'op':<12}{'eager ms':>10}{'inductor ms':>13}{'mlir ms':>10}{'x eager':>9}{'x inductor':>12}")
    for r in results:
        print(f"{r['op']:<12}{r['eager_ms']:>10}{r['inductor_ms']:>13}{r['mlir_ms']:>10}{r['speedup_vs_eager']:>9}{r['speedup_vs_inductor']:>12}")
    out = os.path.join(os.path.dirname(__file__), "results", f"cpu-ops-{datetime.date.today()}.json")
    os.makedirs(os.path.dirname(out), exist_ok=True)
    with open(out, "w") as f:
        json.dump({"cpu": os.cpu_count(), "torch": torch.__version__, "results": results}, f, indent=1)
    print("wrote", out)


if __name__ == "__main__":
    main()
