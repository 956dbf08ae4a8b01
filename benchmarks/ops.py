"""Per-op benchmark: each fused op, forward and forward+backward, against eager PyTorch and
torch.compile of the same math, with and without CUDA graphs (``--interleave N``: ours against
torch.compile alone, timed in alternation, for a same-run verdict that drift cannot decide).

    python benchmarks/ops.py --device cuda [--out results.jsonl] [--ops rms_norm,rope] [--budget 240]
    python benchmarks/ops.py --device cuda --ops moe   # the MoE expert path (benchmarks/probes/moe_expert_path_probe.py)
    python benchmarks/ops.py --device cuda --ops fp8   # FP8 quantisation and projections (benchmarks/probes/fp8_quant_probe.py)

Baselines are the reference backend's *definitions* (plain PyTorch, backends/reference/*.py),
run eagerly and through torch.compile (inductor fuses them; compiling the custom op itself
would only wrap an opaque call). For linear_cross_entropy the baseline is what a model runs:
nn.Linear in the input dtype, then F.cross_entropy on fp32 logits, backpropagated from 1 as
``loss.backward()`` does (the other ops' backward starts from random cotangents).

Bandwidth: bytes that must move (each input read once, each output written once; fwd+bwd adds
the backward's reads and writes) over the median time, against a device-to-device copy measured
in the same run (bytes read + written). linear_cross_entropy is compute-bound: TFLOP/s instead.
Prints a table last and one JSON line per row.
"""
from __future__ import annotations

import argparse
import json
import math
import os
import statistics
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import torch
import torch.nn.functional as TF

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torchfuser.functional as F  # noqa: E402
from torchfuser.backends.reference import activation as Ract  # noqa: E402
from torchfuser.backends.reference import gated as Rg  # noqa: E402
from torchfuser.backends.reference import layer_norm as Rln  # noqa: E402
from torchfuser.backends.reference import rms_norm as Rrms  # noqa: E402
from torchfuser.backends.reference import rope as Rrope  # noqa: E402


@dataclass
class Case:
    op: str
    shape: str
    dtype: torch.dtype
    inputs: list  # tensors that require grad
    plain: Callable  # plain PyTorch: inputs -> output(s)
    fused: Callable  # torchfuser functional, backend='triton'
    bytes_fwd: int
    bytes_bwd: int
    flops_fwd: int = 0
    flops_bwd: int = 0


def _t(*shape, dtype, device, scale=1.0):
    return (torch.randn(*shape, device=device, dtype=torch.float32) * scale).to(dtype).requires_grad_()


def _add_then_rms_norm(x, r, w):
    s = x + r
    return s, Rrms.rms_norm(s, w, 1e-6, 0.0)[0]


def make_cases(device: str, dtype=torch.bfloat16, which: str = "real", ops: set | None = None) -> list[Case]:
    """'real': the shapes of llama1b-like training at 4×2048 tokens (launch-bound for small ops);
    'large': bigger memory-bound sizes for the bandwidth target; 'tiny': CPU smoke sizes."""
    M, N, I, V = {"real": (8192, 2048, 8192, 128256), "large": (32768, 4096, 16384, 128256),
                  "tiny": (64, 128, 256, 1000)}[which]
    b = torch.finfo(dtype).bits // 8
    cases = []
    want = lambda name: ops is None or name in ops  # noqa: E731
    if want("rms_norm"):
        x, w = _t(M, N, dtype=dtype, device=device), _t(N, dtype=dtype, device=device)
        cases.append(Case("rms_norm", f"{M}x{N}", dtype, [x, w], lambda x, w: Rrms.rms_norm(x, w, 1e-6, 0.0)[0],
                          lambda x, w: F.rms_norm(x, w, 1e-6, backend="triton"), 2 * M * N * b, 3 * M * N * b))
    if want("add_rms_norm"):
        # A residual add and the norm after it, as in a decoder layer under autocast: the fp32 residual
        # stream plus a low-precision projection output; s and the norm's output in fp32.
        x, r, w = _t(M, N, dtype=torch.float32, device=device), _t(M, N, dtype=dtype, device=device), _t(N, dtype=torch.float32, device=device)
        cases.append(Case("add_rms_norm", f"{M}x{N}", dtype, [x, r, w], _add_then_rms_norm,
                          lambda x, r, w: F.add_rms_norm(x, r, w, 1e-6, backend="triton"), (12 + b) * M * N, (16 + b) * M * N))
    if want("layer_norm"):
        x, w, bb = _t(M, N, dtype=dtype, device=device), _t(N, dtype=dtype, device=device), _t(N, dtype=dtype, device=device)
        cases.append(Case("layer_norm", f"{M}x{N}", dtype, [x, w, bb], lambda x, w, b: Rln.layer_norm(x, w, b, 1e-5)[0],
                          lambda x, w, b: F.layer_norm(x, w, b, 1e-5, backend="triton"), 2 * M * N * b, 3 * M * N * b))
    for name, plain in (("swiglu", Rg.swiglu), ("geglu", Rg.geglu)):
        if want(name):
            g, u = _t(M, I, dtype=dtype, device=device), _t(M, I, dtype=dtype, device=device)
            cases.append(Case(name, f"{M}x{I}", dtype, [g, u], plain,
                              (lambda n: lambda g, u: getattr(F, n)(g, u, backend="triton"))(name), 3 * M * I * b, 5 * M * I * b))
    if want("gelu"):
        x = _t(M, I, dtype=dtype, device=device)
        cases.append(Case("gelu", f"{M}x{I}", dtype, [x], lambda x: Rg.gelu(x, "tanh"),
                          lambda x: F.gelu(x, "tanh", backend="triton"), 2 * M * I * b, 3 * M * I * b))
    if want("activation"):  # squared ReLU (Nemotron's, Persimmon's plain MLP)
        x = _t(M, I, dtype=dtype, device=device)
        cases.append(Case("activation", f"relu2 {M}x{I}", dtype, [x], lambda x: Ract.activation(x, "relu2"),
                          lambda x: F.activation(x, "relu2", backend="triton"), 2 * M * I * b, 3 * M * I * b))
    if want("rope"):
        B, S, Hq, Hk, D = (4, M // 4, 32, 8, 64) if which != "tiny" else (2, 16, 4, 2, 16)
        # q, k as attention modules make them: B×S×H×D projections viewed as B×H×S×D.
        q = _t(B, S, Hq, D, dtype=dtype, device=device)
        k = _t(B, S, Hk, D, dtype=dtype, device=device)
        cos, sin = torch.randn(1, S, D, device=device).to(dtype), torch.randn(1, S, D, device=device).to(dtype)
        qk = (Hq + Hk) * B * S * D * b
        cases.append(Case("rope", f"B{B}xHq{Hq}xHk{Hk}xS{S}xD{D}", dtype, [q, k],
                          lambda q, k: Rrope.rope(q.transpose(1, 2), k.transpose(1, 2), cos, sin),
                          lambda q, k: F.rope(q.transpose(1, 2), k.transpose(1, 2), cos, sin, backend="triton"),
                          2 * qk, 2 * qk))
    if want("linear_cross_entropy"):
        Ntok, H = (M, N) if which != "large" else (8192, 4096)
        h, w = _t(Ntok, H, dtype=dtype, device=device), _t(V, H, dtype=dtype, device=device, scale=H**-0.5)
        labels = torch.randint(0, V, (Ntok,), device=device)
        plain = lambda h, w: TF.cross_entropy(TF.linear(h, w).float(), labels)  # noqa: E731
        fused = lambda h, w: F.linear_cross_entropy(h, w, labels, backend="triton")  # noqa: E731
        cases.append(Case("linear_cross_entropy", f"{Ntok}x{H}x{V}", dtype, [h, w], plain, fused,
                          (Ntok * H + V * H) * b, (Ntok * H + V * H) * b, 2 * Ntok * H * V, 4 * Ntok * H * V))
    return cases


# ------------------------------------------------------------------------------------ timing

def bench(fn: Callable, device: str) -> float:
    """Median milliseconds."""
    if device == "cuda":
        import triton.testing

        return triton.testing.do_bench(fn, warmup=25, rep=100, return_mode="median")
    for _ in range(3):  # warm-up: first calls compile / allocate
        fn()
    times = []
    for _ in range(7):
        t0 = time.perf_counter()
        fn()
        times.append((time.perf_counter() - t0) * 1e3)
    return statistics.median(times)


def copy_bandwidth(device: str) -> float:
    """GB/s of a large device-to-device copy, counting bytes read + written."""
    n = (1 << 30) if device == "cuda" else (1 << 26)
    src = torch.empty(n, dtype=torch.uint8, device=device).random_()
    dst = torch.empty_like(src)
    ms = bench(lambda: dst.copy_(src), device)
    return 2 * n / ms / 1e6  # src and dst are freed on return


def graphed(fn: Callable) -> Callable:
    """fn captured once into a CUDA graph; returns the replay."""
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        for _ in range(3):
            fn()
    torch.cuda.current_stream().wait_stream(s)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        fn()
    return g.replay


def runners(case: Case, fn: Callable, mode: str) -> Callable:
    if mode == "fwd":
        def run():
            with torch.no_grad():
                return fn(*case.inputs)
        return run
    out = fn(*case.inputs)
    outs = out if isinstance(out, tuple) else (out,)
    # A loss (a 0-dim output) is backpropagated from 1, as loss.backward() does; other outputs from noise.
    cots = [torch.ones_like(o) if o.dim() == 0 else torch.randn_like(o) for o in outs]

    def run():
        o = fn(*case.inputs)
        return torch.autograd.grad(o if isinstance(o, tuple) else (o,), case.inputs, cots)
    return run


def main(argv=None) -> list[dict]:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu", choices=["cpu", "cuda"])
    p.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float16", "float32"])
    p.add_argument("--sizes", default=None, help="real | large | tiny (default: real on cuda, tiny on cpu)")
    p.add_argument("--ops", default=None, help="comma-separated subset")
    p.add_argument("--variants", default="eager,compile,triton")
    p.add_argument("--no-graphs", action="store_true", help="skip the CUDA-graph replays")
    p.add_argument("--budget", type=float, default=float("inf"), help="seconds; later compile variants are skipped past it")
    p.add_argument("--out", default=None, help="write one JSON line per row to this file")
    p.add_argument("--interleave", type=int, default=0, metavar="ROUNDS",
                   help="instead: each op's fwd+bwd, triton against compile, timed in alternation ROUNDS times")
    p.add_argument("--profile-dir", default=None, help="with --interleave: also a GPU kernel table of each")
    a = p.parse_args(argv)
    start = time.monotonic()
    dtype = getattr(torch, a.dtype)
    sizes = a.sizes or ("real" if a.device == "cuda" else "tiny")
    variants = a.variants.split(",")
    if a.device == "cpu" and "triton" in variants and not os.environ.get("TRITON_INTERPRET"):
        variants.remove("triton")  # Triton runs on the CPU only under its (slow) interpreter
    bw = copy_bandwidth(a.device)
    meta = dict(device=torch.cuda.get_device_name() if a.device == "cuda" else "cpu", torch=torch.__version__,
                copy_gbps=round(bw, 1), date=time.strftime("%Y-%m-%d"))
    try:
        import triton

        meta["triton"] = triton.__version__
    except ImportError:
        pass
    print(json.dumps({"meta": meta}), flush=True)
    ops = set(a.ops.split(",")) if a.ops else None
    if ops and "fp8" in ops:  # FP8 quantisation kernels (GB/s vs copy) and projections (TFLOP/s vs the FP8 GEMM's)
        ops.discard("fp8")
        _fp8_probe(a.device, a.out)
        if not ops:
            return []
    if ops and "moe" in ops:  # the expert path piece by piece: its own probe (grouped GEMMs vs dense, GB/s vs copy)
        ops.discard("moe")
        _moe_expert_path(a.device, dtype, a.out)
        if not ops:
            return []
    cases = make_cases(a.device, dtype, sizes, ops)
    if a.interleave:
        return interleaved(cases, a.interleave, a.device, not a.no_graphs, a.out, meta, a.profile_dir)
    rows = []
    out = open(a.out, "a") if a.out else None
    for case in cases:
        eager_ms = {}
        for variant in variants:
            if variant == "compile" and time.monotonic() - start > a.budget:
                print(f"# {case.op}: compile skipped (past the {a.budget:.0f}s budget)", flush=True)
                continue
            fn = {"eager": case.plain, "compile": torch.compile(case.plain), "triton": case.fused}[variant]
            for mode in ("fwd", "fwd+bwd"):
                for graphs in ([False] if a.device != "cuda" or a.no_graphs else [False, True]):
                    row = dict(op=case.op, shape=case.shape, dtype=a.dtype, mode=mode, variant=variant, graphs=graphs)
                    try:
                        run = runners(case, fn, mode)
                        ms = bench(graphed(run) if graphs else run, a.device)
                    except Exception as e:  # a variant that cannot run (or capture) is reported, not fatal
                        row.update(error=f"{type(e).__name__}: {str(e)[:160]}")
                        print(json.dumps(row), flush=True)
                        rows.append(row)
                        continue
                    finally:
                        if a.device == "cuda":
                            torch.cuda.synchronize()
                    nbytes = case.bytes_fwd + (case.bytes_bwd if mode == "fwd+bwd" else 0)
                    row.update(ms=round(ms, 4), gbps=round(nbytes / ms / 1e6, 1), pct_copy=round(100 * nbytes / ms / 1e6 / bw, 1))
                    if case.flops_fwd:
                        flops = case.flops_fwd + (case.flops_bwd if mode == "fwd+bwd" else 0)
                        row["tflops"] = round(flops / ms / 1e9, 1)
                    key = (mode, graphs)
                    if variant == "eager":
                        eager_ms[key] = ms
                    elif key in eager_ms:
                        row["x_eager"] = round(eager_ms[key] / ms, 2)
                    print(json.dumps(row), flush=True)
                    rows.append(row)
                    if out:
                        out.write(json.dumps({**meta, **row}) + "\n")
                        out.flush()
        del case
        if a.device == "cuda":
            torch.cuda.empty_cache()
    if out:
        out.close()
    _table(rows)
    return rows


def _fp8_probe(device: str, out_path):
    """``--ops fp8``: benchmarks/probes/fp8_quant_probe.py (bit checks, then on a GPU the quantisation
    kernels in GB/s against the copy and each FP8 projection's forward + backward in TFLOP/s against one
    large FP8 GEMM and against the bf16 projection), in a process of its own (it exits with its verdict)."""
    import subprocess

    probe = Path(__file__).resolve().parent / "probes" / "fp8_quant_probe.py"
    args = [sys.executable, str(probe)] + (["--out", out_path] if out_path else [])
    if device == "cpu":
        args.append("--check")
    env = {**os.environ, "TRITON_INTERPRET": "1"} if device == "cpu" else None
    subprocess.run(args, check=True, env=env)


def _moe_expert_path(device: str, dtype, out_path):
    """``--ops moe``: benchmarks/probes/moe_expert_path_probe.py at Qwen3-30B-A3B's and OLMoE's shapes
    (8192 tokens; tiny shapes on the CPU): grouped GEMMs in TFLOP/s against one dense GEMM of the same
    size, permutation and combine in GB/s against the copy, the experts op forward + backward per backend."""
    sys.path.insert(0, str(Path(__file__).resolve().parent / "probes"))
    import moe_expert_path_probe as probe

    out = open(out_path, "a") if out_path else None
    try:
        if device == "cpu":
            probe.probe((8, 2, 64, 32), 64, torch.device("cpu"), torch.float32, out)
        else:
            for name in probe.MODELS:
                probe.probe(name, 8192, torch.device(device), dtype, out)
    finally:
        if out:
            out.close()


def interleaved(cases, rounds: int, device: str, graphs: bool, out_path, meta, profile_dir=None) -> list[dict]:
    """fwd+bwd of triton and torch.compile timed alternately, the order swapped every round, so
    that clock and thermal drift over a run fall on both alike: one row per op and graph mode with
    both medians, the median of the per-round ratios and how many rounds triton won."""
    rows = []
    for case in cases:
        fns = {"triton": case.fused, "compile": torch.compile(case.plain)}
        for graph in [False, True] if graphs and device == "cuda" else [False]:
            runs = {name: (graphed if graph else (lambda f: f))(runners(case, fn, "fwd+bwd")) for name, fn in fns.items()}
            times = {name: [] for name in runs}
            for i in range(rounds):
                for name in (("triton", "compile") if i % 2 == 0 else ("compile", "triton")):
                    times[name].append(bench(runs[name], device))
            ratios = [c / t for t, c in zip(times["triton"], times["compile"])]
            row = dict(op=case.op, shape=case.shape, mode="fwd+bwd", graphs=graph, rounds=rounds,
                       triton_ms=round(statistics.median(times["triton"]), 4),
                       compile_ms=round(statistics.median(times["compile"]), 4),
                       compile_over_triton=round(statistics.median(ratios), 4),
                       triton_faster_rounds=sum(r > 1 for r in ratios),
                       triton_all=[round(t, 3) for t in times["triton"]], compile_all=[round(t, 3) for t in times["compile"]])
            print(json.dumps(row), flush=True)
            rows.append(row)
            if profile_dir and not graph:
                for name, run in runs.items():
                    _profile(run, Path(profile_dir) / f"{case.op}-{name}.txt")
            del runs
        if device == "cuda":
            torch.cuda.empty_cache()
    if out_path:
        with open(out_path, "a") as f:
            f.writelines(json.dumps({**meta, **r}) + "\n" for r in rows)
    return rows


def _profile(run: Callable, path: Path) -> None:
    """Three calls of ``run`` (after a warm one) under the profiler: its kernels by GPU time."""
    from profiling import profiled, write_tables

    run()
    write_tables(profiled(run, torch.device("cuda"), 3), path, ("self_cuda_time_total",), 30, 80)


def _table(rows: list[dict]) -> None:
    print(f"\n{'op':<22}{'mode':<9}{'variant':<9}{'graph':<6}{'ms':>9}{'GB/s':>9}{'%copy':>7}{'TF/s':>7}{'x eager':>9}")
    for r in rows:
        if "error" in r:
            print(f"{r['op']:<22}{r['mode']:<9}{r['variant']:<9}{str(r['graphs'])[0]:<6}  {r['error'][:60]}")
            continue
        print(f"{r['op']:<22}{r['mode']:<9}{r['variant']:<9}{str(r['graphs'])[0]:<6}{r['ms']:>9.4f}{r['gbps']:>9.0f}"
              f"{r['pct_copy']:>7.1f}{r.get('tflops', math.nan):>7.1f}{r.get('x_eager', math.nan):>9.2f}")


if __name__ == "__main__":
    main()
