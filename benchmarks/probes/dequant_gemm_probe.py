"""Is the GEMM that dequantises NF4 tiles in its loop (backends/triton/dequant_matmul_4bit.py) faster than what the
fused QLoRA path runs by default, dequantise-then-cuBLAS (quantized_base.joint_weight: one Triton launch writing
the bf16 joint operand, then torch's GEMM)? llama8b's joint projections (q/k/v, gate/up, o, down) in bf16 at
``--tokens`` (4096 = 2 × 2048): forward x·Ŵᵀ and the input's gradient dy·Ŵ, ms of each way, the speedup, and the
largest difference between the two results (relative to the largest |value|; only the summation order differs).

The switch ``qlora_dequant_gemm`` (torchfuser/switches.py) stays off unless this shows the fused kernel faster
for every group, both directions (docs/performance/NOTES-qlora.md).

    python benchmarks/probes/dequant_gemm_probe.py [--tokens 4096] [--out probe.jsonl]
"""
from __future__ import annotations

import argparse
import json
import os
import sys

import torch
from triton.testing import do_bench

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

from torchfuser.backends.triton import dequant_matmul_4bit as dqmm  # noqa: E402
from torchfuser.backends.triton.dequant_4bit import dequantize_4bit_fwd  # noqa: E402

H, I, KV = 4096, 14336, 1024
GROUPS = {"qkv": (H + 2 * KV, H), "gate_up": (2 * I, H), "o": (H, H), "down": (H, I)}
NF4 = [-1.0, -0.6961928009986877, -0.5250730514526367, -0.39491748809814453, -0.28444138169288635,
       -0.18477343022823334, -0.09105003625154495, 0.0, 0.07958029955625534, 0.16093020141124725,
       0.24611230850219727, 0.33791524171829224, 0.44070982933044434, 0.5626170039176941, 0.7229568362236023, 1.0]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--tokens", type=int, default=4096)
    parser.add_argument("--out")
    args = parser.parse_args()
    dev, bf = "cuda", torch.bfloat16
    g = torch.Generator(device=dev).manual_seed(0)
    code = torch.tensor(NF4, device=dev)
    rows_out = []
    for name, (rows, cols) in GROUPS.items():
        packed = torch.randint(0, 256, (rows * cols // 2,), device=dev, dtype=torch.uint8, generator=g)
        absmax = torch.rand(rows * cols // 64, device=dev, generator=g) * 0.05 + 0.01
        x = torch.randn(args.tokens, cols, device=dev, dtype=bf, generator=g)
        dy = torch.randn(args.tokens, rows, device=dev, dtype=bf, generator=g)
        op = (packed, absmax, code, 64, rows, cols, bf)

        def unfused_fwd():
            return x @ dequantize_4bit_fwd(packed, absmax, code, 64, rows, cols, bf).t()

        def unfused_bwd():
            return dy @ dequantize_4bit_fwd(packed, absmax, code, 64, rows, cols, bf)

        for direction, unfused, fused in (("fwd x·Wt", unfused_fwd, lambda: dqmm.dequant_matmul_4bit_fwd(x, *op)),
                                          ("bwd dy·W", unfused_bwd, lambda: dqmm.dequant_matmul_4bit_bwd(dy, *op))):
            a, b = unfused().float(), fused().float()
            rel = ((a - b).abs().max() / a.abs().max()).item()
            t_unfused, t_fused = do_bench(unfused), do_bench(fused)
            flops = 2 * args.tokens * rows * cols
            row = {"group": name, "direction": direction, "tokens": args.tokens, "rows": rows, "cols": cols,
                   "dequant_then_cublas_ms": round(t_unfused, 4), "fused_ms": round(t_fused, 4),
                   "speedup": round(t_unfused / t_fused, 3), "fused_TFLOPs": round(flops / t_fused / 1e9, 1),
                   "cublas_path_TFLOPs": round(flops / t_unfused / 1e9, 1), "max_rel_diff": rel}
            rows_out.append(row)
            print(json.dumps(row), flush=True)
    verdict = all(r["speedup"] > 1 for r in rows_out)
    print(json.dumps({"fused_faster_everywhere": verdict}), flush=True)
    if args.out:
        with open(args.out, "a") as f:
            f.writelines(json.dumps(r) + "\n" for r in rows_out + [{"fused_faster_everywhere": verdict}])


if __name__ == "__main__":
    main()
