"""FP8 quantisation of the GEMM operands: the Triton kernels (backends/triton/fp8_quant.py) against the
PyTorch passes modules/fp8/__init__.py ran before them (t.float(), abs, amax, clamp_min, two divisions, clamp_,
.to(e4m3); plus ``t.t().contiguous()`` for dW's operands), at llama1b-like training shapes (4 × 2048
tokens, hidden 2048, intermediate 8192, GQA 32/8 heads of 64), and the four FP8 projections' forward +
backward with the old and the new quantisation. ``fp8_quantize_both`` (an operand both ways from two
reads: x, dy and the weights of every trainable projection) against the rowwise and rowwise-t kernels
it replaces, run one after the other.

    python benchmarks/probes/fp8_quant_probe.py --out fp8-quant.jsonl            # GPU: ≈ 30-45 s on an H200
    python benchmarks/ops.py --device cuda --ops fp8                              # the same
    python benchmarks/probes/fp8_quant_probe.py --inductor --out ...              # + torch.compile'd PyTorch code
    TRITON_INTERPRET=1 python benchmarks/probes/fp8_quant_probe.py --check        # CPU: numbers only, small shapes

One JSON line per measurement:
- ``what: "quant"``: op (rowwise, rowwise-t = dW's transposed operand, tensorwise, tensorwise-t), shape,
  old_ms, new_ms (and inductor_ms), speedup, new_gbps = (bytes read once + fp8 written) / time, against
  ``copy_gbps`` (a bf16 tensor copied: read + write);
- ``what: "check"``: the kernels' bits against the formula computed exactly (true divisions: on CUDA the
  old path's ``amax / 448.0`` multiplies by fp32(1/448), so its scales may differ by one ulp; counted
  as old_scale_diffs / old_q_diffs), e4m3 rounding ties, NaN/inf rows; ``ok`` must be true;
- ``what: "both"``: operand, shape, tensorwise, pair_ms (the rowwise then the rowwise-t kernels,
  the switch fp8_rowwise_both = "pair"), and per one-call path its ms, speedup over the pair and
  GB/s = (2 reads of t + 2 e4m3 copies written) / time, against copy_gbps: rowwise rows_tiles_* and
  atomic_*, tensorwise both_*; so one run says which rowwise path to keep;
- ``what: "projection"``: one FP8 projection (the fused module's autograd Function) forward + backward,
  ms: old_ms (the PyTorch passes), pair_ms (the kernels, both ways as two calls), new_ms (fp8_quantize_both);
  tflops (its three GEMMs' work over new_ms) and the same projection in bf16 under autocast (bf16_ms,
  bf16_tflops); graph_ms and bf16_graph_ms: the same two steps captured in a CUDA graph and replayed,
  the GPU's time alone (a narrow projection's eager call is host-bound), and graph_speedup, bf16's over FP8's;
- ``what: "peak"``: one 8192³ FP8 GEMM (rowwise scales, bf16 out) and one bf16 GEMM, in TFLOP/s: the
  rates the projections' TFLOP/s compare with; ``"peak-blockwise"``: the same FP8 GEMM with blockwise
  scales (1 × 128 by 128 × 128, and 1 × 128 by 1 × 128), or the error where this build has none;
- ``what: "blocks"``: blockwise quantisation of each operand (both copies, one read) against rowwise's
  both-ways path, GB/s = (t read once + 2 e4m3 copies) / time;
- ``what: "producer"``: the packed SwiGLU forward / backward taking its output's maxima (an FP8 producer)
  against the plain kernel, alone (ms, GB/s over its own bytes) and with the operand's quantisation after
  it (plain_then_both_ms: the atomic both-ways path; producer_then_writer_ms: the writer from the maxima).
"""
from __future__ import annotations

import argparse
import contextlib
import os
import platform
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # benchmarks/
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))  # benchmarks/probes/
from _emit import emitter  # noqa: E402
from ops import graphed  # noqa: E402  (fn captured in a CUDA graph: its replay times the GPU's work alone)

from torchfuser.backends.reference.fp8_quant import rounding_cases  # noqa: E402
from torchfuser.switches import SWITCHES  # noqa: E402

E4M3 = torch.float8_e4m3fn
MODES = {"rowwise": (False, False), "rowwise-t": (False, True), "tensorwise": (True, False), "tensorwise-t": (True, True)}
# llama1b-like at 4 × 2048 tokens: (tokens, features) of each GEMM operand that is quantised per call.
TOKENS = 8192
OPERANDS = {"x (qkv, o, gate/up in)": (TOKENS, 2048), "dy qkv": (TOKENS, 3072), "x down": (TOKENS, 8192),
            "dy gate/up": (TOKENS, 16384)}
PROJECTIONS = {"qkv": (2048, 3072), "o": (2048, 2048), "gate_up": (2048, 16384), "down": (8192, 2048)}  # K → N
SMALL = {"a": (64, 128), "b": (123, 123), "c": (48, 8192), "d": (1, 64)}


def old_quantize(t, tensorwise: bool, transpose: bool):
    """modules/fp8/__init__.py's quantisation before the kernels, verbatim (its dW operands: transposed copies)."""
    if transpose:
        t = t.t().contiguous()
    t32 = t.float()
    amax = t32.abs().amax() if tensorwise else t32.abs().amax(dim=-1, keepdim=True)
    scale = amax.clamp_min(1e-12) / 448.0
    return (t32 / scale).clamp_(-448.0, 448.0).to(E4M3), scale


def exact_quantize(t, tensorwise: bool, transpose: bool):
    """The formula (backends/reference/fp8_quant.py's: the scale and its multiplier 448 / amax, true
    divisions, then a multiply an element) on any device (tensor operands: CUDA's division by a Python
    scalar multiplies by its reciprocal)."""
    s = t.t() if transpose else t
    t32 = s.float()
    amax = t32.abs().amax() if tensorwise else t32.abs().amax(dim=-1, keepdim=True)
    a, e4m3_max = amax.clamp_min(1e-12), torch.full_like(amax, 448.0)
    return (t32 * (e4m3_max / a)).clamp_(-448.0, 448.0).to(E4M3).contiguous(), a / e4m3_max


def _diffs(a, b):
    """(differing e4m3 values, differing scales), NaN equal to NaN."""
    (q, s), (qr, sr) = a, b
    qn, qrn = q.float().isnan(), qr.float().isnan()
    dq = int(((q.view(torch.uint8) != qr.view(torch.uint8)) & ~(qn & qrn)).sum())
    ds = int(((s != sr) & ~(s.isnan() & sr.isnan())).sum())
    return dq, ds


def _operand(m, k, device, dtype=torch.bfloat16, seed=0):
    g = torch.Generator(device=device).manual_seed(seed)
    rows = torch.exp(2 * torch.randn(m, 1, generator=g, device=device))
    cols = torch.exp(torch.randn(1, k, generator=g, device=device))
    return (torch.randn(m, k, generator=g, device=device) * rows * cols).to(dtype)


def _special(device):
    """Rows holding 448 (scale exactly 1) and every e4m3 midpoint ± 1 fp32 ulp; NaN, inf and zero rows."""
    ties = rounding_cases()
    odd = torch.randn(8, 96)
    odd[0, 3], odd[1, 1], odd[2, 2], odd[3] = float("nan"), float("inf"), -float("inf"), 0.0
    return {"ties": ties.to(device), "nan-inf-zero": odd.to(device)}


def check(emit, device, shapes):
    from torchfuser.backends.triton import fp8_quant as K

    ok_all = True
    cases = {name: _operand(m, k, device) for name, (m, k) in shapes.items()}
    cases.update({f"{name}-fp32": _operand(m, k, device, dtype=torch.float32) for name, (m, k) in SMALL.items()})
    base = _operand(64, 300, device)
    cases.update({"row-strided": base[:, 7:200], "transposed-view": base[:, :96].t()})
    cases.update(_special(device))
    for name, t in cases.items():
        for op, (tw, tr) in MODES.items():
            if name == "ties" and op != "rowwise":
                continue
            new = K.fp8_quantize(t, tw, tr)
            exact = exact_quantize(t, tw, tr)
            dq, ds = _diffs(new, exact)
            oq, os_ = _diffs(new, old_quantize(t, tw, tr))
            ok = dq == 0 and ds == 0 and new[0].shape == exact[0].shape and new[0].is_contiguous()
            ok_all &= ok
            emit(what="check", case=name, shape=list(t.shape), dtype=str(t.dtype).removeprefix("torch."), op=op,
                 ok=ok, q_diffs=dq, scale_diffs=ds, old_q_diffs=oq, old_scale_diffs=os_)
        for tw, path in ((False, "rows+tiles"), (False, "atomic"), (True, None)):
            with _rowwise_both(path):
                both = K.fp8_quantize_both(t, tw)
            diffs = [_diffs(got, exact_quantize(t, tw, tr)) for got, tr in zip(both, (False, True))]
            ok = all(d == (0, 0) for d in diffs) and all(g[0].is_contiguous() for g in both)
            ok_all &= ok
            emit(what="check", case=name, shape=list(t.shape), dtype=str(t.dtype).removeprefix("torch."),
                 op="both-tensorwise" if tw else f"both-{path}", ok=ok, q_diffs=sum(d[0] for d in diffs),
                 scale_diffs=sum(d[1] for d in diffs))
    return check_blocks(emit, device) and ok_all


def check_blocks(emit, device) -> bool:
    """The blockwise kernels' bits against the reference's computed on the CPU (true divisions; on CUDA
    PyTorch's amax / 448 multiplies by fp32(1/448): run 126's check against a CUDA reference differed by
    that ulp), activations both ways and weights, fp32 and bf16, a NaN in one block."""
    from torchfuser.backends.reference import fp8_blocks as R
    from torchfuser.backends.triton import fp8_blocks as KB

    ok_all = True
    for (m, k) in ((128, 128), (256, 384), (1024, 2048)):
        for dtype in (torch.bfloat16, torch.float32):
            t = _operand(m, k, device, dtype=dtype)
            if m == 256:
                t[3, 200] = float("nan")
            cpu = t.cpu()
            for op, got, want in (("blocks", KB.fp8_quantize_blocks(t, True, True), R.fp8_quantize_blocks(cpu, True, True)),
                                  ("weight-blocks", KB.fp8_quantize_weight_blocks(t), R.fp8_quantize_weight_blocks(cpu))):
                got = tuple(g.cpu() for g in got)
                diffs = [_diffs((got[i], got[i + 1]), (want[i], want[i + 1])) for i in (0, 2)]
                dq, ds = sum(d[0] for d in diffs), sum(d[1] for d in diffs)
                strides = all(g.stride() == w.stride() for g, w in zip(got, want))
                ok = dq == 0 and ds == 0 and strides
                ok_all &= ok
                emit(what="check", case=f"blocks-{m}x{k}", shape=[m, k], dtype=str(dtype).removeprefix("torch."), op=op,
                     ok=ok, q_diffs=dq, scale_diffs=ds, strides_ok=strides)
    return ok_all


@contextlib.contextmanager
def _rowwise_both(path):
    """Within: fp8_quantize_both's rowwise path is ``path`` (None: left as it is)."""
    from torchfuser.switches import switched

    with switched(fp8_rowwise_both=path or SWITCHES.fp8_rowwise_both):
        yield


def _bench(fn, device):
    if device == "cpu":
        t0 = time.perf_counter()
        fn()
        return (time.perf_counter() - t0) * 1e3
    from triton.testing import do_bench

    return do_bench(fn, warmup=10, rep=60, return_mode="median")


def time_quant(emit, device, inductor: bool):
    from torchfuser.backends.triton import fp8_quant as K

    big = torch.empty(TOKENS * 16384, dtype=torch.bfloat16, device=device)
    dst = torch.empty_like(big)
    copy_ms = _bench(lambda: dst.copy_(big), device)
    copy_gbps = 2 * big.numel() * 2 / copy_ms / 1e6
    del big, dst
    emit(what="copy", gbps=round(copy_gbps, 1))
    compiled = {}
    for name, (m, k) in OPERANDS.items():
        t = _operand(m, k, device)
        for op, (tw, tr) in MODES.items():
            old_ms = _bench(lambda: old_quantize(t, tw, tr), device)
            new_ms = _bench(lambda: K.fp8_quantize(t, tw, tr), device)
            row = dict(what="quant", operand=name, shape=[m, k], op=op, old_ms=round(old_ms, 4), new_ms=round(new_ms, 4),
                       speedup=round(old_ms / new_ms, 2), new_gbps=round(m * k * 3 / new_ms / 1e6, 1),
                       copy_gbps=round(copy_gbps, 1))
            if inductor and op in ("rowwise", "rowwise-t") and name in ("x down", "dy gate/up"):
                fn = compiled.setdefault(op, torch.compile(lambda t, tw=tw, tr=tr: old_quantize(t, tw, tr), dynamic=False))
                fn(t)
                row["inductor_ms"] = round(_bench(lambda: fn(t), device), 4)
            emit(**row)
        for tw in (False, True):
            pair_ms = _bench(lambda: (K.fp8_quantize(t, tw, False), K.fp8_quantize(t, tw, True)), device)
            row = dict(what="both", operand=name, shape=[m, k], tensorwise=tw, pair_ms=round(pair_ms, 4),
                       copy_gbps=round(copy_gbps, 1), default=SWITCHES.fp8_rowwise_both if not tw else "both-kernels")
            # rowwise: each one-call path ("pair" is pair_ms); tensorwise: its both-ways kernels
            for path in (("rows+tiles", "atomic") if not tw else (None,)):
                with _rowwise_both(path):
                    ms = _bench(lambda: K.fp8_quantize_both(t, tw), device)
                key = (path or "both").replace("+", "_")
                row.update({f"{key}_ms": round(ms, 4), f"{key}_speedup": round(pair_ms / ms, 2),
                            f"{key}_gbps": round(m * k * (2 * t.element_size() + 2) / ms / 1e6, 1)})
            emit(**row)
        time_blocks(emit, device, name, t, copy_gbps)
        del t
    w = torch.randn(16384, 2048, device=device)  # gate/up's fp32 master weight, both copies per call
    time_blocks(emit, device, "W gate/up (fp32)", w, copy_gbps, weight=True)
    del w
    time_producers(emit, device, copy_gbps)


def time_producers(emit, device, copy_gbps):
    """The packed SwiGLU forward and backward as FP8 producers (backends/triton/gated_fp8.py): each kernel
    alone against the plain one (GB/s over its own bytes, against copy_gbps: what the maxima cost it), and
    with the quantisation after it (the both-ways writer from the maxima, against the atomic both-ways
    path over the plain output): what a step saves per operand."""
    from torchfuser.backends.triton import fp8_quant as K, gated as G, gated_fp8 as P

    n = PROJECTIONS["down"][0]
    gu, dy = _operand(TOKENS, 2 * n, device), _operand(TOKENS, n, device, seed=1)
    cases = {"swiglu fwd (h for down)": ((gu,), G.swiglu_packed_fwd, P.swiglu_packed_fp8_fwd, 6 * n),
             "swiglu bwd ([dg | du] for gate/up)": ((dy, gu), G.swiglu_packed_bwd, P.swiglu_packed_fp8_bwd, 10 * n)}
    for name, (args, plain, producer, row_bytes) in cases.items():
        plain_ms, producer_ms = _bench(lambda: plain(*args), device), _bench(lambda: producer(*args), device)
        out, amax = producer(*args)
        both_ms = _bench(lambda: (K.fp8_quantize_both(plain(*args), False)), device)
        fused_ms = _bench(lambda: K.fp8_quantize_both_amax(*producer(*args)), device)
        emit(what="producer", op=name, shape=list(out.shape), plain_ms=round(plain_ms, 4),
             producer_ms=round(producer_ms, 4), plain_gbps=round(TOKENS * row_bytes / plain_ms / 1e6, 1),
             producer_gbps=round(TOKENS * row_bytes / producer_ms / 1e6, 1), copy_gbps=round(copy_gbps, 1),
             plain_then_both_ms=round(both_ms, 4), producer_then_writer_ms=round(fused_ms, 4),
             saved_ms=round(both_ms - fused_ms, 4))
        del out, amax


def time_blocks(emit, device, name, t, copy_gbps, weight=False):
    """Blockwise quantisation (fp8="blockwise"), both copies from one read, against rowwise's both-ways path."""
    from torchfuser.backends.triton import fp8_blocks as KB, fp8_quant as K

    m, k = t.shape
    ms = _bench(lambda: KB.fp8_quantize_weight_blocks(t) if weight else KB.fp8_quantize_blocks(t, True, True), device)
    rowwise_ms = _bench(lambda: K.fp8_quantize_both(t, False), device)
    emit(what="blocks", operand=name, shape=[m, k], ms=round(ms, 4), rowwise_both_ms=round(rowwise_ms, 4),
         speedup=round(rowwise_ms / ms, 2), gbps=round(m * k * (t.element_size() + 2) / ms / 1e6, 1),
         copy_gbps=round(copy_gbps, 1))


def gemm_peaks(emit, device, n: int = 8192):
    """The dense GEMM rates a projection is judged against: one n³ FP8 GEMM (e4m3, rowwise scales,
    bf16 out: what the projections call) and one bf16 GEMM."""
    a = torch.randn(n, n, device=device).to(torch.float8_e4m3fn)
    b = torch.randn(n, n, device=device).to(torch.float8_e4m3fn)
    sa, sb = torch.ones(n, 1, device=device), torch.ones(1, n, device=device)
    fp8_ms = _bench(lambda: torch._scaled_mm(a, b.t(), scale_a=sa, scale_b=sb, out_dtype=torch.bfloat16), device)
    x = torch.randn(n, n, device=device, dtype=torch.bfloat16)
    bf16_ms = _bench(lambda: x @ x, device)
    flops = 2 * n ** 3
    emit(what="peak", n=n, fp8_tflops=round(flops / fp8_ms / 1e9, 1), bf16_tflops=round(flops / bf16_ms / 1e9, 1))
    # Blockwise scaling (DeepSeek-V3's: 1 × 128 blocks along K for activations, 128 × 128 for weights),
    # the recipe whose local scales would let a producer write both e4m3 copies in one pass (NOTES-fp8.md):
    # the rate it runs at decides whether it is worth building. Scale layouts as ATen's checks ask.
    blocks = n // 128
    rows_1x128 = torch.ones(blocks, n, device=device).t()  # (n, n/128), strides (1, n)
    w_128x128 = torch.ones(n // 128, -(-blocks // 4) * 4, device=device).t()  # (round_up(n/128, 4), n/128)
    for name, sb, recipe_b in (("1x128_128x128", w_128x128, "BlockWise128x128"), ("1x128_1x128", rows_1x128, "BlockWise1x128")):
        try:
            from torch.nn.functional import ScalingType, scaled_mm

            def run(sb=sb, recipe_b=recipe_b):
                return scaled_mm(a, b.t(), rows_1x128, ScalingType.BlockWise1x128, sb, getattr(ScalingType, recipe_b),
                                 output_dtype=torch.bfloat16)
            run()
            emit(what="peak-blockwise", n=n, scaling=name, tflops=round(flops / _bench(run, device) / 1e9, 1))
        except (ImportError, RuntimeError, ValueError, TypeError, NotImplementedError) as err:
            emit(what="peak-blockwise", n=n, scaling=name, error=f"{type(err).__name__}: {str(err)[:200]}")


def time_projections(emit, device):
    from torchfuser.modules import fp8

    new_quantize, new_both = fp8.quantize, fp8.quantize_both

    def old(t, recipe, transpose=False):
        return old_quantize(t, recipe == "tensorwise", transpose)

    def old_both(t, recipe, amax=None):  # (no producer in this probe passes maxima)
        return old(t, recipe), old(t, recipe, True)

    def pair(t, recipe, amax=None):
        return new_quantize(t, recipe), new_quantize(t, recipe, transpose=True)

    for name, (k, n) in PROJECTIONS.items():
        x = _operand(TOKENS, k, device).requires_grad_()
        w = (torch.randn(n, k, device=device) * k ** -0.5).requires_grad_()  # fp32 master weight
        dy = _operand(TOKENS, n, device, seed=1)
        def bf16_step():  # the same projection as autocast runs it: bf16 GEMMs of the fp32 weight's cast
            with torch.autocast(device, dtype=torch.bfloat16):
                y = torch.nn.functional.linear(x, w)
            y.backward(dy)
            x.grad = w.grad = None

        bf16_step()
        bf16_ms = _bench(bf16_step, device)
        bf16_graph_ms = _bench(graphed(bf16_step), device)
        for recipe in fp8.RECIPES:
            cache = fp8._Weights()

            def step():  # the weight is trainable: quantised both ways at every call, as in training
                y = fp8._FP8Linear.apply(x, recipe, cache, torch.bfloat16, 1, w)
                y.backward(dy)
                x.grad = w.grad = None

            times = {}
            # blockwise has no older forms: its own kernels only
            ways = (("old", old, old_both), ("pair", new_quantize, pair)) if recipe != "blockwise" else ()
            try:
                for label, q, b in (*ways, ("new", new_quantize, new_both)):
                    fp8.quantize, fp8.quantize_both = q, b
                    try:
                        step()
                        times[label] = _bench(step, device)
                    finally:
                        fp8.quantize, fp8.quantize_both = new_quantize, new_both
                graph_ms = _bench(graphed(step), device)
            except (RuntimeError, ValueError, NotImplementedError) as err:  # blockwise GEMMs missing in this build
                emit(what="projection", proj=name, recipe=recipe, error=f"{type(err).__name__}: {str(err)[:200]}")
                continue
            flops = 3 * 2 * TOKENS * k * n  # the forward GEMM and the backward's two
            ratio = lambda label: round(times[label] / times["new"], 2) if label in times else None  # noqa: E731
            emit(what="projection", proj=name, tokens=TOKENS, k=k, n=n, recipe=recipe,
                 old_ms=round(times["old"], 3) if "old" in times else None,
                 pair_ms=round(times["pair"], 3) if "pair" in times else None, new_ms=round(times["new"], 3),
                 speedup=ratio("old"), speedup_over_pair=ratio("pair"),
                 tflops=round(flops / times["new"] / 1e9, 1), bf16_ms=round(bf16_ms, 3),
                 bf16_tflops=round(flops / bf16_ms / 1e9, 1), graph_ms=round(graph_ms, 3),
                 bf16_graph_ms=round(bf16_graph_ms, 3), graph_speedup=round(bf16_graph_ms / graph_ms, 2))
        del x, w, dy


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--out", default=None, help="JSON lines here (and on stdout)")
    parser.add_argument("--check", action="store_true", help="numbers only, small shapes (the CPU, under TRITON_INTERPRET=1)")
    parser.add_argument("--inductor", action="store_true", help="also time torch.compile of the PyTorch code")
    args = parser.parse_args()
    device = "cuda" if torch.cuda.is_available() else "cpu"
    if device == "cpu" and os.environ.get("TRITON_INTERPRET", "0") in ("", "0"):
        sys.exit("no GPU: run with TRITON_INTERPRET=1 and --check")
    env = dict(device=device, gpu=torch.cuda.get_device_name() if device == "cuda" else platform.processor(),
               torch=torch.__version__, python=platform.python_version())
    try:
        import triton
        env["triton"] = triton.__version__
    except ImportError:
        pass

    emit = emitter(args.out, env)

    t0 = time.time()
    ok = check(emit, device, SMALL if args.check or device == "cpu" else {**SMALL, **OPERANDS})
    if not args.check and device == "cuda":
        gemm_peaks(emit, device)
        time_quant(emit, device, args.inductor)
        time_projections(emit, device)
    emit(what="done", ok=ok, seconds=round(time.time() - t0, 1))
    sys.exit(0 if ok else 1)


if __name__ == "__main__":
    main()
