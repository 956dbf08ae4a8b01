"""The fused LoRA node on a bf16 base with fp32 adapters (PEFT's default), no autocast: its hi/lo bf16
GEMMs (modules/adapters/lora.py) against the same node with PEFT's dtypes (the switch ``lora_split_bf16`` off, ``torchfuser.switches``: fp32
copies of y's columns, dy and x, fp32 SIMT GEMMs), PEFT's own layers and the frozen bases alone.

    python benchmarks/probes/lora_node_probe.py [--tokens 4096] [--rank 16] [--out probe.jsonl]   # GPU
    python benchmarks/probes/lora_node_probe.py --check                                           # CPU, small

Groups (llama8b-like, r = 16 on every projection): q/k/v 4096 → 4096 + 2 × 1024, o 4096 → 4096,
gate/up 4096 → 2 × 14336, down 14336 → 4096. Per group and variant: forward and forward + backward
(dx and every adapter gradient, ``torch.autograd.grad``) in ms, CUDA events, median of --iters after
--warmup, and the peak memory above the inputs. The numerics check, per group, against the same PEFT
layers in float64 on the same device: y and dx within DESIGN.md's rule (≤ 2 · PEFT's error + 1e-6);
every adapter gradient within 2 · PEFT's error + 2⁻¹⁵ of its largest value (the split's bound: x and dy
are exact bf16 here, so PEFT's fp32 gradients are fp32-accurate). One JSON line per row; exit 1 when
a check fails. Under 60 s on an H200 (most of it the float64 reference).
"""
from __future__ import annotations

import argparse
import copy
import json
import os
import statistics
import sys
import time

import torch
from torch import nn

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
from torchfuser.modules.adapters import lora  # noqa: E402
from torchfuser.switches import switched  # noqa: E402

GROUPS = {"qkv": (4096, (4096, 1024, 1024)), "o": (4096, (4096,)), "gate_up": (4096, (14336, 14336)),
          "down": (14336, (4096,))}
SMALL = {"qkv": (64, (64, 16, 16)), "o": (64, (64,)), "gate_up": (64, (224, 224)), "down": (224, (64,))}


def build(d, outs, rank, device):
    """A PEFT model over bf16 nn.Linears p0, p1, ... (frozen), LoRA r=rank (fp32, B random: a trained state)."""
    import peft
    torch.manual_seed(0)
    holder = nn.Module()
    names = [f"p{i}" for i in range(len(outs))]
    for n, o in zip(names, outs):
        lin = nn.Linear(d, o, bias=False, device=device, dtype=torch.bfloat16)
        nn.init.normal_(lin.weight, std=d ** -0.5)
        setattr(holder, n, lin)
    cfg = peft.LoraConfig(r=rank, lora_alpha=2 * rank, target_modules=names, lora_dropout=0.0, init_lora_weights=False)
    model = peft.get_peft_model(holder, cfg)
    linears = [getattr(model.base_model.model, n) for n in names]
    assert linears[0].lora_A["default"].weight.dtype == torch.float32
    return model, linears


def variant_fn(name, model, linears, x, dy):
    """fwd(): the outputs; step(): forward and backward (dx, every trainable gradient)."""
    params = [p for p in model.parameters() if p.requires_grad]
    rows = [m.out_features for m in linears]
    if name == "peft":
        def fwd():
            return [m(x) for m in linears]
    else:
        def fwd():
            with switched(lora_split_bf16=name != "peft-dtypes"):
                if name == "base":
                    with model.disable_adapter():
                        return [lora.joint(x, linears, None)]
                return [lora.joint(x, linears, None)]
    inputs = [x] + ([] if name == "base" else params)

    def step():
        ys = fwd()
        grads = dy.split(rows, dim=-1) if len(ys) > 1 else [dy]
        return torch.autograd.grad(ys, inputs, grads)
    return fwd, step


def timed(fn, device, warmup, iters):
    """Median ms of fn(); CUDA events on the GPU, perf_counter elsewhere."""
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(iters):
        if device.type == "cuda":
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            fn()
            end.record()
            end.synchronize()
            times.append(start.elapsed_time(end))
        else:
            t0 = time.perf_counter()
            fn()
            times.append((time.perf_counter() - t0) * 1e3)
    return statistics.median(times)


def peak_mib(fn, device):
    if device.type != "cuda":
        return None
    torch.cuda.synchronize()
    base = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    fn()
    torch.cuda.synchronize()
    return round((torch.cuda.max_memory_allocated() - base) / 2 ** 20, 1)


def err(a, b):
    return (a.double() - b.double()).abs().max().item()


def check(group, model, linears, x, dy):
    """Rows of the numerics check: fused (hi/lo) and PEFT against float64 on the same device."""
    ref = copy.deepcopy(model).double()
    ref_linears = [getattr(ref.base_model.model, f"p{i}") for i in range(len(linears))]
    names = [n for n, p in model.named_parameters() if p.requires_grad]

    def grads(mod, lins, xx, gy, fused):
        params = [p for p in mod.parameters() if p.requires_grad]
        xx = xx.detach().requires_grad_(True)
        y = lora.joint(xx, lins, None) if fused else torch.cat([m(xx) for m in lins], -1)
        return (y.detach(), *torch.autograd.grad(y, [xx, *params], gy))

    r64 = grads(ref, ref_linears, x.double(), dy.double(), False)
    peft_ = grads(model, linears, x, dy, False)
    fused = grads(model, linears, x, dy, True)
    del ref
    rows = []
    for k, what in enumerate(["y", "dx", *names]):
        e_f, e_p, mag = err(fused[k], r64[k]), err(peft_[k], r64[k]), r64[k].abs().max().item()
        atol = 1e-6 if k < 2 else 2 ** -15 * mag
        rows.append({"group": group, "check": what.replace("base_model.model.", ""), "fused_err": e_f, "peft_err": e_p,
                     "max_abs": mag, "bound": 2 * e_p + atol, "ok": bool(e_f <= 2 * e_p + atol)})
    return rows


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--tokens", type=int, default=4096)
    p.add_argument("--rank", type=int, default=16)
    p.add_argument("--warmup", type=int, default=5)
    p.add_argument("--iters", type=int, default=25)
    p.add_argument("--groups", default=",".join(GROUPS))
    p.add_argument("--check", action="store_true", help="small shapes on the CPU: numerics and one timing pass")
    p.add_argument("--no-check", action="store_true", help="timings only")
    p.add_argument("--out", default=None)
    a = p.parse_args()
    device = torch.device("cuda" if torch.cuda.is_available() and not a.check else "cpu")
    shapes = SMALL if a.check else GROUPS
    tokens = 64 if a.check else a.tokens
    warmup, iters = (1, 3) if a.check else (a.warmup, max(a.iters, 20))
    rows, ok = [], True
    out = open(a.out, "w") if a.out else None

    def emit(row):
        print(json.dumps(row), flush=True)
        if out:
            out.write(json.dumps(row) + "\n")
    emit({"device": torch.cuda.get_device_name() if device.type == "cuda" else "cpu", "torch": torch.__version__,
          "tokens": tokens, "rank": a.rank, "iters": iters})
    for group in a.groups.split(","):
        d, outs = shapes[group]
        model, linears = build(d, outs, a.rank, device)
        gen = torch.Generator(device=device).manual_seed(1)
        x = torch.randn(tokens, d, device=device, generator=gen).bfloat16().requires_grad_(True)
        dy = torch.randn(tokens, sum(outs), device=device, generator=gen).bfloat16()
        times = {}
        for name in ("hilo", "peft-dtypes", "peft", "base"):
            fwd, step = variant_fn(name, model, linears, x, dy)
            row = {"group": group, "variant": name, "tokens": tokens, "d": d, "outs": list(outs),
                   "fwd_ms": round(timed(fwd, device, warmup, iters), 4),
                   "fwd_bwd_ms": round(timed(step, device, warmup, iters), 4), "peak_mib": peak_mib(step, device)}
            times[name] = row["fwd_bwd_ms"]
            emit(row)
        lora_ms = {k: round(v - times["base"], 4) for k, v in times.items() if k != "base"}
        emit({"group": group, "lora_over_base_ms": lora_ms})
        if not a.no_check:
            for row in check(group, model, linears, x, dy):
                ok &= row["ok"]
                emit(row)
        del model, linears
        if device.type == "cuda":
            torch.cuda.empty_cache()
    emit({"all_checks_ok": ok})
    if out:
        out.close()
    sys.exit(0 if ok else 1)


if __name__ == "__main__":
    main()
