"""CPU op benchmark: the mlir backend vs eager PyTorch vs torch.compile (Inductor), same process.

    python benchmarks/ops_cpu.py [--rows 4096] [--hidden 4096] [--reps 11] [--threads N]
    python benchmarks/ops_cpu.py --ops none --train-step          # tiny Llama training step only

Each op runs a forward + backward step (fp32) in three variants. The variants are timed
round-robin (eager, inductor, mlir, eager, …) so that a change in the machine's load hits all
of them alike; the median and min of ``--reps`` runs after warm-up are reported, with the load
average before and after. ``--threads`` sets torch's intra-op threads (the mlir backend uses
as many). ``--train-step`` adds a whole training step (forward, backward, AdamW) of the tiny
Llama recipe: eager vs torch.compile vs torchfuser.optimize(backend="mlir").
Writes benchmarks/results/archive/cpu-ops-<date>.json (move it to latest/ when the docs cite it).
"""
from __future__ import annotations

import argparse
import datetime
import json
import os
import statistics
import sys
import time

import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

import torchfuser.functional as F  # noqa: E402
from torchfuser.backends.reference import gated, rms_norm as ref_rms  # noqa: E402


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


def load() -> list[float]:
    return [round(x, 2) for x in os.getloadavg()]


def op_step(fn, inputs):
    xs = [t.clone().requires_grad_(True) for t in inputs]
    dy = torch.randn(inputs[0].shape)

    def step():
        for x in xs:
            x.grad = None
        fn(*xs).backward(dy)

    return step


def round_robin(steps: dict, reps: int, warmup: int = 2) -> dict:
    """{variant: (median ms, min ms)}, timing the variants in turn, ``reps`` times each."""
    for s in steps.values():
        for _ in range(warmup):
            s()
    times = {v: [] for v in steps}
    for _ in range(reps):
        for v, s in steps.items():
            t = time.perf_counter()
            s()
            times[v].append(time.perf_counter() - t)
    return {v: (round(statistics.median(ts) * 1e3, 2), round(min(ts) * 1e3, 2)) for v, ts in times.items()}


def bench_op(name, args, results):
    from torchfuser.backends.mlir import cache

    eager, mlir, make = OPS[name]
    inputs = make(args.rows, args.hidden)
    row = {"op": name, "shape": [args.rows, args.hidden], "dtype": "float32", "threads": torch.get_num_threads()}
    cache.clear_memory()
    t = time.perf_counter()
    op_step(mlir, [i[:8] if i.dim() > 1 else i for i in inputs])()  # compile or load fwd+bwd kernels
    row["mlir_first_call_s"] = round(time.perf_counter() - t, 3)
    compiled = torch.compile(eager)
    t = time.perf_counter()
    op_step(compiled, inputs)()
    row["inductor_compile_s"] = round(time.perf_counter() - t, 3)
    row["load_before"] = load()
    timed = round_robin({v: op_step(fn, inputs) for v, fn in (("eager", eager), ("inductor", compiled), ("mlir", mlir))}, args.reps)
    row["load_after"] = load()
    for v, (med, best) in timed.items():
        row[f"{v}_ms"], row[f"{v}_min_ms"] = med, best
    row["speedup_vs_eager"] = round(row["eager_ms"] / row["mlir_ms"], 2)
    row["speedup_vs_inductor"] = round(row["inductor_ms"] / row["mlir_ms"], 2)
    results.append(row)
    print(json.dumps(row), flush=True)


def bench_train_step(args):
    """Tiny Llama (recipes/tiny.json), fp32, AdamW: eager vs Inductor vs torchfuser mlir."""
    import torchfuser
    from train_step import build

    dev = torch.device("cpu")
    ids = torch.randint(0, 1024, (args.batch, args.seq), generator=torch.Generator().manual_seed(1))
    steps, losses = {}, {}
    for variant in ("eager", "inductor", "mlir"):
        model = build("tiny", dev, 0)
        run = model
        if variant == "inductor":
            run = torch.compile(model)
        elif variant == "mlir":
            torchfuser.optimize(model, backend="mlir")
        opt = torch.optim.AdamW(model.parameters(), lr=1e-4)

        def step(run=run, opt=opt, variant=variant):
            loss = run(input_ids=ids, labels=ids).loss
            loss.backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
            losses.setdefault(variant, []).append(round(loss.item(), 4))

        steps[variant] = step
    before = load()
    timed = round_robin(steps, args.reps, warmup=3)
    row = {"train_step": "tiny-llama", "batch": args.batch, "seq": args.seq, "threads": torch.get_num_threads(),
           "load_before": before, "load_after": load(), "first_losses": {v: l[0] for v, l in losses.items()}}
    for v, (med, best) in timed.items():
        row[f"{v}_ms"], row[f"{v}_min_ms"] = med, best
    row["speedup_vs_eager"] = round(row["eager_ms"] / row["mlir_ms"], 2)
    row["speedup_vs_inductor"] = round(row["inductor_ms"] / row["mlir_ms"], 2)
    print(json.dumps(row), flush=True)
    return row


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--rows", type=int, default=4096)
    ap.add_argument("--hidden", type=int, default=4096)
    ap.add_argument("--reps", type=int, default=11)
    ap.add_argument("--threads", type=int, default=None, help="torch intra-op threads (default: torch's)")
    ap.add_argument("--ops", default=",".join(OPS), help="comma-separated, or 'none'")
    ap.add_argument("--train-step", action="store_true", help="also time a tiny-Llama training step")
    ap.add_argument("--batch", type=int, default=4)
    ap.add_argument("--seq", type=int, default=256)
    ap.add_argument("--out", default=None, help="JSON file (default benchmarks/results/archive/cpu-ops-<date>.json)")
    args = ap.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    results = []
    for name in [o for o in args.ops.split(",") if o and o != "none"]:
        bench_op(name, args, results)
    train = bench_train_step(args) if args.train_step else None
    print(f"\n{'op':<12}{'eager ms':>10}{'inductor ms':>13}{'mlir ms':>10}{'x eager':>9}{'x inductor':>12}")
    for r in results + ([dict(train, op="tiny-llama")] if train else []):
        print(f"{r['op']:<12}{r['eager_ms']:>10}{r['inductor_ms']:>13}{r['mlir_ms']:>10}{r['speedup_vs_eager']:>9}{r['speedup_vs_inductor']:>12}")
    out = args.out or os.path.join(os.path.dirname(os.path.abspath(__file__)), "results", "archive", f"cpu-ops-{datetime.date.today()}.json")
    os.makedirs(os.path.dirname(out), exist_ok=True)
    with open(out, "w") as f:
        json.dump({"cpu": os.cpu_count(), "torch": torch.__version__, "threads": torch.get_num_threads(),
                   "results": results, "train_step": train}, f, indent=1)
    print("wrote", out)


if __name__ == "__main__":
    main()
