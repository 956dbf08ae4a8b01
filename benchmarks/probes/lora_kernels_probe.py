"""LoRA's adapter products on a bf16 base with fp32 adapters (PEFT's default), as Triton kernels that
read the bf16 tensors directly and multiply in fp32, against the PyTorch ops the fused LoRA node
runs today (casts to fp32, fp32 GEMMs, scaling, an fp32 add rounded to bf16). The run-111 profile
of llama8b-like LoRA put ≈ 150 ms of a 395 ms step in those ops (docs/performance/NOTES-train-step.md).

    python benchmarks/probes/lora_kernels_probe.py [--tokens 4096] [--out probe.jsonl]   # GPU: timings
    TRITON_INTERPRET=1 python benchmarks/probes/lora_kernels_probe.py --check              # CPU: numbers only

Per projection group (q/k/v: K = 4096 → 4096 + 2 × 1024, rank 16 each; gate/up: 4096 → 2 × 14336;
down: 14336 → 4096) it times forward (h = x·Aᵀ; y += s·h·Bᵀ) and backward (dB = s·gᵀ·h, dh = s·g·B,
dA = dhᵀ·x, dx += dh·A) both ways, and checks the kernels against float64. A diagnostic for the
next step of issue 21, not a shipped path.
"""
from __future__ import annotations

import argparse
import json
import os
import sys

import torch
import triton
import triton.language as tl

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
from torchfuser.backends.triton import _interpret  # noqa: E402

_interpret.apply()  # the interpreter's NumPy 2.4 and bf16-rounding fixes (only under TRITON_INTERPRET=1)


@triton.jit
def _x_at(X, A, H, M, K, R, sx, sa, sh, BM: tl.constexpr, BK: tl.constexpr, BR: tl.constexpr):
    """H[M, R] = X[M, K] (bf16) · A[R, K]ᵀ (fp32), in fp32."""
    m = tl.program_id(0) * BM + tl.arange(0, BM)
    r = tl.arange(0, BR)
    acc = tl.zeros([BM, BR], dtype=tl.float32)
    for k0 in tl.range(0, K, BK):
        k = k0 + tl.arange(0, BK)
        x = tl.load(X + m[:, None] * sx + k[None, :], mask=(m[:, None] < M) & (k[None, :] < K), other=0.0).to(tl.float32)
        a = tl.load(A + r[:, None] * sa + k[None, :], mask=(r[:, None] < R) & (k[None, :] < K), other=0.0)
        acc += tl.dot(x, tl.trans(a), input_precision="ieee")
    tl.store(H + m[:, None] * sh + r[None, :], acc, mask=(m[:, None] < M) & (r[None, :] < R))


@triton.jit
def _add_hb(Y, Hh, B, M, N, R, scale, sy, sh, sb, ROUND_FIRST: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr,
            BR: tl.constexpr):
    """Y[M, N] (bf16, in place) = Y + scale · H[M, R] · B[N, R]ᵀ: summed in fp32 and rounded once (PEFT's
    forward), or (ROUND_FIRST) the product rounded to Y's dtype first and then added (autograd's sum of
    two bf16 gradients in PEFT's backward)."""
    m = tl.program_id(0) * BM + tl.arange(0, BM)
    n = tl.program_id(1) * BN + tl.arange(0, BN)
    r = tl.arange(0, BR)
    h = tl.load(Hh + m[:, None] * sh + r[None, :], mask=(m[:, None] < M) & (r[None, :] < R), other=0.0)
    b = tl.load(B + n[:, None] * sb + r[None, :], mask=(n[:, None] < N) & (r[None, :] < R), other=0.0)
    prod = tl.dot(h, tl.trans(b), input_precision="ieee") * scale
    mask = (m[:, None] < M) & (n[None, :] < N)
    y = tl.load(Y + m[:, None] * sy + n[None, :], mask=mask, other=0.0)
    if ROUND_FIRST:  # PyTorch's bf16 + bf16: both as fp32, summed, rounded
        out = (y.to(tl.float32) + prod.to(Y.dtype.element_ty).to(tl.float32)).to(Y.dtype.element_ty)
    else:
        out = (y.to(tl.float32) + prod).to(Y.dtype.element_ty)
    tl.store(Y + m[:, None] * sy + n[None, :], out, mask=mask)


@triton.jit
def _g_b(G, B, DH, M, N, R, scale, sg, sb, sd, BM: tl.constexpr, BN: tl.constexpr, BR: tl.constexpr):
    """DH[M, R] = scale · G[M, N] (bf16) · B[N, R] (fp32)."""
    m = tl.program_id(0) * BM + tl.arange(0, BM)
    r = tl.arange(0, BR)
    acc = tl.zeros([BM, BR], dtype=tl.float32)
    for n0 in tl.range(0, N, BN):
        n = n0 + tl.arange(0, BN)
        g = tl.load(G + m[:, None] * sg + n[None, :], mask=(m[:, None] < M) & (n[None, :] < N), other=0.0).to(tl.float32)
        b = tl.load(B + n[:, None] * sb + r[None, :], mask=(n[:, None] < N) & (r[None, :] < R), other=0.0)
        acc += tl.dot(g, b, input_precision="ieee")
    tl.store(DH + m[:, None] * sd + r[None, :], acc * scale, mask=(m[:, None] < M) & (r[None, :] < R))


@triton.jit
def _gt_h(G, Hh, DB, M, N, R, scale, sg, sh, sd, BM: tl.constexpr, BN: tl.constexpr, BR: tl.constexpr):
    """DB[N, R] = scale · G[M, N]ᵀ (bf16) · H[M, R] (fp32): the same form computes dA = DHᵀ·X with
    G = X, H = DH (then DB is dAᵀ, N × R)."""
    n = tl.program_id(0) * BN + tl.arange(0, BN)
    r = tl.arange(0, BR)
    acc = tl.zeros([BN, BR], dtype=tl.float32)
    for m0 in tl.range(0, M, BM):
        m = m0 + tl.arange(0, BM)
        g = tl.load(G + m[:, None] * sg + n[None, :], mask=(m[:, None] < M) & (n[None, :] < N), other=0.0).to(tl.float32)
        h = tl.load(Hh + m[:, None] * sh + r[None, :], mask=(m[:, None] < M) & (r[None, :] < R), other=0.0)
        acc += tl.dot(tl.trans(g), h, input_precision="ieee")
    tl.store(DB + n[:, None] * sd + r[None, :], acc * scale, mask=(n[:, None] < N) & (r[None, :] < R))


def _br(r):
    return max(16, triton.next_power_of_2(r))


def kernels_fwd(x, a, b, y, s):
    """h = x·aᵀ (fp32); y += s·h·bᵀ in place (rounded once)."""
    m, k = x.shape
    r, n = a.shape[0], b.shape[0]
    h = torch.empty(m, r, device=x.device, dtype=torch.float32)
    _x_at[(triton.cdiv(m, 32),)](x, a, h, m, k, r, x.stride(0), a.stride(0), h.stride(0), BM=32, BK=64, BR=_br(r))
    _add_hb[(triton.cdiv(m, 64), triton.cdiv(n, 64))](y, h, b, m, n, r, s, y.stride(0), h.stride(0), b.stride(0),
                                                        ROUND_FIRST=False, BM=64, BN=64, BR=_br(r))
    return h


def kernels_bwd(g, x, h, a, b, dx, s):
    """(dA, dB) and dx += bf16(dh·a) in place."""
    m, n = g.shape
    k, r = x.shape[1], a.shape[0]
    dh = torch.empty(m, r, device=g.device, dtype=torch.float32)
    _g_b[(triton.cdiv(m, 32),)](g, b, dh, m, n, r, s, g.stride(0), b.stride(0), dh.stride(0), BM=32, BN=64, BR=_br(r))
    db = torch.empty(n, r, device=g.device, dtype=torch.float32)
    _gt_h[(triton.cdiv(n, 64),)](g, h, db, m, n, r, s, g.stride(0), h.stride(0), db.stride(0), BM=64, BN=64, BR=_br(r))
    dat = torch.empty(k, r, device=g.device, dtype=torch.float32)
    _gt_h[(triton.cdiv(k, 64),)](x, dh, dat, m, k, r, 1.0, x.stride(0), dh.stride(0), dat.stride(0), BM=64, BN=64, BR=_br(r))
    at = a.t().contiguous()  # k × r: the "B" of dx's product (small)
    _add_hb[(triton.cdiv(m, 64), triton.cdiv(k, 64))](dx, dh, at, m, k, r, 1.0, dx.stride(0), dh.stride(0), at.stride(0),
                                                        ROUND_FIRST=True, BM=64, BN=64, BR=_br(r))
    return dat.t(), db


def torch_fwd(x, a, b, y, s):
    """What the fused LoRA node runs today (modules/adapters/lora.py): fp32 casts and GEMMs, fp32 add, rounded."""
    h = torch.mm(x.to(torch.float32), a.t())
    y.copy_(y.to(torch.float32) + torch.mm(h, b.t()).mul_(s))
    return h


def torch_bwd(g, x, h, a, b, dx, s):
    g32 = g.to(torch.float32)
    db = torch.mm(g32.t(), h).mul_(s)
    dh = torch.mm(g32, b).mul_(s)
    da = torch.mm(dh.t(), x.to(torch.float32))
    dx += torch.mm(dh, a).to(dx.dtype)
    return da, db


def _inputs(m, k, n, r, device, seed=0):
    gen = torch.Generator(device="cpu").manual_seed(seed)
    rnd = lambda *s: torch.randn(*s, generator=gen)  # noqa: E731
    return dict(x=rnd(m, k).bfloat16().to(device), a=(rnd(r, k) / k ** 0.5).to(device), b=(rnd(n, r) / r).to(device),
                y=rnd(m, n).bfloat16().to(device), g=rnd(m, n).bfloat16().to(device), dx=rnd(m, k).bfloat16().to(device))


def check(m=37, k=200, n=150, r=12, device="cpu") -> dict:
    """Largest error of kernels and torch ops against float64, forward and backward."""
    t, s = _inputs(m, k, n, r, device), 2.0
    x64, a64, b64 = t["x"].double(), t["a"].double(), t["b"].double()
    h64 = x64 @ a64.t()
    y64 = t["y"].double() + s * h64 @ b64.t()
    g64 = t["g"].double()
    dh64 = s * g64 @ b64
    want = dict(h=h64, y=y64, da=dh64.t() @ x64, db=s * g64.t() @ h64, dx=t["dx"].double() + dh64 @ a64.double())
    out = {}
    for name, fwd, bwd in (("kernels", kernels_fwd, kernels_bwd), ("torch", torch_fwd, torch_bwd)):
        y, dx = t["y"].clone(), t["dx"].clone()
        h = fwd(t["x"], t["a"], t["b"], y, s)
        da, db = bwd(t["g"], t["x"], h, t["a"], t["b"], dx, s)
        got = dict(h=h, y=y, da=da, db=db, dx=dx)
        out[name] = {key: float((got[key].double() - want[key]).abs().max() / want[key].abs().max()) for key in want}
    return out


def time_group(name, m, k, n, r, rep):
    from triton.testing import do_bench

    t, s = _inputs(m, k, n, r, "cuda"), 2.0
    row = {"group": name, "tokens": m, "in": k, "out": n, "rank": r}
    for label, fwd, bwd in (("kernels", kernels_fwd, kernels_bwd), ("torch", torch_fwd, torch_bwd)):
        h = fwd(t["x"], t["a"], t["b"], t["y"], s)
        row[f"{label}_fwd_ms"] = round(do_bench(lambda: fwd(t["x"], t["a"], t["b"], t["y"], s), rep=rep), 4)
        row[f"{label}_bwd_ms"] = round(do_bench(lambda: bwd(t["g"], t["x"], h, t["a"], t["b"], t["dx"], s), rep=rep), 4)
    return row


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--tokens", type=int, default=4096)
    p.add_argument("--check", action="store_true", help="only the numerics check (runs under TRITON_INTERPRET=1)")
    p.add_argument("--out", default=None)
    a = p.parse_args()
    device = "cuda" if torch.cuda.is_available() else "cpu"
    rows = [{"check": check(device=device)}]
    print(json.dumps(rows[0]), flush=True)
    if not a.check:
        # llama8b's groups at rank 16: q/k/v (3 adapters: one A GEMM of rank 48; the B's here as one rank-48
        # product over all 6144 columns, 3× their real work, an upper bound), gate/up likewise, o, down.
        for name, k, n, r in (("qkv", 4096, 6144, 48), ("o", 4096, 4096, 16), ("gate_up", 4096, 28672, 32),
                              ("down", 14336, 4096, 16)):
            row = time_group(name, a.tokens, k, n, r, rep=50)
            rows.append(row)
            print(json.dumps(row), flush=True)
    if a.out:
        with open(a.out, "w") as f:
            f.writelines(json.dumps(r) + "\n" for r in rows)


if __name__ == "__main__":
    main()
