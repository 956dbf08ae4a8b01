"""NF4 dequantisation on llama8b's joint projections (q/k/v, gate/up, o, down), bf16 out: bitsandbytes'
``dequantize_4bit`` per base, TorchFuser's joint dequantisation (modules/adapters/quantized_base.py: bytes
concatenated, one Triton launch), and the bf16 GEMM it feeds at 4096 tokens (2 × 2048) for scale; GB/s
of the dequantisation (4-bit read + bf16 written). Issue 37: is dequantise-then-GEMM a small enough part
of the step, or does a GEMM with the dequantisation in its prologue pay (docs/performance/NOTES-qlora.md)?

    python benchmarks/probes/dequant_probe.py [--out probe.jsonl]
"""
from __future__ import annotations

import argparse
import json
import os
import sys

import torch
from triton.testing import do_bench

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

from torchfuser.modules.adapters import quantized_base  # noqa: E402

H, I, KV, TOKENS = 4096, 14336, 1024, 4096
GROUPS = {"qkv": [(H, H), (KV, H), (KV, H)], "gate_up": [(I, H), (I, H)], "o": [(H, H)], "down": [(H, I)]}


def layers(shapes, nested: bool):
    import bitsandbytes as bnb

    out = []
    for rows, cols in shapes:
        m = bnb.nn.Linear4bit(cols, rows, bias=False, compute_dtype=torch.bfloat16, quant_type="nf4",
                              compress_statistics=nested, device="cpu")
        m.weight = bnb.nn.Params4bit(torch.randn(rows, cols, dtype=torch.bfloat16) * 0.02, requires_grad=False,
                                     quant_type="nf4", compress_statistics=nested)
        out.append(m.cuda())
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--out")
    args = parser.parse_args()
    import bitsandbytes.functional as BF

    rows = []
    for nested in (False, True):
        for name, shapes in GROUPS.items():
            ls = layers(shapes, nested)
            n = sum(r * c for r, c in shapes)
            bnb_ms = do_bench(lambda: [BF.dequantize_4bit(m.weight.data, m.weight.quant_state) for m in ls])
            ours_ms = do_bench(lambda: quantized_base.joint_weight(ls, torch.bfloat16, "triton"))
            w = quantized_base.joint_weight(ls, torch.bfloat16, "triton")
            same = all(torch.equal(a, BF.dequantize_4bit(m.weight.data, m.weight.quant_state))
                       for a, m in zip(w.split([r for r, _ in shapes]), ls))
            x = torch.randn(TOKENS, shapes[0][1], device="cuda", dtype=torch.bfloat16)
            gemm_ms = do_bench(lambda: x @ w.t())
            gbytes = n * (0.5 + 2) / 1e9
            row = {"group": name, "double_quant": nested, "weights_M": round(n / 1e6, 1), "bnb_ms": round(bnb_ms, 4),
                   "torchfuser_ms": round(ours_ms, 4), "torchfuser_GBps": round(gbytes / ours_ms * 1e3),
                   "gemm_4096_ms": round(gemm_ms, 4), "dequant_share_of_gemm": round(ours_ms / gemm_ms, 3),
                   "bit_exact": same}
            rows.append(row)
            print(json.dumps(row), flush=True)
    if args.out:
        with open(args.out, "a") as f:
            f.writelines(json.dumps(r) + "\n" for r in rows)


if __name__ == "__main__":
    main()
