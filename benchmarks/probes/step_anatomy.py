"""Where a fused training step's time goes, beyond the kernel table of ``train_step.py --profile-dir``.

    python benchmarks/probes/step_anatomy.py shapes [--model qwen05b]   # copies, casts, adds, sums by shape
    python benchmarks/probes/step_anatomy.py gaps [--model qwen05b]     # GPU idle gaps and the host ops in them
    python benchmarks/probes/step_anatomy.py sync [--model qwen05b]     # what transformers' host read costs a step

``shapes`` profiles one step of ``optimize(model)`` (no CUDA graphs, so every ATen op is seen with its
input shapes) and lists the ops that launch copy, cast, add and reduction kernels, by shape, with
their GPU time. ``gaps`` profiles one step of ``optimize(model, cuda_graphs=True)`` and lists every
gap longer than 40 µs between GPU kernels with the host ops that started during it (the profiler
slows the host, so the gaps read longer than they are). ``sync`` times graphed steps as they are
and with transformers' packed-sequence check (a host read of a device value in every forward, for
every variant alike) stubbed out, alternating, without the profiler: what that read costs the GPU
in idle time. A diagnostic for NOTES-train-step.md.
"""
from __future__ import annotations

import argparse
import collections
import os
import statistics
import sys
import time

import torch
from torch.autograd import DeviceType

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

import torchfuser  # noqa: E402
from profiling import idle_gaps, profiled  # noqa: E402
from train_step import build  # noqa: E402

_MOVES = ("aten::_to_copy", "aten::copy_", "aten::add", "aten::add_", "aten::cat", "aten::sum", "aten::fill_",
          "aten::zero_", "aten::clone")


def shapes(prof) -> None:
    rows = collections.defaultdict(lambda: [0, 0.0])
    for e in prof.events():
        if e.name in _MOVES and e.device_type == DeviceType.CPU and not (e.cpu_parent and e.cpu_parent.name in _MOVES):
            key = (e.name, str(e.input_shapes[:2]), e.cpu_parent.name[:50] if e.cpu_parent else "")
            rows[key][0] += 1
            rows[key][1] += e.device_time_total
    for (name, shape, parent), (n, us) in sorted(rows.items(), key=lambda kv: -kv[1][1]):
        print(f"{us / 1e3:8.3f} ms {n:4d}x  {name} {shape} | {parent}")


def gaps(prof, least_us: float = 40.0) -> None:
    host = [e for e in prof.events() if e.device_type == DeviceType.CPU]
    kernels, found = idle_gaps(prof)
    span = max(k.time_range.end for k in kernels) - kernels[0].time_range.start
    busy = span - sum(b - a for a, b, _, _ in found)  # kernels of a graph can overlap: not their sum
    found = [(a, b, before.name, after.name) for a, b, before, after in found if b - a > least_us]
    print(f"{len(kernels)} kernels, busy {busy / 1e3:.2f} ms of {span / 1e3:.2f} ms; "
          f"{len(found)} gaps over {least_us:.0f} µs: {sum(b - a for a, b, _, _ in found) / 1e3:.2f} ms")
    for a, b, before, after in found:
        print(f"\n=== {b - a:.0f} µs after {before[:50]} before {after[:50]}")
        for e in host:
            if a <= e.time_range.start < b and (e.cpu_parent is None or e.cpu_parent.time_range.start < a):
                print(f"  {e.time_range.end - e.time_range.start:8.0f} µs {e.name[:60]}")


def time_without_host_read(step, steps: int = 10, rounds: int = 3) -> None:
    from transformers import masking_utils

    real = masking_utils.find_packed_sequence_indices
    for r in range(rounds):
        for name, fn in (("as is", real), ("packed-sequence check stubbed", lambda position_ids: None)):
            masking_utils.find_packed_sequence_indices = fn
            step()
            torch.cuda.synchronize()
            times = []
            for _ in range(steps):
                start = time.perf_counter()
                step()
                torch.cuda.synchronize()
                times.append(time.perf_counter() - start)
            print(f"round {r}: {name}: {statistics.median(times) * 1e3:.2f} ms a step (median of {steps})")
    masking_utils.find_packed_sequence_indices = real


def main():
    p = argparse.ArgumentParser()
    p.add_argument("what", choices=("shapes", "gaps", "sync"))
    p.add_argument("--model", default="qwen05b")
    a = p.parse_args()
    dev = torch.device("cuda")
    model = build(a.model, dev, 0)
    torchfuser.optimize(model, cuda_graphs=a.what != "shapes")
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4, fused=True)
    ids = torch.randint(0, model.config.vocab_size, (4, 2048), device=dev)

    def step():
        with torch.autocast("cuda", dtype=torch.bfloat16):
            loss = model(input_ids=ids, labels=ids, use_cache=False).loss
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)

    for _ in range(4):
        step()
    torch.cuda.synchronize()
    if a.what == "sync":
        return time_without_host_read(step)
    prof = profiled(step, dev, 1, record_shapes=a.what == "shapes")
    (shapes if a.what == "shapes" else gaps)(prof)


if __name__ == "__main__":
    main()
