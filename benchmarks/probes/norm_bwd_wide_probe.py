"""The norm backwards on wide rows (hidden 8192–16384), where the one-pass kernel holds a whole row
in registers and spills on NVIDIA (benchmarks/results/latest/triton_resources.md): the shipped
configuration against the same one-pass kernel at 32 warps (half the registers a thread, still
spilling) and against the looped kernel (4096-element chunks, x and dy read twice, from L2).

    python benchmarks/probes/norm_bwd_wide_probe.py [--shapes 4096x16384 4096x12288 4096x8192] [--out probe.jsonl]

A diagnostic for where ``rms_norm.MAX_FUSED_BWD`` sits (NOTES-triton.md), not a target check.
"""
from __future__ import annotations

import argparse
import json
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from norm_bwd_probe import calls, copy_gbps, timed  # noqa: E402

from torchfuser.backends.triton import layer_norm, rms_norm  # noqa: E402

SHIPPED = rms_norm.norm_config


def forced(kind: str):
    """norm_config with the backward's choice replaced for rows wider than 4096."""
    def config(n, backward=False, target=rms_norm.CPU, dres=False):
        block, rows, one_pass, warps = SHIPPED(n, backward, target, dres)
        if not backward or n <= 4096 or kind == "shipped":
            return block, rows, one_pass, warps
        if kind == "one-pass-32w":
            return rms_norm.next_pow2(n), 1, True, 32
        chunk, warps = kind.removeprefix("looped-").split("-")  # looped-<chunk>-<warps>w
        return int(chunk), 1, False, int(warps.removesuffix("w"))
    return config


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--shapes", nargs="+", default=["4096x16384", "4096x12288", "4096x8192"])
    p.add_argument("--out", default=None)
    a = p.parse_args()
    bw = copy_gbps()
    rows_out = [dict(meta=dict(device=torch.cuda.get_device_name(), torch=torch.__version__, copy_gbps=round(bw, 1),
                               max_fused_bwd=getattr(rms_norm, "MAX_FUSED_BWD", rms_norm.MAX_FUSED)))]
    print(json.dumps(rows_out[0]), flush=True)
    kinds = ("shipped", "one-pass-32w", "looped-4096-8w", "looped-4096-16w", "looped-2048-8w", "looped-8192-16w")
    for m, n in (tuple(map(int, s.split("x"))) for s in a.shapes):
        ops = calls(m, n)
        for kind in kinds:
            rms_norm.norm_config = layer_norm.norm_config = forced(kind)
            try:
                for op, (fn, nbytes) in ops.items():
                    row = timed(fn, nbytes, bw, op=op, shape=f"{m}x{n}", config=kind)
                    rows_out.append(row)
                    print(json.dumps(row), flush=True)
            finally:
                rms_norm.norm_config = layer_norm.norm_config = SHIPPED
    if a.out:
        with open(a.out, "w") as f:
            f.writelines(json.dumps(r) + "\n" for r in rows_out)


if __name__ == "__main__":
    main()
