"""Where the host's time goes in a training step without CUDA graphs.

    python3 benchmarks/probes/host_profile.py --model qwen05b --variants eager torchfuser --out host.txt

For each variant: the step's wall time (synchronised), the host time to issue the forward and the
backward (no synchronisation inside: while the GPU queue has room these are the host's own costs),
then cProfile over a few steps: the functions with the most own time and, for TorchFuser's files,
the most cumulative time.
"""
from __future__ import annotations

import argparse
import cProfile
import io
import pstats
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path[:0] = [str(Path(__file__).resolve().parents[2]), str(Path(__file__).resolve().parents[1])]

from train_step import build, prepare  # noqa: E402


def measure(step_fn, opt, ids, autocast, steps):
    fwd, bwd, wall = [], [], []
    for _ in range(steps):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        with autocast:
            loss = step_fn(input_ids=ids, labels=ids, use_cache=False).loss
        t1 = time.perf_counter()
        loss.backward()
        t2 = time.perf_counter()
        opt.step()
        opt.zero_grad(set_to_none=True)
        torch.cuda.synchronize()
        t3 = time.perf_counter()
        fwd.append(t1 - t0), bwd.append(t2 - t1), wall.append(t3 - t0)
    return {k: round(statistics.median(v) * 1e3, 2) for k, v in (("forward_host_ms", fwd), ("backward_host_ms", bwd), ("step_ms", wall))}


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default="qwen05b")
    p.add_argument("--variants", nargs="+", default=["eager", "torchfuser"])
    p.add_argument("--batch", type=int, default=4)
    p.add_argument("--seq", type=int, default=2048)
    p.add_argument("--steps", type=int, default=6)
    p.add_argument("--top", type=int, default=35)
    p.add_argument("--out")
    a = p.parse_args()
    device = torch.device("cuda")
    out = io.StringIO()
    for variant in a.variants:
        model = build(a.model, device, 0)
        step_fn = prepare(variant, model)
        opt = torch.optim.AdamW(model.parameters(), lr=1e-4, fused=True)
        ids = torch.randint(0, model.config.vocab_size, (a.batch, a.seq), device=device)
        autocast = torch.autocast("cuda", dtype=torch.bfloat16)
        measure(step_fn, opt, ids, autocast, 3)  # warm-up
        print(f"== {a.model} {variant}: {measure(step_fn, opt, ids, autocast, a.steps)}", file=out, flush=True)
        prof = cProfile.Profile()
        prof.enable()
        measure(step_fn, opt, ids, autocast, 3)
        prof.disable()
        stats = pstats.Stats(prof, stream=out)
        stats.sort_stats("tottime").print_stats(a.top)
        if variant != "eager":
            stats.sort_stats("cumtime").print_stats("torchfuser", a.top)
        del model, step_fn, opt
        torch.cuda.empty_cache()
    text = out.getvalue()
    print(text)
    if a.out:
        Path(a.out).write_text(text)


if __name__ == "__main__":
    main()
