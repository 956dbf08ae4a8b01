"""The host cost of a fused eager step on the CPU: a tiny 2-layer Llama (reference backend, one thread),
best of 5 × 100 steps, and where TorchFuser's own Python spends it (cProfile, torchfuser frames only).
Compare two checkouts by path; alternate them, the machine drifts:

    python benchmarks/probes/host_cost_cpu.py /path/to/old/checkout
    python benchmarks/probes/host_cost_cpu.py .
"""
from __future__ import annotations

import cProfile
import pstats
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(sys.argv[1] if len(sys.argv) > 1 else ".").resolve()))

import torch  # noqa: E402
from transformers import LlamaConfig, LlamaForCausalLM  # noqa: E402

import torchfuser  # noqa: E402


def main() -> None:
    torch.set_num_threads(1)
    cfg = LlamaConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                      num_key_value_heads=2, vocab_size=128)
    torch.manual_seed(0)
    model = torchfuser.optimize(LlamaForCausalLM(cfg), backend="reference")
    ids = torch.randint(0, 128, (1, 8))

    def step():
        model(input_ids=ids, labels=ids).loss.backward()

    for _ in range(20):
        step()
    best = float("inf")
    for _ in range(5):
        start = time.perf_counter()
        for _ in range(100):
            step()
        best = min(best, (time.perf_counter() - start) / 100)
    print(f"{torchfuser.__file__}: {best * 1e3:.3f} ms a step")
    prof = cProfile.Profile()
    prof.enable()
    for _ in range(200):
        step()
    prof.disable()
    rows = [(k, v) for k, v in pstats.Stats(prof).stats.items() if "torchfuser" in k[0]]
    for (path, line, name), (_, calls, own, _, _) in sorted(rows, key=lambda kv: -kv[1][2])[:12]:
        print(f"{own / 200 * 1e6:8.1f} µs a step {calls // 200:4d} calls  {path.split('torchfuser/')[-1]}:{line} {name}")


if __name__ == "__main__":
    main()
