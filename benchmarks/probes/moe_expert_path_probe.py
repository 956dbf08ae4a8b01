"""The MoE expert path piece by piece (issue 22's "expert path alone"): the grouped GEMMs' TFLOP/s against
one dense GEMM of the same total size, and the permutation (gather by expert) and the weighted combine
in GB/s against the device's copy bandwidth; then the whole experts op forward + backward. Shapes:
issue 22's two models at 4 × 2048 tokens, routed by a random router (so groups are uneven, as in training).

    python3 benchmarks/probes/moe_expert_path_probe.py --out moe-expert-path.jsonl      # GPU
    python3 benchmarks/probes/moe_expert_path_probe.py --check                          # CPU, tiny shapes
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
from torchfuser import functional as F  # noqa: E402
from torchfuser.backends.reference import grouped_mm as gmm  # noqa: E402

MODELS = {  # (experts, top-k, hidden, expert intermediate)
    "qwen3moe": (128, 8, 2048, 768),
    "olmoe": (64, 8, 2048, 1024),
}


def ms(fn, device, reps=20) -> float:
    for _ in range(3):
        fn()
    times = []
    for _ in range(reps):
        if device.type == "cuda":
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            fn()
            end.record()
            torch.cuda.synchronize()
            times.append(start.elapsed_time(end))
        else:
            t = time.perf_counter()
            fn()
            times.append(1e3 * (time.perf_counter() - t))
    return statistics.median(times)


def copy_gbps(device, n=1 << 28) -> float:
    a = torch.empty(n // 2, dtype=torch.bfloat16, device=device)
    b = torch.empty_like(a)
    return 2 * a.numel() * 2 / ms(lambda: b.copy_(a), device) / 1e6


def probe(name, tokens, device, dtype, out):
    e, k, h, inner = MODELS[name] if name in MODELS else name
    gen = torch.Generator(device=device).manual_seed(0)
    x = torch.randn(tokens, h, device=device, dtype=dtype, generator=gen)
    logits = torch.randn(tokens, e, device=device, generator=gen)
    gate_up = torch.randn(e, 2 * inner, h, device=device, dtype=dtype, generator=gen) * h ** -0.5
    down = torch.randn(e, h, inner, device=device, dtype=dtype, generator=gen) * inner ** -0.5
    weights, indices = F.moe_route(logits, k, renorm=True)
    order, offs = gmm.sort_by_expert(indices, e)
    s = tokens * k
    xs = x[order // k]  # the permuted input: one row per (token, expert) slot
    w_gu, w_d = gate_up.transpose(1, 2), down.transpose(1, 2)  # (E, H, 2I), (E, I, H): row-major per group
    hmid = torch.randn(s, inner, device=device, dtype=dtype, generator=gen)
    dense_gu, dense_d = w_gu[0].contiguous(), w_d[0].contiguous()
    rows = []
    for what, grouped, dense, flops in (
        ("gate_up", lambda: gmm.rows(xs, w_gu, offs), lambda: xs @ dense_gu, 2 * s * h * 2 * inner),
        ("down", lambda: gmm.rows(hmid, w_d, offs), lambda: hmid @ dense_d, 2 * s * inner * h),
    ):
        tg, td = ms(grouped, device), ms(dense, device)
        rows.append(dict(part=f"grouped GEMM {what}", grouped_ms=round(tg, 4), dense_ms=round(td, 4),
                         grouped_tflops=round(flops / tg / 1e9, 1), dense_tflops=round(flops / td / 1e9, 1)))
    ys = torch.randn(s, h, device=device, dtype=dtype, generator=gen)
    inv = gmm.inverse(order)
    size = x.element_size()
    bw = copy_gbps(device) if device.type == "cuda" else None
    for what, fn, moved in (
        ("permute (gather rows by expert)", lambda: x[order // k], (s * h + s * h) * size),
        ("combine (weighted sum over k, fp32)", lambda: (ys[inv].view(tokens, k, h).float() * weights[..., None]).sum(1),
         (s * h + tokens * h * 2) * size),
    ):
        t = ms(fn, device)
        rows.append(dict(part=what, ms=round(t, 4), gbps=round(moved / t / 1e6, 1),
                         copy_gbps=None if bw is None else round(bw, 1)))
    if device.type == "cuda":
        from torchfuser.backends.triton import moe as T

        t = ms(lambda: T.combine(ys, inv, tokens, k, dtype, weights=weights), device)
        moved = (s * h + tokens * h) * size
        rows.append(dict(part="combine, Triton kernel", ms=round(t, 4), gbps=round(moved / t / 1e6, 1),
                         copy_gbps=round(bw, 1)))
    xr = x.detach().requires_grad_()
    gu, dn = gate_up.detach().requires_grad_(), down.detach().requires_grad_()
    dy = torch.randn(tokens, h, device=device, dtype=dtype, generator=gen)

    flops = 3 * (2 * s * h * 2 * inner + 2 * s * inner * h)
    for backend in ("reference", "triton") if device.type == "cuda" else ("reference",):
        def whole():
            y = F.moe_experts(xr, weights, indices, gu, dn, backend=backend)
            y.backward(dy)

        t = ms(whole, device, reps=10)
        rows.append(dict(part=f"moe_experts forward + backward, {backend}", ms=round(t, 3),
                         tflops=round(flops / t / 1e9, 1), gemm_share=round(
                             sum(r["grouped_ms"] for r in rows if "grouped_ms" in r) * 3 / t, 3)))
    for r in rows:
        r.update(model=name if isinstance(name, str) else "tiny", tokens=tokens, dtype=str(dtype).removeprefix("torch."),
                 device=torch.cuda.get_device_name() if device.type == "cuda" else "cpu", torch=torch.__version__)
        print(json.dumps(r), flush=True)
        if out:
            out.write(json.dumps(r) + "\n")


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out")
    p.add_argument("--tokens", type=int, default=8192)
    p.add_argument("--check", action="store_true", help="tiny shapes on the CPU (a smoke run)")
    args = p.parse_args()
    out = open(args.out, "a") if args.out else None
    if args.check:
        probe((8, 2, 64, 32), 64, torch.device("cpu"), torch.float32, out)
        return
    for name in MODELS:
        probe(name, args.tokens, torch.device("cuda"), torch.bfloat16, out)


if __name__ == "__main__":
    main()
