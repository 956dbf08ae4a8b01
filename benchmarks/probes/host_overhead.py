"""Host time of a training step with the kernels taken out: what Python, autograd and ATen's
dispatch cost per step, the part of a small model's GPU step that the GPU cannot hide.

    python benchmarks/probes/host_overhead.py                  # tiny qwen05b-shaped model, CPU, bf16 autocast
    python benchmarks/probes/host_overhead.py --profile 30     # and the 30 costliest functions (cProfile)

Runs on the CPU at tiny sizes (hidden 64, 16 tokens), where every op's own work is negligible.
"fused" swaps TorchFuser's kernels for ones that only allocate their outputs (their fake
implementations), after ``optimize`` has checked the real ones; matrix products and SDPA still
run, as in "eager". Both rows therefore measure framework cost, not arithmetic.
"""
from __future__ import annotations

import argparse
import cProfile
import pstats
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import torchfuser  # noqa: E402
import torchfuser.backends as backends  # noqa: E402


def allocate_only(fn: str):
    from torch._library.simple_registry import singleton

    fake = singleton.find(f"torchfuser::{fn}").fake_impl.kernel
    return lambda *args: fake(*args, "reference")


def build(fused: bool, layers: int):
    from transformers import Qwen2Config, Qwen2ForCausalLM

    cfg = Qwen2Config(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=layers,
                      num_attention_heads=4, num_key_value_heads=2, attn_implementation="sdpa")
    torch.manual_seed(0)
    model = Qwen2ForCausalLM(cfg)
    if fused:
        torchfuser.optimize(model, backend="reference")
        for fn in backends.kernels("reference").__all__:
            backends._KERNELS[("reference", fn)] = allocate_only(fn)
    return model


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--layers", type=int, default=24)
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--profile", type=int, default=0, help="print this many functions by cumulative time")
    args = parser.parse_args()
    torch.set_num_threads(1)
    ids = torch.randint(0, 256, (1, 16))
    for name in ("eager", "fused"):
        model = build(name == "fused", args.layers)

        def step():
            with torch.autocast("cpu", dtype=torch.bfloat16):
                loss = model(input_ids=ids, labels=ids, use_cache=False).loss
            loss.backward()

        for _ in range(5):
            step()
        start = time.perf_counter()
        for _ in range(args.steps):
            step()
        print(f"{name:6} {(time.perf_counter() - start) / args.steps * 1e3:7.2f} ms of host time a step")
        if args.profile:
            prof = cProfile.Profile()
            prof.runcall(lambda: [step() for _ in range(5)])
            pstats.Stats(prof).sort_stats("cumulative").print_stats(args.profile)


if __name__ == "__main__":
    main()
