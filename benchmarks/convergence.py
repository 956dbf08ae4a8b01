"""Convergence check: N bf16-autocast training steps of the demo's Llama-style model, eager vs
torchfuser from the same initial weights and data; the loss curves must stay within a tolerance.

    python benchmarks/convergence.py --steps 50 --tolerance 0.01 --out benchmarks/results/archive/convergence.json
"""
from __future__ import annotations

import argparse
import copy
import json
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torchfuser  # noqa: E402
from torchfuser import demo  # noqa: E402


def curve(model, size, steps, device, seed):
    # A modest learning rate and clipping: loss spikes would make two correct runs part ways.
    opt = torch.optim.AdamW(model.parameters(), lr=demo.LR, fused=device.type == "cuda")
    losses = []
    for ids in demo.batches(size, steps, device, seed):
        with torch.autocast(device.type, dtype=torch.bfloat16, enabled=device.type == "cuda"):
            loss = model(input_ids=ids, labels=ids, use_cache=False).loss
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)
        losses.append(loss.item())
    return losses


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--steps", type=int, default=50)
    parser.add_argument("--tolerance", type=float, default=0.01, help="largest relative loss difference allowed")
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--backend", default="auto")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out")
    args = parser.parse_args()
    device = torch.device(args.device)
    size = demo.SIZES["cuda" if device.type == "cuda" else "cpu"]
    base = demo.build_model(size, args.seed).to(device)
    fused = torchfuser.optimize(copy.deepcopy(base), backend=args.backend)
    eager_losses = curve(base, size, args.steps, device, args.seed)
    fused_losses = curve(fused, size, args.steps, device, args.seed)
    rel = [abs(a - b) / abs(a) for a, b in zip(eager_losses, fused_losses)]
    result = {
        "steps": args.steps, "device": str(device), "backend": args.backend, "size": size.__dict__,
        "eager": eager_losses, "torchfuser": fused_losses, "max_rel_diff": max(rel),
        "tolerance": args.tolerance, "passed": max(rel) <= args.tolerance,
        "report": torchfuser.report(fused).summary(), "torch": torch.__version__,
    }
    print(f"loss eager {eager_losses[0]:.4f}→{eager_losses[-1]:.4f}, torchfuser {fused_losses[0]:.4f}→{fused_losses[-1]:.4f}; "
          f"largest relative difference {max(rel):.2e} (tolerance {args.tolerance}) → {'PASS' if result['passed'] else 'FAIL'}")
    if args.out:
        Path(args.out).write_text(json.dumps(result, indent=1))
    sys.exit(0 if result["passed"] else 1)


if __name__ == "__main__":
    main()
