"""Host time of one fused-op call on the GPU machine, piece by piece: how long Python, autograd and
the launches take per call when the GPU is not the bottleneck (tiny tensors, no synchronisation
inside the timed loop). A diagnostic for NOTES-triton.md: which part of an op's launch path to
make thinner.

    python benchmarks/probes/host_path_probe.py [--calls 300] [--profile layer_norm] [--out probe.jsonl]
"""
from __future__ import annotations

import argparse
import cProfile
import json
import os
import pstats
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

import torchfuser.functional as F  # noqa: E402
from torchfuser.backends.triton import _common, gated, layer_norm, rms_norm  # noqa: E402


def host_us(fn, calls: int) -> float:
    """Median over 5 rounds of the host µs per call (the GPU is synchronised between rounds only)."""
    fn()
    torch.cuda.synchronize()
    rounds = []
    for _ in range(5):
        t0 = time.perf_counter()
        for _ in range(calls):
            fn()
        rounds.append((time.perf_counter() - t0) / calls * 1e6)
        torch.cuda.synchronize()
    return sorted(rounds)[2]


def cases():
    def t(*shape, grad=True):
        return torch.randn(*shape, device="cuda", dtype=torch.bfloat16).requires_grad_(grad)

    x, w, b = t(64, 2048), t(2048), t(2048)
    g, u = t(64, 8192), t(64, 8192)
    y, mean, rstd = layer_norm.layer_norm_fwd(x.detach(), w.detach(), b.detach(), 1e-5)
    _, rrstd = rms_norm.rms_norm_fwd(x.detach(), w.detach(), 1e-6, 0.0)

    def fwd_bwd(f, ins):
        out = f()
        dy = torch.randn_like(out)
        return lambda: torch.autograd.grad(f(), ins, dy)

    rms = lambda: F.rms_norm(x, w, 1e-6, backend="triton")  # noqa: E731
    ln = lambda: F.layer_norm(x, w, b, 1e-5, backend="triton")  # noqa: E731
    sw = lambda: F.swiglu(g, u, backend="triton")  # noqa: E731
    plain_ln = lambda: torch.nn.functional.layer_norm(x, (2048,), w, b)  # noqa: E731
    class Identity(torch.autograd.Function):
        @staticmethod
        def forward(ctx, t):
            return t.view_as(t)

        @staticmethod
        def backward(ctx, grad):
            return grad

    class IdentityAlloc(Identity):
        @staticmethod
        def backward(ctx, grad):
            torch.empty(grad.shape, device=grad.device, dtype=grad.dtype)
            return grad

    def rms_then_backward():
        F.rms_norm(x, w, 1e-6, backend="triton").backward(dy_x)
        x.grad = w.grad = None

    dy_x = torch.randn_like(x)
    return {
        "Function with a Python backward: fwd+bwd": fwd_bwd(lambda: Identity.apply(x), (x,)),
        "the same, one torch.empty in the backward": fwd_bwd(lambda: IdentityAlloc.apply(x), (x,)),
        "torch.empty (cuda)": lambda: torch.empty((64, 2048), device="cuda", dtype=torch.bfloat16),
        "rms_norm kernel fwd": lambda: rms_norm.rms_norm_fwd(x.detach(), w.detach(), 1e-6, 0.0),
        "rms_norm kernel bwd": lambda: rms_norm.rms_norm_bwd(y, x.detach(), w.detach(), rrstd, 1e-6, 0.0),
        "layer_norm kernel fwd": lambda: layer_norm.layer_norm_fwd(x.detach(), w.detach(), b.detach(), 1e-5),
        "layer_norm kernel bwd": lambda: layer_norm.layer_norm_bwd(y, x.detach(), w.detach(), b.detach(), mean, rstd, 1e-5),
        "swiglu kernel fwd": lambda: gated.swiglu_fwd(g.detach(), u.detach()),
        "rms_norm fwd": rms, "rms_norm fwd+bwd": fwd_bwd(rms, (x, w)),
        "layer_norm fwd": ln, "layer_norm fwd+bwd": fwd_bwd(ln, (x, w, b)),
        "swiglu fwd": sw, "swiglu fwd+bwd": fwd_bwd(sw, (g, u)),
        "torch layer_norm fwd+bwd": fwd_bwd(plain_ln, (x, w, b)),
        "rms_norm fwd + .backward()": rms_then_backward,
    }


STUBBED = ("rms_norm fwd", "rms_norm fwd+bwd", "layer_norm fwd+bwd", "rms_norm kernel bwd")


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--calls", type=int, default=300)
    p.add_argument("--profile", default="", help="cProfile this case's fwd+bwd, e.g. layer_norm")
    p.add_argument("--out", default=None)
    a = p.parse_args()
    rows = []
    all_cases = cases()
    for name, fn in all_cases.items():
        rows.append({"what": name, "host_us": round(host_us(fn, a.calls), 1)})
        print(json.dumps(rows[-1]), flush=True)
    # The same paths with every Triton launch replaced by nothing: Python, autograd and allocation.
    real = _common.Launcher.__call__
    _common.Launcher.__call__ = lambda self, grid, *args, **kwargs: None
    for name, fn in cases().items():
        if name in STUBBED:
            rows.append({"what": f"{name} [no launches]", "host_us": round(host_us(fn, a.calls), 1)})
            print(json.dumps(rows[-1]), flush=True)
    _common.Launcher.__call__ = real
    # Backward on the calling thread instead of autograd's CUDA worker thread: the handoff's cost.
    with torch.autograd.set_multithreading_enabled(False):
        for name in ("rms_norm fwd+bwd", "torch layer_norm fwd+bwd", "Function with a Python backward: fwd+bwd"):
            rows.append({"what": f"{name} [backward on the calling thread]",
                         "host_us": round(host_us(all_cases[name], a.calls), 1)})
            print(json.dumps(rows[-1]), flush=True)
    if a.profile:
        fn = all_cases[f"{a.profile} fwd+bwd"]
        prof = cProfile.Profile()
        prof.runcall(lambda: [fn() for _ in range(a.calls)])
        torch.cuda.synchronize()
        pstats.Stats(prof).sort_stats("tottime").print_stats(25)
    if a.out:
        with open(a.out, "w") as f:
            f.writelines(json.dumps(r) + "\n" for r in rows)


if __name__ == "__main__":
    main()
