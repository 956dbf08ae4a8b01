"""The norm backwards' launch shape on the GPU: software-pipelining depth of the row-tile loop,
persistent programs per SM and rows per tile, against the copy bandwidth measured in the same run.

    python benchmarks/norm_bwd_probe.py [--out probe.jsonl]

A diagnostic for NOTES-triton.md (which configuration the backends ship), not a target check.
"""
from __future__ import annotations

import argparse
import itertools
import json
import os
import sys

import torch
from triton.testing import do_bench

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from torchfuser.backends.triton import _common, layer_norm, rms_norm  # noqa: E402


def copy_gbps() -> float:
    a = torch.empty(1 << 29, dtype=torch.uint16, device="cuda")
    b = torch.empty_like(a)
    ms = do_bench(lambda: b.copy_(a), rep=200)
    return 2 * a.numel() * 2 / ms / 1e6


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--out", default=None)
    a = p.parse_args()
    bw = copy_gbps()
    rows_out = [dict(meta=dict(device=torch.cuda.get_device_name(), torch=torch.__version__, copy_gbps=round(bw, 1)))]
    print(json.dumps(rows_out[0]), flush=True)
    for m, n in ((32768, 4096), (8192, 2048)):
        x = torch.randn(m, n, device="cuda", dtype=torch.bfloat16)
        dy = torch.randn_like(x)
        w = torch.randn(n, device="cuda", dtype=torch.bfloat16)
        b = torch.randn_like(w)
        _, rstd = rms_norm.rms_norm_fwd(x, w, 1e-6, 0.0)
        _, mean, lrstd = layer_norm.layer_norm_fwd(x, w, b, 1e-5)
        calls = {
            "rms_norm": lambda: rms_norm.rms_norm_bwd(dy, x, w, rstd, 1e-6, 0.0),
            "layer_norm": lambda: layer_norm.layer_norm_bwd(dy, x, w, b, mean, lrstd, 1e-5),
        }
        for stages, per_sm, tile in itertools.product((1, 2, 3), (2, 4, 8), (4096, 8192)):
            _common.BWD_STAGES, _common.PROGRAMS_PER_SM, rms_norm._TILE = stages, per_sm, tile
            _common.num_programs_cap.cache_clear()
            rms_norm.norm_config.cache_clear()
            for op, fn in calls.items():
                try:
                    ms = do_bench(fn, rep=100)
                except Exception as e:  # a configuration Triton cannot compile: note it, go on
                    row = dict(op=op, shape=f"{m}x{n}", stages=stages, per_sm=per_sm, tile=tile, error=str(e)[:200])
                else:
                    gbps = 3 * x.numel() * 2 / ms / 1e6
                    row = dict(op=op, shape=f"{m}x{n}", stages=stages, per_sm=per_sm, tile=tile, ms=round(ms, 4),
                               gbps=round(gbps, 1), pct_copy=round(100 * gbps / bw, 1))
                rows_out.append(row)
                print(json.dumps(row), flush=True)
    if a.out:
        with open(a.out, "w") as f:
            f.writelines(json.dumps(r) + "\n" for r in rows_out)


if __name__ == "__main__":
    main()
