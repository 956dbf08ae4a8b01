"""Norm then add (post-block norms, OLMo-2) on the GPU: ``rms_norm_add`` (one Triton kernel reading a and r, writing
out and rstd) against what the layer ran before it (the fused RMSNorm's kernel, then PyTorch's add), forward alone and
forward + backward, and against the copy bandwidth measured in the same run.

    python benchmarks/probes/rms_norm_add_probe.py [--shapes 8192x2048 8192x4096] [--out probe.jsonl]

Dtypes: a training step's under autocast (a: the block's bf16 output, r: the fp32 residual stream, y in bf16: OLMo-2's
rule) and bf16 throughout. A diagnostic for NOTES-families.md, not a target check.
"""
from __future__ import annotations

import argparse
import json
import os
import sys

import torch
from triton.testing import do_bench

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

from torchfuser import ops  # noqa: E402


def copy_gbps() -> float:
    a = torch.empty(1 << 29, dtype=torch.uint16, device="cuda")
    b = torch.empty_like(a)
    return 2 * a.numel() * 2 / do_bench(lambda: b.copy_(a), rep=200) / 1e6


def _bytes(m, n, ad, rd):
    """Tensor bytes the fused forward must move: read a and r, write out (and rstd)."""
    od = torch.promote_types(ad, rd)
    return m * n * (ad.itemsize + rd.itemsize + od.itemsize) + 4 * m


def run(m: int, n: int, ad, rd) -> list[dict]:
    a = torch.randn(m, n, device="cuda", dtype=ad, requires_grad=True)
    r = torch.randn(m, n, device="cuda", dtype=rd, requires_grad=True)
    w = torch.randn(n, device="cuda", requires_grad=True)
    fused = lambda: ops.rms_norm_add(a, r, w, 1e-6, 0.0, "triton", ad)  # noqa: E731
    unfused = lambda: r + ops.rms_norm(a, w, 1e-6, 0.0, "triton")  # noqa: E731  (y in a's dtype, as OLMo-2's norm)
    out = fused()
    dout = torch.randn_like(out)
    torch.testing.assert_close(out, unfused(), rtol=1e-2, atol=1e-2)
    rows = []
    for name, fn in (("rms_norm_add", fused), ("rms_norm+add", unfused)):
        with torch.no_grad():
            fwd = do_bench(fn, rep=200)
        both = do_bench(lambda fn=fn: torch.autograd.grad(fn(), (a, r, w), dout), rep=200)
        rows.append(dict(op=name, m=m, n=n, a=str(ad)[6:], r=str(rd)[6:], fwd_ms=round(fwd, 4),
                         fwd_bwd_ms=round(both, 4), fwd_gbps=round(_bytes(m, n, ad, rd) / fwd / 1e6, 1)))
    return rows


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--shapes", nargs="*", default=["8192x2048", "8192x4096", "16384x5120"])
    p.add_argument("--out")
    args = p.parse_args()
    peak = copy_gbps()
    print(json.dumps({"device": torch.cuda.get_device_name(), "copy_gbps": round(peak, 1)}))
    rows = []
    for shape in args.shapes:
        m, n = map(int, shape.split("x"))
        for ad, rd in ((torch.bfloat16, torch.float32), (torch.bfloat16, torch.bfloat16)):
            for row in run(m, n, ad, rd):
                row["fwd_of_copy"] = round(row["fwd_gbps"] / peak, 3)
                print(json.dumps(row), flush=True)
                rows.append(row)
    if args.out:
        with open(args.out, "a") as f:
            f.writelines(json.dumps(r) + "\n" for r in rows)


if __name__ == "__main__":
    main()
