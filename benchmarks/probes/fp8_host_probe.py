"""Host (Python) cost of one FP8 projection call, forward + backward, on the CPU at tiny sizes, where
the arithmetic is negligible: what ``modules.fp8``'s wrapper and autograd Function cost a call, the
part of an eager FP8 step the GPU cannot hide (the H200's step was host-bound: ≈ 300 µs of CPU a
forward, 250 µs a backward).

    python benchmarks/probes/fp8_host_probe.py                  # this checkout
    python benchmarks/probes/fp8_host_probe.py /path/to/other   # another checkout (alternate them: the machine drifts)
    python benchmarks/probes/fp8_host_probe.py --profile 15     # and the 15 costliest torchfuser functions

Three groups, as a llama layer has them (q/k/v: 3 weights, gate/up: 2, o: 1), 2 × 8 tokens, bf16 autocast over
fp32 master weights, every weight trainable (and a frozen-weight row: LoRA's bases' case, no dW).
Rows:
- ``full``: the reference path (PyTorch quantisation, CPU ``_scaled_mm``): everything a CPU call costs.
- ``wrapper``: the quantisers and the GEMMs replaced by functions handing back outputs made once (of the
  right shapes, in the order one step made them); what is left is the wrapper's Python, autograd and the
  ATen calls around the GEMMs (reshapes, concatenations, splits, casts): the overhead that exists on the
  GPU as well. ATen calls are counted there too (each costs ≈ 5–10 µs of host time on a GPU), and the
  quantiser calls (each a launcher call on the GPU: one or two Triton launches). ``fp8.quantize_both`` is
  sent to the ops layer's ``quantize_both`` there, as on CUDA (on the CPU it is two ``quantize`` calls, the
  reference composition).
"""
from __future__ import annotations

import argparse
import cProfile
import pstats
import sys
import time
from pathlib import Path

parser = argparse.ArgumentParser()
parser.add_argument("checkout", nargs="?", default=str(Path(__file__).resolve().parents[2]))
parser.add_argument("--profile", type=int, default=0)
parser.add_argument("--iters", type=int, default=300)
args = parser.parse_args()
sys.path.insert(0, str(Path(args.checkout).resolve()))

import torch  # noqa: E402
from torch import nn  # noqa: E402
from torch.utils._python_dispatch import TorchDispatchMode  # noqa: E402

import torchfuser  # noqa: E402
from torchfuser.modules import fp8  # noqa: E402
from torchfuser.ops import fp8_quant  # noqa: E402

BATCH, SEQ, HIDDEN = 2, 8, 64  # x as the model gives it: batch × sequence × hidden
GROUPS = {"qkv": (64, 32, 32), "gate_up": (128, 128), "o": (64,)}


def _group(outs, trainable):
    torch.manual_seed(0)
    linears = [nn.Linear(HIDDEN, n, bias=False) for n in outs]
    for m in linears:
        m.weight.requires_grad_(trainable)
    owner = nn.Module()
    owner.__dict__["_fp8"] = "rowwise"
    return owner, linears


def _call(x, dy, owner, linears):
    with torch.autocast("cpu", dtype=torch.bfloat16):
        y = fp8.linear(x, linears, owner)
    y.backward(dy)


class _Stubs:
    """The quantisers and GEMMs answer with outputs made once: one step's real results, recorded in call
    order, then handed back in that order (a list index a call: nothing of the stubs' own to measure)."""

    def __init__(self, step):
        self.step, self.saved, self.results, self.i, self.quant_calls = step, {}, [], None, 0

    def _wrap(self, owner, name):
        real = getattr(owner, name)

        def stub(*a, **k):
            if owner is fp8_quant:
                self.quant_calls += 1
            if self.i is None:
                out = real(*a, **k)
                self.results.append(out)
                return out
            out = self.results[self.i]
            self.i = (self.i + 1) % len(self.results)
            return out

        self.saved[(owner, name)] = real
        setattr(owner, name, stub)

    def __enter__(self):
        for name in ("quantize", "quantize_both"):
            if hasattr(fp8_quant, name):
                self._wrap(fp8_quant, name)
        self._wrap(fp8, "mm")
        if hasattr(fp8, "quantize_both"):  # the call CUDA makes: one quantiser call for both ways
            self.saved[(fp8, "quantize_both")] = fp8.quantize_both
            fp8.quantize_both = lambda t, recipe: fp8_quant.quantize_both(t, recipe == "tensorwise")
        self.step()  # recorded
        self.i, self.quant_calls = 0, 0
        return self

    def __exit__(self, *exc):
        for (owner, name), real in self.saved.items():
            setattr(owner, name, real)


class _CountATen(TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.calls = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.calls += 1
        return func(*args, **(kwargs or {}))


def _time(fn, iters):
    for _ in range(30):
        fn()
    best = float("inf")
    for _ in range(5):
        start = time.perf_counter()
        for _ in range(iters):
            fn()
        best = min(best, (time.perf_counter() - start) / iters)
    return best


def main() -> None:
    torch.set_num_threads(1)
    x = torch.randn(BATCH, SEQ, HIDDEN, dtype=torch.bfloat16, requires_grad=True)
    print(f"{torchfuser.__file__}")
    print(f"{'group':<8} {'weights':<9} {'full µs':>9} {'wrapper µs':>11} {'ATen calls':>11} {'quantiser calls':>16}")
    for trainable in (True, False):
        for name, outs in GROUPS.items():
            owner, linears = _group(outs, trainable)
            dy = torch.randn(BATCH, SEQ, sum(outs), dtype=torch.bfloat16)
            step = lambda: _call(x, dy, owner, linears)  # noqa: E731
            full = _time(step, args.iters)
            with _Stubs(step) as stubs:
                wrapper = _time(step, args.iters)
                counter = _CountATen()
                stubs.quant_calls = 0
                with counter:
                    step()
                quant_calls = stubs.quant_calls
            print(f"{name:<8} {'trainable' if trainable else 'frozen':<9} {full * 1e6:9.1f} {wrapper * 1e6:11.1f} "
                  f"{counter.calls:11d} {quant_calls:16d}")
    if args.profile:
        owner, linears = _group(GROUPS["qkv"], True)
        dy = torch.randn(BATCH, SEQ, sum(GROUPS["qkv"]), dtype=torch.bfloat16)
        with _Stubs(lambda: _call(x, dy, owner, linears)):
            prof = cProfile.Profile()
            prof.enable()
            for _ in range(args.iters):
                _call(x, dy, owner, linears)
            prof.disable()
        rows = [(k, v) for k, v in pstats.Stats(prof).stats.items() if "torchfuser" in k[0]]
        for (path, line, fn), (_, calls, own, cum, _) in sorted(rows, key=lambda kv: -kv[1][2])[:args.profile]:
            print(f"{own / args.iters * 1e6:8.1f} µs own {cum / args.iters * 1e6:8.1f} cum {calls // args.iters:3d} "
                  f"calls  {path.split('torchfuser/')[-1]}:{line} {fn}")


if __name__ == "__main__":
    main()
