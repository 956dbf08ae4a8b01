"""GPU check of the Triton backend at real sizes: every op's forward and every gradient against
the reference backend run in float64 on the GPU, with the docs/numerics.md rule
    max|fused − ref64| ≤ 2 · max|torch_same_dtype − ref64| + atol·max(1, max|ref64|),
then Triton timings (median ms, GB/s vs the measured copy bandwidth) at memory-bound sizes and
the extra peak memory of linear_cross_entropy.

    PYTHONPATH=$PWD python benchmarks/gpu_check_triton.py [--out results.jsonl] [--quick]
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time

import torch
import torch.nn.functional as TF

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torchfuser.functional as F  # noqa: E402
from ops import bench, copy_bandwidth, make_cases, runners  # noqa: E402

ATOL = {torch.float32: 1e-5, torch.bfloat16: 1e-2, torch.float16: 1e-3}
DEV = "cuda"
RESULTS: list[dict] = []


def emit(row):
    RESULTS.append(row)
    print(json.dumps(row), flush=True)


def _poison():
    # Fill freed allocator blocks with NaN so that an output element the kernel forgot to write
    # shows up as non-finite instead of as a stale correct value.
    t = torch.full((1 << 30,), float("nan"), device=DEV)
    del t


def run(fn, leaves, dtype, make):
    xs = [t.detach().to(dtype).requires_grad_() if t.is_floating_point() else t for t in leaves]
    used = [make[i](t) if i in make else t for i, t in enumerate(xs)]
    outs = fn(*used)
    outs = outs if isinstance(outs, tuple) else (outs,)
    g = torch.Generator(device=DEV).manual_seed(1)
    cots = [torch.randn(o.shape, device=DEV, generator=g).to(o.dtype) for o in outs]
    req = [t for t in xs if t.is_floating_point()]
    grads = torch.autograd.grad(outs, req, cots)
    return [o.detach() for o in outs] + list(grads)


def check(name, op_fn, leaves, dtype, torch_fn=None, make=None):
    try:
        _check(name, op_fn, leaves, dtype, torch_fn, make)
    except Exception as e:  # keep going: one broken op must not hide the others' results
        emit(dict(check=name, dtype=str(dtype)[6:], ok=False, error=f"{type(e).__name__}: {str(e)[:300]}"))
        torch.cuda.empty_cache()


def _check(name, op_fn, leaves, dtype, torch_fn, make):
    make = make or {}
    t0 = time.time()
    ref = run(lambda *a: op_fn(*a, backend="reference"), leaves, torch.float64, make)
    same = run(torch_fn or (lambda *a: op_fn(*a, backend="reference")), leaves, dtype, make)
    _poison()
    got = run(lambda *a: op_fn(*a, backend="triton"), leaves, dtype, make)
    ok_all, detail = True, []
    for i, (g, s, r) in enumerate(zip(got, same, ref)):
        err = (g.double() - r).abs().max().item()
        base = (s.double() - r).abs().max().item()
        atol = ATOL[g.dtype] * max(1.0, r.abs().max().item())
        ok = bool(torch.isfinite(g).all()) and err <= 2 * base + atol and g.dtype == s.dtype
        ok_all &= ok
        detail.append(dict(i=i, err=float(f"{err:.3e}"), torch_err=float(f"{base:.3e}"), atol=float(f"{atol:.1e}"), ok=ok))
    emit(dict(check=name, dtype=str(dtype)[6:], ok=ok_all, outputs=detail, s=round(time.time() - t0, 1)))
    del ref, same, got
    torch.cuda.empty_cache()


def r(*shape, scale=1.0, shift=0.0):
    return torch.randn(*shape, device=DEV) * scale + shift


def correctness(quick: bool):
    bf, f32 = torch.bfloat16, torch.float32
    norm_shapes = [((8192, 2048), bf), ((8192, 4096), bf), ((4096, 16384), bf), ((8192, 2048), f32),
                   ((1, 4096), bf), ((37, 123), bf), ((256, 20000), bf),
                   ((32768, 4096), bf), ((32768, 2048), f32)]  # ≥ 64 row tiles a program: pipelined backward
    if quick:
        norm_shapes = norm_shapes[:1]
    rowstrided = {0: lambda t: torch.cat([t, t[..., :8].detach()], -1)[..., : t.shape[-1]]}
    for shape, dt in norm_shapes:
        n = shape[-1]
        check(f"rms_norm{shape}", lambda x, w, backend: F.rms_norm(x, w, 1e-6, offset=0.0, backend=backend),
              [r(*shape), r(n)], dt)
        check(f"rms_norm{shape} offset=1", lambda x, w, backend: F.rms_norm(x, w, 1e-6, offset=1.0, backend=backend),
              [r(*shape), r(n, scale=0.1)], dt)
        check(f"layer_norm{shape}", lambda x, w, b, backend: F.layer_norm(x, w, b, 1e-5, backend=backend),
              [r(*shape, shift=0.5), r(n), r(n)], dt)
    check("rms_norm(8192,2048) row-strided", lambda x, w, backend: F.rms_norm(x, w, backend=backend),
          [r(8192, 2048), r(2048)], bf, make=rowstrided)
    check("layer_norm(8192,2048) no bias", lambda x, w, backend: F.layer_norm(x, w, None, backend=backend),
          [r(8192, 2048), r(2048)], bf)
    for op in ("swiglu", "geglu"):
        check(f"{op}(8192,8192)", lambda g, u, backend, op=op: getattr(F, op)(g, u, backend=backend),
              [r(8192, 8192, scale=2), r(8192, 8192)], bf)
        check(f"{op}(8192,2x8192 halves)", lambda gu, backend, op=op: getattr(F, op)(*gu.chunk(2, -1), backend=backend),
              [r(8192, 16384, scale=2)], bf)
        check(f"{op}(8192,2x8192 packed)", lambda gu, backend, op=op: getattr(F, op)(gu, backend=backend),
              [r(4, 2048, 16384, scale=2)], bf)
    for approx in ("none", "tanh"):
        check(f"gelu-{approx}(8192,8192)", lambda x, backend, a=approx: F.gelu(x, a, backend=backend),
              [r(8192, 8192, scale=3)], bf)
    check("swiglu(8192,8192) fp32", lambda g, u, backend: F.swiglu(g, u, backend=backend),
          [r(8192, 8192, scale=2), r(8192, 8192)], f32)
    B, S, Hq, Hk, D = 4, 2048, 32, 8, 64
    cos, sin = r(1, S, D), r(1, S, D)
    tr = {0: lambda t: t.transpose(1, 2), 1: lambda t: t.transpose(1, 2)}
    for dt in (bf, f32):
        check(f"rope B{B} Hq{Hq} Hk{Hk} S{S} D{D} (transposed q,k)",
              lambda q, k, backend: F.rope(q, k, cos.to(q.dtype), sin.to(q.dtype), backend=backend),
              [r(B, S, Hq, D), r(B, S, Hk, D)], dt, make=tr)
    cos2, sin2 = r(2, 512, 128), r(2, 512, 128)
    check("rope D128 cos per batch", lambda q, k, backend: F.rope(q, k, cos2.to(q.dtype), sin2.to(q.dtype), backend=backend),
          [r(2, 16, 512, 128), r(2, 4, 512, 128)], bf)
    # linear + cross-entropy at the llama1b LM-head size. The same-dtype baseline is a bf16
    # nn.Linear + F.cross_entropy (the reference backend upcasts its matrix products to fp32).
    N, H, V = (8192, 2048, 128256) if not quick else (1024, 512, 32000)
    labels = torch.randint(0, V, (N,), device=DEV)
    labels[::7] = -100

    def lce(h, w, backend, softcap=None):
        return F.linear_cross_entropy(h, w, labels, softcap=softcap, backend=backend)

    def plain(h, w, softcap=None):
        z = TF.linear(h, w).float()
        if softcap is not None:
            z = torch.tanh(z / softcap) * softcap
        return TF.cross_entropy(z, labels)

    check(f"linear_cross_entropy {N}x{H}x{V}", lce, [r(N, H), r(V, H, scale=H**-0.5 * 2)], bf, torch_fn=plain)
    check(f"linear_cross_entropy {N}x{H}x{V} softcap=30",
          lambda h, w, backend: lce(h, w, backend, 30.0), [r(N, H), r(V, H, scale=H**-0.5 * 4)], bf,
          torch_fn=lambda h, w: plain(h, w, 30.0))
    # Column V − 5000 about 48 nats above every other logit, and the label of every third token:
    # most rows raise the CE kernel's reference past the first block and rescale their start.
    u = torch.nn.functional.normalize(r(H), dim=0)
    w_far = r(V, H, scale=H**-0.5 * 2)
    w_far[V - 5000] += 12 * u
    labels_far = labels.clone()
    labels_far[1::3] = V - 5000

    def far(h, w, backend):
        return F.linear_cross_entropy(h, w, labels_far, backend=backend)

    check(f"linear_cross_entropy {N}x{H}x{V} far row max", far, [r(N, H) + 4 * u, w_far], bf,
          torch_fn=lambda h, w: TF.cross_entropy(TF.linear(h, w).float(), labels_far))


def lce_memory():
    """Extra peak memory of forward+backward beyond the inputs, for triton and the bf16 baseline."""
    N, H, V = 8192, 2048, 128256
    h = (torch.randn(N, H, device=DEV) * 1.0).bfloat16().requires_grad_()
    w = (torch.randn(V, H, device=DEV) * H**-0.5).bfloat16().requires_grad_()
    labels = torch.randint(0, V, (N,), device=DEV)
    fns = {"triton": lambda: F.linear_cross_entropy(h, w, labels, backend="triton"),
           "eager": lambda: TF.cross_entropy(TF.linear(h, w).float(), labels)}
    for name, fn in fns.items():
        torch.autograd.grad(fn(), (h, w))  # warm-up
        torch.cuda.synchronize()
        torch.cuda.empty_cache()
        base = torch.cuda.memory_allocated()
        torch.cuda.reset_peak_memory_stats()
        gh, gw = torch.autograd.grad(fn(), (h, w))
        torch.cuda.synchronize()
        peak = torch.cuda.max_memory_allocated() - base
        grads = gh.numel() * 2 + gw.numel() * 2
        emit(dict(memory="linear_cross_entropy 8192x2048x128256 bf16 fwd+bwd", variant=name,
                  extra_peak_gib=round(peak / 2**30, 3), of_which_grads_gib=round(grads / 2**30, 3)))
        del gh, gw


def timings(bw):
    for which in ("real", "large"):
        for case in make_cases(DEV, torch.bfloat16, which):
            for mode in ("fwd", "fwd+bwd"):
                try:
                    ms = bench(runners(case, case.fused, mode), DEV)
                except Exception as e:
                    emit(dict(time=case.op, shape=case.shape, mode=mode, error=str(e)[:200]))
                    continue
                nbytes = case.bytes_fwd + (case.bytes_bwd if mode == "fwd+bwd" else 0)
                row = dict(time=case.op, shape=case.shape, mode=mode, ms=round(ms, 4),
                           gbps=round(nbytes / ms / 1e6), pct_copy=round(100 * nbytes / ms / 1e6 / bw, 1))
                if case.flops_fwd:
                    row["tflops"] = round((case.flops_fwd + (case.flops_bwd if mode == "fwd+bwd" else 0)) / ms / 1e9, 1)
                emit(row)
            del case
            torch.cuda.empty_cache()


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--out", default=None)
    p.add_argument("--quick", action="store_true")
    p.add_argument("--skip", default="", help="comma-separated: correctness,memory,timings")
    a = p.parse_args()
    import triton

    torch.manual_seed(0)
    bw = copy_bandwidth(DEV)
    emit(dict(meta=dict(device=torch.cuda.get_device_name(), torch=torch.__version__, triton=triton.__version__,
                        date=time.strftime("%Y-%m-%d %H:%M"), copy_gbps=round(bw, 1))))
    skip = set(a.skip.split(","))
    if "correctness" not in skip:
        correctness(a.quick)
    if "memory" not in skip:
        try:
            lce_memory()
        except Exception as e:
            emit(dict(memory="linear_cross_entropy", error=f"{type(e).__name__}: {str(e)[:300]}"))
    if "timings" not in skip:
        timings(bw)
    bad = [x["check"] for x in RESULTS if "check" in x and not x["ok"]]
    print(f"\n{len([x for x in RESULTS if 'check' in x])} checks, {len(bad)} failed: {bad}")
    for x in RESULTS:
        if "time" in x and "ms" in x:
            print(f"{x['time']:<22}{x['shape']:<28}{x['mode']:<9}{x['ms']:>9.4f} ms{x['gbps']:>7} GB/s{x['pct_copy']:>6}%"
                  + (f"{x['tflops']:>7} TF/s" if "tflops" in x else ""))
        elif "memory" in x:
            print(x)
    if a.out:
        with open(a.out, "w") as f:
            for x in RESULTS:
                f.write(json.dumps(x) + "\n")


if __name__ == "__main__":
    main()
