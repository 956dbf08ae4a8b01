"""The MLIR backend against eager PyTorch at small and middle sizes on the CPU, forward + backward
through autograd: the demo's shapes (where the fused step is decided) and rope at three sizes.
Eager is the Hugging Face formulation of each op. A diagnostic for NOTES-mlir.md.

    python benchmarks/probes/cpu_small_ops.py
"""
from __future__ import annotations

import statistics
import time

import torch

import torchfuser.functional as F


def leaf(*shape):
    return torch.randn(*shape, requires_grad=True)


def ms(fn, inputs, calls):
    """Median ms of forward + backward (a random cotangent per output)."""
    out = fn()
    outs = out if isinstance(out, tuple) else (out,)
    cots = [torch.randn_like(o) for o in outs]
    for _ in range(3):
        torch.autograd.grad(fn(), inputs, cots)
    times = []
    for _ in range(calls):
        start = time.perf_counter()
        torch.autograd.grad(fn(), inputs, cots)
        times.append(time.perf_counter() - start)
    return statistics.median(times) * 1e3


def eager_rope(q, k, cos, sin):
    half = q.shape[-1] // 2

    def rotate(t):
        return torch.cat((-t[..., half:], t[..., :half]), -1)

    c, s = cos.unsqueeze(1), sin.unsqueeze(1)
    return q * c + rotate(q) * s, k * c + rotate(k) * s


def main():
    torch.manual_seed(0)
    x, w = leaf(4, 128, 256), leaf(256)
    g, u = leaf(4, 128, 704), leaf(4, 128, 704)
    rows = [
        ("rms_norm 4x128x256", lambda: F.rms_norm(x, w, 1e-6, backend="mlir"),
         lambda: w * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6)), (x, w)),
        ("swiglu 4x128x704", lambda: F.swiglu(g, u, backend="mlir"), lambda: torch.nn.functional.silu(g) * u, (g, u)),
    ]
    for b, hq, hk, s, d in ((4, 8, 4, 128, 32), (4, 8, 4, 512, 64), (2, 32, 8, 1024, 64)):
        q, k = leaf(b, hq, s, d), leaf(b, hk, s, d)
        cos, sin = torch.randn(b, s, d), torch.randn(b, s, d)
        rows.append((f"rope B{b} Hq{hq} Hk{hk} S{s} D{d}",
                     (lambda q, k, c, sn: lambda: F.rope(q, k, c, sn, backend="mlir"))(q, k, cos, sin),
                     (lambda q, k, c, sn: lambda: eager_rope(q, k, c, sn))(q, k, cos, sin), (q, k)))
    for name, fused, eager, inputs in rows:
        calls = 30 if inputs[0].numel() < 1 << 20 else 8
        print(f"{name:32} mlir {ms(fused, inputs, calls):8.3f} ms   eager {ms(eager, inputs, calls):8.3f} ms", flush=True)


if __name__ == "__main__":
    main()
