"""The RMSNorms as FP8 producers (backends/triton/norm_fp8.py), and what the both-ways writer's divisions
cost, on one GPU.

1. Norm producers at a llama1b decoder layer's shapes (8192 tokens × 2048, an fp32 residual stream and
   bf16 outputs): each producer against its plain kernel plus the atomic amax pass it replaces (the
   forward over programs a SM ``_FWD_PER_SM``), each bit-checked against the plain kernel's outputs.
2. The both-ways writer (``_fp8_quant_both_kernel``, run 134's largest quantisation cost: 11.7 ms a step
   at ≈ 54 % of the copy bandwidth) against two variants defined here, never shipped: each element
   multiplied by a per-row / per-column reciprocal instead of two IEEE divisions (``recip``: a different
   rounding, so its bits are counted, not required), and no scaling at all (``bound``: the memory and
   transposition cost alone); and against a bf16 copy of the same bytes. Run 136 found ``recip`` at the
   bound, 1.4-2× the writer's speed, so since run 137 the shipped formula is the multiplier (``default``
   and ``recip`` then differ only in the scales the writer stores).

    PYTHONPATH=$PWD python benchmarks/probes/fp8_norm_producer_probe.py --out probe.jsonl   # GPU, ≈ 1 min
"""
from __future__ import annotations

import argparse
import sys

import torch
import triton
import triton.language as tl
from _emit import emitter

DEVICE = "cuda"  # (a CPU check of the probe itself: "cpu" under TRITON_INTERPRET=1)

def _bench(fn):
    from triton.testing import do_bench

    return do_bench(fn, warmup=10, rep=50, return_mode="median")


def _same(a, b):
    return all(x is None and y is None or torch.equal(x.view(torch.uint8), y.view(torch.uint8)) for x, y in zip(a, b))


def _amax_pass(t):
    """The atomic amax pass alone, as fp8_quantize_both runs it before the writer."""
    from torchfuser.backends.triton import fp8_quant as K

    a, b = t.shape
    (grid, per_prog, warps), _ = K.both_config(a, b, K._sms(t), False)
    amax = torch.zeros(a + b, dtype=torch.int32, device=t.device)
    K._amax_both(grid, t, amax, a, b, t.stride(0), per_prog, BLOCK_A=K._BLOCK_A, BLOCK_B=K._BLOCK_B,
                 TENSORWISE=False, num_warps=warps)
    return amax


def norms(emit, m=8192, n=2048):
    from torchfuser.backends.triton import norm_fp8 as P, rms_norm as N

    x = torch.randn(m, n, device=DEVICE)
    r = torch.randn(m, n, device=DEVICE, dtype=torch.bfloat16)
    w = 1 + 0.1 * torch.randn(n, device=DEVICE)
    dy = torch.randn(m, n, device=DEVICE, dtype=torch.bfloat16)
    s, y, rstd = N.add_rms_norm_fwd(x, r, w, 1e-6, 0.0, torch.bfloat16)
    bf = x.to(torch.bfloat16)
    cases = {
        "rms_norm_fwd bf16": (lambda: N.rms_norm_fwd(bf, w, 1e-6, 0.0), lambda: P.rms_norm_fp8_fwd(bf, w, 1e-6, 0.0), 0),
        "add_rms_norm_fwd fp32+bf16": (lambda: N.add_rms_norm_fwd(x, r, w, 1e-6, 0.0, torch.bfloat16),
                                       lambda: P.add_rms_norm_fp8_fwd(x, r, w, 1e-6, 0.0, torch.bfloat16), 1),
        "add_rms_norm_bwd fp32, dr bf16": (lambda: N.add_rms_norm_bwd(dy, s, w, rstd, 1e-6, 0.0, x, torch.bfloat16),
                                           lambda: P.add_rms_norm_fp8_bwd(dy, s, w, rstd, 1e-6, 0.0, x, torch.bfloat16), 1),
    }
    for name, (plain, producer, out) in cases.items():
        want = plain()
        amax_ms = _bench(lambda: _amax_pass(want[out]))
        plain_ms = _bench(plain)
        sweep = (1, 2, 4, 8, 16) if "fwd" in name else (P._FWD_PER_SM,)
        for per_sm in sweep:
            P._FWD_PER_SM = per_sm
            got = producer()
            ok = _same(got[:-1], want) and torch.equal(got[-1], _amax_pass(want[out]))
            ms = _bench(producer)
            emit(what="norm-producer", op=name, shape=[m, n], per_sm=per_sm if "fwd" in name else None, ok=ok,
                 ms=round(ms, 4), plain_ms=round(plain_ms, 4), amax_pass_ms=round(amax_ms, 4),
                 saves_ms=round(plain_ms + amax_ms - ms, 4))
        P._FWD_PER_SM = 4


@triton.jit
def _writer_variant(X, AMAX, Q, QT, A, B, stride_x, ROWS_PER_PROG,
                    BLOCK_A: tl.constexpr, BLOCK_B: tl.constexpr, MODE: tl.constexpr):
    # fp8_quant._fp8_quant_both_kernel, rowwise, scales not stored; MODE 1: x · (448 / amax) per row and
    # per column (one division a row or column, a multiply an element); MODE 2: no scaling (the bound).
    pa, pb = tl.program_id(0), tl.program_id(1)
    cols = pb * BLOCK_B + tl.arange(0, BLOCK_B)
    col_ok = cols < B
    c_amax = tl.load(AMAX + A + cols, mask=col_ok, other=0).to(tl.float32, bitcast=True)
    c_inv = tl.math.div_rn(448.0, tl.maximum(c_amax, 1e-12))[None, :]
    first = pa.to(tl.int64) * ROWS_PER_PROG
    for r0 in range(0, ROWS_PER_PROG, BLOCK_A):
        rows = first + r0 + tl.arange(0, BLOCK_A)
        row_ok = rows < A
        mask = row_ok[:, None] & col_ok[None, :]
        x = tl.load(X + rows[:, None] * stride_x + cols[None, :], mask=mask, other=0.0).to(tl.float32)
        if MODE == 1:
            r_amax = tl.load(AMAX + rows, mask=row_ok, other=0).to(tl.float32, bitcast=True)
            r_inv = tl.math.div_rn(448.0, tl.maximum(r_amax, 1e-12))
            q = tl.clamp(x * r_inv[:, None], -448.0, 448.0).to(Q.dtype.element_ty)
            qt = tl.clamp(x * c_inv, -448.0, 448.0).to(QT.dtype.element_ty)
        else:
            q = x.to(Q.dtype.element_ty)
            qt = q
        tl.store(Q + rows[:, None] * B + cols[None, :], q, mask=mask)
        tl.store(QT + cols[:, None].to(tl.int64) * A + rows[None, :], tl.trans(qt), mask=tl.trans(mask))


def writer(emit, shape):
    from torchfuser.backends.triton import fp8_quant as K
    from torchfuser.backends.reference.fp8_quant import fp8_amax_both

    t = torch.randn(*shape, device=DEVICE).to(torch.bfloat16)
    a, b = shape
    amax = fp8_amax_both(t)
    (q0, _), (qt0, _) = K.fp8_quantize_both_amax(t, amax)
    grid, per_prog, step, warps = K.both_config(a, b, K._sms(t), False)[1]
    gbytes = a * b * 4 / 1e9  # read 2, write 1 + 1
    copy_ms = _bench(lambda: torch.empty_like(t).copy_(t))
    rows = {"default": _bench(lambda: K.fp8_quantize_both_amax(t, amax))}
    for mode, name in ((1, "recip"), (2, "bound")):
        q, qt = torch.empty_like(q0), torch.empty_like(qt0)

        def run():
            _writer_variant[grid](t, amax, q, qt, a, b, t.stride(0), per_prog, BLOCK_A=step, BLOCK_B=K._BLOCK_B,
                                  MODE=mode, num_warps=warps)
        run()
        rows[name] = _bench(run)
        if mode == 1:
            differ = (q.view(torch.uint8) != q0.view(torch.uint8)).sum().item() + \
                (qt.view(torch.uint8) != qt0.view(torch.uint8)).sum().item()
            emit(what="writer-recip-bits", shape=list(shape), differ=differ, of=2 * a * b)
    for name, ms in rows.items():
        emit(what="writer", variant=name, shape=list(shape), ms=round(ms, 4), gbps=round(gbytes / ms * 1e3, 1),
             copy_ms=round(copy_ms, 4), copy_gbps=round(gbytes / copy_ms * 1e3, 1))


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--out", default=None)
    cli = parser.parse_args()
    if not torch.cuda.is_available():
        sys.exit("needs a CUDA GPU")
    emit = emitter(cli.out, dict(gpu=torch.cuda.get_device_name(), torch=torch.__version__, triton=triton.__version__))
    torch.manual_seed(0)
    norms(emit)
    for shape in ((8192, 2048), (8192, 8192), (8192, 16384)):
        writer(emit, shape)


if __name__ == "__main__":
    main()
