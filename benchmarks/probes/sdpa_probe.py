"""Causal attention forward + backward at the training benchmark's shapes under each SDPA backend
(cuDNN, flash, memory-efficient), with grouped k/v passed as they are (enable_gqa) and expanded to
the query heads: which kernel FusedAttention should ask for. CUDA-graph replays, bf16.

    python benchmarks/probes/sdpa_probe.py [--out probe.jsonl]
"""
from __future__ import annotations

import argparse
import json
import os
import sys

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel
from triton.testing import do_bench

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from ops import graphed  # noqa: E402

SHAPES = {"qwen05b": (4, 14, 2, 2048, 64), "llama1b": (4, 32, 8, 2048, 64)}  # B, Hq, Hkv, S, D
BACKENDS = {"cudnn": SDPBackend.CUDNN_ATTENTION, "flash": SDPBackend.FLASH_ATTENTION,
            "efficient": SDPBackend.EFFICIENT_ATTENTION}


def fwd_bwd(q, k, v, dy, gqa: bool):
    if not gqa:
        rep = q.shape[1] // k.shape[1]
        k, v = k.repeat_interleave(rep, 1), v.repeat_interleave(rep, 1)
    out = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=gqa)
    out.backward(dy)


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", default=None)
    a = p.parse_args()
    rows = []
    for model, (b, hq, hkv, s, d) in SHAPES.items():
        q = torch.randn(b, hq, s, d, device="cuda", dtype=torch.bfloat16, requires_grad=True)
        k, v = (torch.randn(b, hkv, s, d, device="cuda", dtype=torch.bfloat16, requires_grad=True) for _ in range(2))
        dy = torch.randn_like(q)
        flops = 4 * b * hq * s * s * d / 2 * 3.5  # causal: half the scores; backward ≈ 2.5× the forward
        for name, backend in BACKENDS.items():
            for gqa in (True, False):
                row = {"model": model, "backend": name, "gqa": gqa}
                try:
                    with sdpa_kernel(backend):
                        ms = do_bench(graphed(lambda: fwd_bwd(q, k, v, dy, gqa)), rep=200)
                    row.update(ms=round(ms, 4), tflops=round(flops / ms / 1e9, 1))
                except RuntimeError as e:
                    row["error"] = str(e).splitlines()[0][:160]
                rows.append(row)
                print(json.dumps(row), flush=True)
    if a.out:
        with open(a.out, "w") as f:
            f.writelines(json.dumps(r) + "\n" for r in rows)


if __name__ == "__main__":
    main()
