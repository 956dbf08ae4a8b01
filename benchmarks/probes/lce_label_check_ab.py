"""A/B: the Triton loss kernel with its out-of-vocabulary label flag against the kernel before it.

The flag costs a compare and two selects per row; this measures that they cost nothing visible at
a real head size. The kernel before the flag is the file from git (commit ee3e76d), copied next to
the current one as ``_lce_before.py`` by the command that runs this (it imports its neighbours
relatively):

    git show ee3e76d:torchfuser/backends/triton/linear_cross_entropy.py > .ab/lce_before.py   # here
    cp .ab/lce_before.py torchfuser/backends/triton/_lce_before.py                            # there
    python3 benchmarks/probes/lce_label_check_ab.py --rounds 12

Timed in alternation (one round = each kernel once, forward with its gradients, as a training
step runs it), CUDA events, medians; also checks both give the same loss on valid labels and
that the new one gives NaN for an out-of-range label.
"""
from __future__ import annotations

import argparse
import json
import statistics

import torch

from torchfuser.backends.triton import _lce_before as before
from torchfuser.backends.triton import linear_cross_entropy as after


def _time(fn, reps: int = 5) -> float:
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(reps):
        fn()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) / reps


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rounds", type=int, default=12)
    ap.add_argument("--shape", default="8192x2048x128256", help="tokens x hidden x vocab")
    args = ap.parse_args()
    n, h, v = (int(s) for s in args.shape.split("x"))
    gen = torch.Generator(device="cuda").manual_seed(0)
    hidden = torch.randn(n, h, device="cuda", generator=gen).bfloat16()
    weight = (torch.randn(v, h, device="cuda", generator=gen) / h**0.5).bfloat16()
    labels = torch.randint(0, v, (n,), device="cuda", generator=gen)
    labels[::7] = -100
    run = {name: (lambda m=m: m.linear_cross_entropy_fwd(hidden, weight, None, labels, -100, None, "mean", True))
           for name, m in (("before", before), ("after", after))}
    loss_before, loss_after = run["before"]()[0], run["after"]()[0]
    same = torch.allclose(loss_before.float(), loss_after.float(), rtol=1e-6, atol=1e-6)
    bad = labels.clone()
    bad[3] = v + 5
    nan = bool(torch.isnan(after.linear_cross_entropy_fwd(hidden, weight, None, bad, -100, None, "mean", True)[0]).all())
    times = {k: [] for k in run}
    for fn in run.values():
        _time(fn, 2)  # warm-up
    for _ in range(args.rounds):
        for k, fn in run.items():
            times[k].append(_time(fn))
    med = {k: statistics.median(t) for k, t in times.items()}
    faster = sum(a <= b for a, b in zip(times["after"], times["before"]))
    row = dict(probe="lce_label_check_ab", shape=args.shape, dtype="bfloat16", rounds=args.rounds,
               ms_before=round(med["before"], 4), ms_after=round(med["after"], 4),
               ratio=round(med["after"] / med["before"], 4), after_faster_rounds=faster,
               same_loss=bool(same), nan_for_bad_label=nan, device=torch.cuda.get_device_name(),
               torch=torch.__version__)
    print(json.dumps(row))
    print(f"LCE {args.shape} bf16 fwd+grads: before {med['before']:.3f} ms, with the label flag {med['after']:.3f} ms "
          f"({row['ratio']:.4f}x; flag faster in {faster}/{args.rounds} rounds); same loss {same}; NaN for a bad label {nan}")


if __name__ == "__main__":
    main()
