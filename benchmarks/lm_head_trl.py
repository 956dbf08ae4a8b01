"""The LM head under TRL: TRL's chunked log-prob kernels against TorchFuser's linear + cross-entropy, forward +
backward, on the shapes TRL's trainers score (issue 39's head decision).

    python benchmarks/lm_head_trl.py --device cuda --out results.jsonl      # the GPU matrix (gpu_run.sh trl-head)
    python benchmarks/lm_head_trl.py --device cpu --tokens 64 --shapes 256x64 --dtype float32   # CPU smoke

Per shape (vocabulary × hidden, from the models the issue names) and scored-token count, median ms of
forward + backward (CUDA events, interleaved rounds) and the peak memory above the inputs, for:

- ``trl``: ``trl.kernels.ChunkedLogProbFunction`` as ``add_fused_lm_head`` calls it (its chunk size), per-token
  log-probs only (SFT, and the ref model's calls);
- ``trl+entropy``: the same with ``outputs=("log_probs", "entropy")`` (GRPO / RLOO) — entropy is computed,
  its gradient is not needed (the trainers log it or mask with it);
- ``trl+dpo``: ``("log_probs", "entropy", "mean_logits", "is_top1")``, what DPOTrainer asks for;
- ``torchfuser``: ``torchfuser.functional.linear_cross_entropy(reduction="sum")`` — the loss only. It has no
  per-token output and no entropy, so it is a lower bound on what a TorchFuser head serving TRL's
  contract would cost: if it does not beat ``trl+entropy`` clearly, TRL's head stays (NOTES-trl.md);
- ``eager``: logits in fp32, log_softmax, gather (and entropy) — the reference for the values and a peer.

Each variant's summed log-prob is checked against eager's (fp32 math) before timing; a mismatch is recorded.
On the CPU the numbers are host-side only: do not read them as GPU speed.
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torchfuser.functional as TF  # noqa: E402

# vocabulary × hidden: Llama-3-8B, Qwen2.5-1.5B, Qwen2.5-7B
SHAPES = ["128256x4096", "151936x1536", "152064x3584"]
TOKENS = [4096, 8192, 16384, 32768]
DPO_OUTPUTS = ("log_probs", "entropy", "mean_logits", "is_top1")


def _trl(outputs):
    from trl.kernels import ChunkedLogProbFunction
    from trl.trainer.utils import _CHUNKED_LOGPROB_CHUNK_SIZE as chunk

    def run(h, w, labels):
        logp, *rest = ChunkedLogProbFunction.apply(h, w, None, labels, 1.0, chunk, None, 1.0, outputs)
        return -logp.sum()
    return run


def _torchfuser(h, w, labels):
    return TF.linear_cross_entropy(h, w, labels, reduction="sum")


def _eager(entropy: bool):
    def run(h, w, labels):
        logp = torch.log_softmax((h @ w.T).float(), -1)
        loss = -logp.gather(-1, labels[:, None]).sum()
        if entropy:
            with torch.no_grad():
                (-(logp.exp() * logp).sum(-1)).mean()
        return loss
    return run


VARIANTS = {
    "trl": lambda: _trl(("log_probs",)),
    "trl+entropy": lambda: _trl(("log_probs", "entropy")),
    "trl+dpo": lambda: _trl(DPO_OUTPUTS),
    "torchfuser": lambda: _torchfuser,
    "eager": lambda: _eager(False),
    "eager+entropy": lambda: _eager(True),
}


def _timer(device: str):
    if device.startswith("cuda"):
        def timed(fn):
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            fn()
            end.record()
            torch.cuda.synchronize()
            return start.elapsed_time(end)
    else:
        def timed(fn):
            t0 = time.perf_counter()
            fn()
            return (time.perf_counter() - t0) * 1e3
    return timed


def measure(variant, fn, vocab, hidden, tokens, args, ref_value):
    device, dtype = args.device, getattr(torch, args.dtype)
    gen = torch.Generator(device="cpu").manual_seed(0)
    h = (torch.randn(tokens, hidden, generator=gen) * 0.5).to(device, dtype).requires_grad_()
    w = (torch.randn(vocab, hidden, generator=gen) * hidden ** -0.5).to(device, dtype).requires_grad_()
    labels = torch.randint(0, vocab, (tokens,), generator=gen).to(device)
    cuda = device.startswith("cuda")

    def step():
        h.grad = w.grad = None
        fn(h, w, labels).backward()

    row = dict(bench="lm_head_trl", variant=variant, vocab=vocab, hidden=hidden, tokens=tokens, dtype=args.dtype,
               device=torch.cuda.get_device_name() if cuda else "cpu", torch=torch.__version__)
    try:
        value = fn(h, w, labels).item()  # warm-up (compiles) and the value check
        step()
        row["loss_sum"] = value
        if ref_value is not None:
            row["rel_diff_vs_eager"] = abs(value - ref_value) / max(abs(ref_value), 1e-9)
        if cuda:
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
            base = torch.cuda.memory_allocated()
        timed = _timer(device)
        times = [timed(step) for _ in range(args.rounds)]
        row["ms_fwd_bwd"] = round(statistics.median(times), 3)
        row["ms_rounds"] = [round(t, 3) for t in times]
        if cuda:
            row["peak_mib_above_inputs"] = round((torch.cuda.max_memory_allocated() - base) / 2**20, 1)
    except torch.OutOfMemoryError:
        row["error"] = "out of memory"
    except Exception as err:  # a variant that cannot run this shape: recorded, the matrix goes on
        row["error"] = f"{type(err).__name__}: {err}"[:300]
    del h, w
    if cuda:
        torch.cuda.empty_cache()
    return row


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--shapes", nargs="+", default=SHAPES, help="VOCABxHIDDEN")
    parser.add_argument("--tokens", type=int, nargs="+", default=TOKENS)
    parser.add_argument("--variants", nargs="+", default=list(VARIANTS))
    parser.add_argument("--rounds", type=int, default=10)
    parser.add_argument("--out")
    args = parser.parse_args()
    rows = []
    for shape in args.shapes:
        vocab, hidden = map(int, shape.split("x"))
        for tokens in args.tokens:
            ref = None
            for variant in sorted(args.variants, key=lambda v: not v.startswith("eager")):  # eager first: the value
                row = measure(variant, VARIANTS[variant](), vocab, hidden, tokens, args, ref)
                if variant == "eager" and "loss_sum" in row:
                    ref = row["loss_sum"]
                rows.append(row)
                print(json.dumps(row), flush=True)
                if args.out:
                    with open(args.out, "a") as f:
                        f.write(json.dumps(row) + "\n")
    print(f"\n{'shape':>13} {'tokens':>6} " + " ".join(f"{v:>14}" for v in args.variants))
    for shape in args.shapes:
        vocab, hidden = map(int, shape.split("x"))
        for tokens in args.tokens:
            cells = []
            for v in args.variants:
                r = next((r for r in rows if r["variant"] == v and r["vocab"] == vocab and r["hidden"] == hidden
                          and r["tokens"] == tokens), {})
                cells.append(f"{r['ms_fwd_bwd']:>11.2f} ms" if "ms_fwd_bwd" in r else f"{r.get('error', '-')[:14]:>14}")
            print(f"{shape:>13} {tokens:>6} " + " ".join(cells))


if __name__ == "__main__":
    main()
