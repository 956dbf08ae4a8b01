"""How much could quantising inside the producer kernels (the norms, SwiGLU, their backwards) save in a
whole FP8 step? An upper bound, measured before building it (docs/performance/NOTES-fp8.md, "Quantising
inside the producers").

A producer that holds whole rows can emit an activation's row-scaled e4m3 copy and its column partial
maxima; what is left to run is the transposed copy's tiles pass (one read). So this probe runs llama1b
with ``fp8="rowwise"`` twice, eager and graphed:
- ``real``: as shipped (every bf16 operand both ways by the atomic kernels: two reads);
- ``bound``: every bf16 operand's row copy and column partials taken from a buffer made once per shape
  (no kernel), and only the tiles pass run. The numbers it trains on are wrong (stale copies): the loss
  is not looked at, only the time. It counts all bf16 operands, the attention output's too, which SDPA
  produces: an upper bound, more than producers of ours could remove.

    PYTHONPATH=$PWD python benchmarks/probes/fp8_producer_bound_probe.py --out fp8-producer-bound.jsonl   # GPU, ≈ 60 s
"""
from __future__ import annotations

import argparse
import contextlib
import json
import os
import sys
from types import SimpleNamespace

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # benchmarks/
import train_step  # noqa: E402

from torchfuser.backends.triton import fp8_quant as K  # noqa: E402
from torchfuser.modules import fp8  # noqa: E402


@contextlib.contextmanager
def tiles_pass_only():
    """Within: fp8.quantize_both of a bf16 rowwise operand runs only the transposed copy's tiles pass."""
    kept: dict = {}
    real = fp8.quantize_both

    def bound(t, recipe):
        if t.dtype != torch.bfloat16 or recipe != "rowwise" or not t.is_contiguous():
            return real(t, recipe)
        a, b = t.shape
        per_prog, progs_a, warps = K.tiles_config(a, b, K._sms(t), K.target_of(t))
        grid = (progs_a, K.cdiv(b, K._BLOCK_B))
        if t.shape not in kept:  # the row copy and the column partials, made once per shape
            rows = K.fp8_quantize(t, False, False)
            partials = torch.empty(progs_a * b, dtype=torch.float32, device=t.device)
            K._amax(grid, t, partials, a, b, t.stride(0), per_prog,
                    BLOCK_A=K._BLOCK_A, BLOCK_B=K._BLOCK_B, PER_COLUMN=True, num_warps=warps)
            kept[t.shape] = rows, partials
        rows, partials = kept[t.shape]
        q = torch.empty((b, a), dtype=K.E4M3, device=t.device)
        scale = torch.empty((b, 1), dtype=torch.float32, device=t.device)
        K._tiles(grid, t, partials, q, scale, a, b, t.stride(0), per_prog, progs_a,
                 BLOCK_A=K._BLOCK_A, BLOCK_B=K._BLOCK_B, BLOCK_P=K._BLOCK_P, PER_COLUMN=True, TRANSPOSE=True,
                 num_warps=warps)
        return rows, (q, scale)

    fp8.quantize_both = bound
    try:
        yield
    finally:
        fp8.quantize_both = real


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", default="llama1b")
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--out", default=None)
    cli = parser.parse_args()
    if not torch.cuda.is_available():
        sys.exit("needs a CUDA GPU with FP8 GEMMs")
    device = torch.device("cuda")
    args = SimpleNamespace(precision="autocast", lora=0, grad_checkpointing=False, backend="auto", compiled_elementwise="inductor",
                           exclude=(), workload="fixed", warmup=3, steps=cli.steps, batch=4, seq=2048, seed=0, profile_dir=None)
    out = open(cli.out, "a") if cli.out else None
    env = train_step.environment(device)
    for variant in ("torchfuser-fp8", "torchfuser-fp8-graphs"):
        for mode in ("real", "bound"):
            with tiles_pass_only() if mode == "bound" else contextlib.nullcontext():
                row = train_step.run_variant(cli.model, variant, args, device)
            line = json.dumps({"what": "producer-bound", "mode": mode, "variant": variant, "model": cli.model,
                               "ms_per_step": row["ms_per_step"], "step_ms": row["step_ms"], **env})
            print(line, flush=True)
            if out:
                out.write(line + "\n")
            torch.cuda.empty_cache()
    if out:
        out.close()


if __name__ == "__main__":
    main()
