"""Python calls (cProfile's count, builtins included) of a greedy ``generate`` with a KV cache, batch of
left-padded prompts, fused against unfused: the host work a decode step adds, counted, not timed (the CPU
timings of generate_rollouts.py swing 2x on a shared machine; the counts are deterministic).

    PYTHONPATH=. python benchmarks/probes/generate_host_calls.py [--backend reference] [--new 16]
"""
from __future__ import annotations

import argparse
import copy
import cProfile
import pstats
import sys
from pathlib import Path

import torch

sys.path[:0] = [str(Path(__file__).resolve().parent)]
import generate_rollouts as g  # noqa: E402

import torchfuser  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--backend", default="reference")
    parser.add_argument("--new", type=int, default=16)
    args = parser.parse_args()
    base = g.build("tiny", "cpu", torch.float32)
    fused = torchfuser.optimize(copy.deepcopy(base), backend=args.backend)
    ids, mask = g.prompts(8, 32, base.config.vocab_size, "cpu")

    def run(m):
        m.train()
        with torch.no_grad():
            return m.generate(input_ids=ids, attention_mask=mask, max_new_tokens=args.new, min_new_tokens=args.new,
                              do_sample=False, pad_token_id=0, use_cache=True)
    counts = {}
    for name, m in (("unfused", base), ("fused", fused)):
        run(m)
        prof = cProfile.Profile()
        prof.enable()
        run(m)
        prof.disable()
        counts[name] = pstats.Stats(prof).total_calls
    extra = (counts["fused"] - counts["unfused"]) / (args.new + 1)
    print(f"generate {args.new} tokens, batch 8, backend {args.backend}: Python calls unfused {counts['unfused']}, "
          f"fused {counts['fused']} ({extra:+.0f} a forward)")


if __name__ == "__main__":
    main()
