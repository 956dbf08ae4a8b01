"""Launch geometry of the rowwise both-ways FP8 quantisation (backends/triton/fp8_quant.py) and of the
SwiGLU producers (gated_fp8.py), swept on one GPU.

Run 131 found the both-ways writer (``_fp8_quant_both_kernel``: one read, q and qᵀ written) at ≈ 1.1 TB/s
on 8192 × 8192 bf16, where the rowwise kernel (one read, q written) runs at 3 TB/s, and the producers'
2-D grid 1.7-2× slower than the plain SwiGLU kernels. Both kernels' grids came from ``tiles_config``
(about 4 programs a SM, 16 warps, 128 × 64 or 64 × 64 tiles), never timed against others. This sweeps,
per kernel and shape, tile rows × columns, warps and programs a SM, and prints the fastest, each
bit-checked against the default's output.

    PYTHONPATH=$PWD python benchmarks/probes/fp8_both_ways_sweep_probe.py --out sweep.jsonl   # GPU, ≈ 2-3 min
"""
from __future__ import annotations

import argparse
import itertools
import sys

import torch
from _emit import emitter


def _bench(fn):
    from triton.testing import do_bench

    return do_bench(fn, warmup=5, rep=30, return_mode="median")


def _geometry(a, b, block_a, block_b, per_sm, sms):  # fp8_quant.tile_grid, kept as run 132 ran it
    from torchfuser.backends.triton._common import cdiv

    blocks_b = cdiv(b, block_b)
    want_a = max(1, min(cdiv(a, block_a), cdiv(per_sm * sms, blocks_b)))
    per_prog = cdiv(cdiv(a, want_a), block_a) * block_a
    return (cdiv(a, per_prog), blocks_b), per_prog


def sweep_writer(emit, t, sms):
    """The both-ways writer from t's maxima, and the atomic amax pass before it."""
    from torchfuser.backends.triton import fp8_quant as K
    from torchfuser.backends.reference.fp8_quant import fp8_amax_both

    a, b = t.shape
    amax = fp8_amax_both(t)
    (q0, s0), (qt0, st0) = K.fp8_quantize_both_amax(t, amax)
    default_ms = _bench(lambda: K.fp8_quantize_both_amax(t, amax))
    best = None
    for block_a, block_b, warps, per_sm in itertools.product((32, 64, 128), (64, 128), (4, 8, 16), (4, 8, 16, 32)):
        if block_a * block_b // (32 * warps) < 4:  # fewer than 4 elements a thread
            continue
        grid, per_prog = _geometry(a, b, block_a, block_b, per_sm, sms)
        q, qt = torch.empty_like(q0), torch.empty_like(qt0)
        s, st = torch.empty_like(s0), torch.empty_like(st0)

        def run():
            K._tiles_both(grid, t, amax, q, s, qt, st, a, b, t.stride(0), per_prog,
                          BLOCK_A=block_a, BLOCK_B=block_b, TENSORWISE=False, num_warps=warps)
        try:
            run()
        except Exception as err:  # noqa: BLE001  (out of resources: skipped, said)
            emit(what="writer", shape=[a, b], block_a=block_a, block_b=block_b, warps=warps, per_sm=per_sm,
                 error=str(err)[:120])
            continue
        ok = torch.equal(q.view(torch.uint8), q0.view(torch.uint8)) and torch.equal(qt.view(torch.uint8), qt0.view(torch.uint8))
        ms = _bench(run)
        row = dict(what="writer", shape=[a, b], dtype=str(t.dtype), block_a=block_a, block_b=block_b, warps=warps,
                   per_sm=per_sm, ms=round(ms, 4), default_ms=round(default_ms, 4), ok=ok,
                   gbps=round(a * b * (t.element_size() + 2) / ms / 1e6, 1))
        emit(**row)
        if ok and (best is None or ms < best["ms"]):
            best = row
    emit(**{**best, "what": "writer-best"})
    amax_default = _bench(lambda: K.fp8_quantize_both(t, False))  # amax pass + writer, as shipped
    best = None
    for block_a, block_b, warps, per_sm in itertools.product((64, 128), (64, 128), (4, 8, 16), (4, 8, 16)):
        grid, per_prog = _geometry(a, b, block_a, block_b, per_sm, sms)
        got = torch.zeros(a + b, dtype=torch.int32, device=t.device)

        def run():
            got.zero_()
            K._amax_both(grid, t, got, a, b, t.stride(0), per_prog,
                         BLOCK_A=block_a, BLOCK_B=block_b, TENSORWISE=False, num_warps=warps)
        run()
        ms = _bench(run)
        row = dict(what="amax", shape=[a, b], dtype=str(t.dtype), block_a=block_a, block_b=block_b, warps=warps,
                   per_sm=per_sm, ms=round(ms, 4), both_default_ms=round(amax_default, 4), ok=torch.equal(got, amax),
                   gbps=round(a * b * t.element_size() / ms / 1e6, 1))
        emit(**row)
        if row["ok"] and (best is None or ms < best["ms"]):
            best = row
    emit(**{**best, "what": "amax-best"})


def sweep_producers(emit, sms):
    from torchfuser.backends.triton import gated as G, gated_fp8 as P

    m, n = 8192, 8192
    gu = torch.randn(m, 2 * n, device="cuda", dtype=torch.bfloat16)
    dy = torch.randn(m, n, device="cuda", dtype=torch.bfloat16)
    cases = {"fwd": (P._fwd, lambda: G.swiglu_packed_fwd(gu), (m, n)),
             "bwd": (P._bwd, lambda: G.swiglu_packed_bwd(dy, gu), (m, 2 * n))}
    for name, (launch, plain, out_shape) in cases.items():
        want = plain()
        plain_ms = _bench(plain)
        best = None
        for block_a, block_b, warps, per_sm in itertools.product((16, 32, 64), (64, 128, 256), (4, 8), (4, 8, 16, 32)):
            if block_a * block_b // (32 * warps) < 4:
                continue
            grid, per_prog = _geometry(m, n, block_a, block_b, per_sm, sms)
            out = torch.empty(out_shape, device="cuda", dtype=torch.bfloat16)
            amax = torch.zeros(m + out_shape[1], dtype=torch.int32, device="cuda")
            args = (gu, out, amax, m, n, gu.stride(0)) if name == "fwd" else (dy, gu, out, amax, m, n, dy.stride(0), gu.stride(0))

            def run():
                amax.zero_()
                launch(grid, *args, per_prog, GELU=False, BLOCK_A=block_a, BLOCK_B=block_b, num_warps=warps)
            try:
                run()
            except Exception as err:  # noqa: BLE001
                emit(what=f"producer-{name}", block_a=block_a, block_b=block_b, warps=warps, per_sm=per_sm, error=str(err)[:120])
                continue
            ms = _bench(run)
            row = dict(what=f"producer-{name}", block_a=block_a, block_b=block_b, warps=warps, per_sm=per_sm,
                       ms=round(ms, 4), plain_ms=round(plain_ms, 4), ok=torch.equal(out, want))
            emit(**row)
            if row["ok"] and (best is None or ms < best["ms"]):
                best = row
        emit(**{**best, "what": f"producer-{name}-best"})


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--out", default=None)
    cli = parser.parse_args()
    if not torch.cuda.is_available():
        sys.exit("needs a CUDA GPU")
    import triton

    env = dict(gpu=torch.cuda.get_device_name(), torch=torch.__version__, triton=triton.__version__)
    # every row to the file; the best of each sweep, and errors, on stdout too
    emit = emitter(cli.out, env, lambda row: row["what"].endswith("best") or "error" in row)

    sms = torch.cuda.get_device_properties(0).multi_processor_count
    torch.manual_seed(0)
    for shape, dtype in (((8192, 8192), torch.bfloat16), ((8192, 2048), torch.bfloat16), ((8192, 16384), torch.bfloat16),
                         ((16384, 2048), torch.float32)):
        sweep_writer(emit, torch.randn(*shape, device="cuda").to(dtype), sms)
    sweep_producers(emit, sms)


if __name__ == "__main__":
    main()
