"""The joint projections of a qwen05b-shaped layer (q/k/v, gate/up) under bf16 autocast, forward +
backward, as autocast runs them (the weights cast and concatenated, one F.linear) and as one
autograd node with fp32 gradients from cuBLAS (modules/projections.py): GPU time from CUDA-graph
replays at 8192 tokens, host time per call at 64 tokens (where the GPU waits for the host).
A diagnostic for NOTES-train-step.md (its run 23 also timed o_proj and down as single nodes, with
the probe of commit 89bde7f).

    python benchmarks/probes/projection_probe.py [--out probe.jsonl]
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time

import torch
from torch import nn
from triton.testing import do_bench

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

from torchfuser.modules import gemm, projections  # noqa: E402

H, I, KV = 896, 4864, 128  # qwen05b: hidden, intermediate, k/v width


def autocast_joint(x, linears):
    """What modules/projections.py did before the single node: cast, concatenate, one F.linear."""
    weight = gemm.cast_cat([m.weight for m in linears], torch.bfloat16)
    bias = None if linears[0].bias is None else gemm.cast_cat([m.bias for m in linears], torch.bfloat16)
    with torch.autocast("cuda", enabled=False):
        return nn.functional.linear(x.to(torch.bfloat16), weight, bias)


def cases():
    torch.manual_seed(0)
    qkv = [nn.Linear(H, n).cuda() for n in (H, KV, KV)]
    gate_up = [nn.Linear(H, I, bias=False).cuda() for _ in range(2)]
    # (name, input features, input dtype, autocast's way, one node)
    return [
        ("qkv", H, torch.float32, lambda x: autocast_joint(x, qkv), lambda x: projections.joint(x, qkv)),
        ("gate_up", H, torch.float32, lambda x: autocast_joint(x, gate_up), lambda x: projections.joint(x, gate_up)),
    ], [p for m in (*qkv, *gate_up) for p in m.parameters()]


def step(fn, x, params, dy):
    with torch.autocast("cuda", dtype=torch.bfloat16):
        y = fn(x)
    torch.autograd.backward(y, dy)


def gpu_ms(fn, x, params, dy) -> float:
    for _ in range(3):
        step(fn, x, params, dy)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        step(fn, x, params, dy)
    return do_bench(g.replay, rep=200)


def host_us(fn, x, params, dy, calls=300) -> float:
    rounds = []
    for _ in range(5):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        for _ in range(calls):
            step(fn, x, params, dy)
        rounds.append((time.perf_counter() - t0) / calls * 1e6)
    torch.cuda.synchronize()
    return sorted(rounds)[2]


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", default=None)
    a = p.parse_args()
    rows = []
    all_cases, params = cases()
    for name, k, dtype, old, new in all_cases:
        for tokens, measure in ((8192, gpu_ms), (64, host_us)):
            x = torch.randn(tokens, k, device="cuda", dtype=dtype, requires_grad=True)
            with torch.autocast("cuda", dtype=torch.bfloat16):
                dy = torch.randn_like(new(x))
            row = {"what": name, "tokens": tokens, "unit": "gpu ms" if measure is gpu_ms else "host us"}
            for label, fn in (("autocast", old), ("one node", new)):
                for t in params:
                    t.grad = None
                row[label] = round(measure(fn, x, params, dy), 4)
            rows.append(row)
            print(json.dumps(row), flush=True)
    if a.out:
        with open(a.out, "w") as f:
            f.writelines(json.dumps(r) + "\n" for r in rows)


if __name__ == "__main__":
    main()
