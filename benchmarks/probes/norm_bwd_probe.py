"""The norm backwards' launch shape on the GPU: software-pipelining depth of the row-tile loop,
persistent programs per SM and rows per tile, and the partial-dw reduction's block shape,
against the copy bandwidth measured in the same run.

    python benchmarks/probes/norm_bwd_probe.py [--shapes 8192x896 8192x2048] [--out probe.jsonl]

Ops: the plain backwards of rms_norm and layer_norm (bf16), and the two a fused decoder layer runs
in training (fp32 residual stream, bf16 norm output): ``opening`` (rms_norm_bwd with the residual's
gradient added) and ``add`` (add_rms_norm_bwd, which also writes the bf16 branch gradient).
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

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

from torchfuser.backends.triton import _common, layer_norm, rms_norm  # noqa: E402


def copy_gbps() -> float:
    a = torch.empty(1 << 29, dtype=torch.uint16, device="cuda")
    b = torch.empty_like(a)
    ms = do_bench(lambda: b.copy_(a), rep=200)
    return 2 * a.numel() * 2 / ms / 1e6


def calls(m: int, n: int):
    """{op: (call, bytes moved)} at m×n."""
    bf16, f32 = dict(device="cuda", dtype=torch.bfloat16), dict(device="cuda", dtype=torch.float32)
    x, dy = torch.randn(m, n, **bf16), torch.randn(m, n, **bf16)
    w, b = torch.randn(n, **bf16), torch.randn(n, **bf16)
    s, ds, w32 = torch.randn(m, n, **f32), torch.randn(m, n, **f32), torch.randn(n, **f32)
    _, rstd = rms_norm.rms_norm_fwd(x, w, 1e-6, 0.0)
    _, mean, lrstd = layer_norm.layer_norm_fwd(x, w, b, 1e-5)
    _, srstd = rms_norm.rms_norm_fwd(s, w32, 1e-6, 0.0)
    e = m * n
    return {
        "rms_norm": (lambda: rms_norm.rms_norm_bwd(dy, x, w, rstd, 1e-6, 0.0), 6 * e),
        "layer_norm": (lambda: layer_norm.layer_norm_bwd(dy, x, w, b, mean, lrstd, 1e-5), 6 * e),
        "opening": (lambda: rms_norm.rms_norm_bwd(dy, s, w32, srstd, 1e-6, 0.0, ds), 14 * e),
        "add": (lambda: rms_norm.add_rms_norm_bwd(dy, s, w32, srstd, 1e-6, 0.0, ds, torch.bfloat16), 16 * e),
    }


def timed(fn, nbytes, bw, **config) -> dict:
    try:
        ms = do_bench(fn, rep=100)
    except Exception as e:  # a configuration Triton cannot compile: note it, go on
        return dict(config, error=str(e)[:200])
    gbps = nbytes / ms / 1e6
    return dict(config, ms=round(ms, 4), gbps=round(gbps, 1), pct_copy=round(100 * gbps / bw, 1))


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--shapes", nargs="+", default=["32768x4096", "8192x2048", "8192x896"])
    p.add_argument("--out", default=None)
    a = p.parse_args()
    bw = copy_gbps()
    rows_out = [dict(meta=dict(device=torch.cuda.get_device_name(), torch=torch.__version__, copy_gbps=round(bw, 1)))]
    print(json.dumps(rows_out[0]), flush=True)
    sum_shipped = (rms_norm._SUM_BLOCK_N, rms_norm._SUM_BLOCK_G)
    shipped = (_common.BWD_STAGES, _common.PROGRAMS_PER_SM, rms_norm._BWD_ROWS, _common._MIN_TILES_TO_PIPELINE)
    for m, n in (tuple(map(int, s.split("x"))) for s in a.shapes):
        ops = calls(m, n)
        for stages, per_sm, rows in itertools.product((1, 2, 3), (2, 4, 8), (1, 2, 4)):
            # Pipelining forced on from one tile a program, to see what it does at small sizes too.
            _common.BWD_STAGES, _common.PROGRAMS_PER_SM, rms_norm._BWD_ROWS = stages, per_sm, rows
            _common._MIN_TILES_TO_PIPELINE = 1
            _common.num_programs_cap.cache_clear()
            rms_norm.norm_config.cache_clear()
            for op, (fn, nbytes) in ops.items():
                row = timed(fn, nbytes, bw, op=op, shape=f"{m}x{n}", stages=stages, per_sm=per_sm, rows=rows)
                rows_out.append(row)
                print(json.dumps(row), flush=True)
        _common.BWD_STAGES, _common.PROGRAMS_PER_SM, rms_norm._BWD_ROWS, _common._MIN_TILES_TO_PIPELINE = shipped
        _common.num_programs_cap.cache_clear()
        rms_norm.norm_config.cache_clear()
        # The partial rows' reduction alone, as the shipped backward leaves it (G × n fp32).
        parts = torch.randn(_common.num_programs_cap(torch.cuda.current_device()), n, device="cuda")
        for block_n, block_g in itertools.product((16, 32, 64, 128), (16, 32, 64)):
            rms_norm._SUM_BLOCK_N, rms_norm._SUM_BLOCK_G = block_n, block_g
            row = timed(lambda: rms_norm.sum_partials(parts, torch.float32), parts.numel() * 4, bw,
                        op="sum_partials", shape=f"{parts.shape[0]}x{n}", block_n=block_n, block_g=block_g)
            rows_out.append(row)
            print(json.dumps(row), flush=True)
        rms_norm._SUM_BLOCK_N, rms_norm._SUM_BLOCK_G = sum_shipped
    if a.out:
        with open(a.out, "w") as f:
            f.writelines(json.dumps(r) + "\n" for r in rows_out)


if __name__ == "__main__":
    main()
