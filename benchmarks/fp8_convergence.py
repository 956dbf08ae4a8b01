"""FP8 convergence: the same model, data and seed trained in bf16 and in FP8, loss curves compared.

    python benchmarks/fp8_convergence.py --steps 300 --out benchmarks/results/latest/fp8-convergence.json
    python benchmarks/fp8_convergence.py --model tiny --device cpu --steps 20 --batch 2 --seq 64   # smoke run

The task is learnable, so a loss that stops falling shows: every sequence is drawn from one fixed
random bigram model over the first ``--active`` tokens of the vocabulary, each token followed by one
of ``--fanout`` successors with Dirichlet(1) probabilities. Its entropy rate (printed and saved) is
the loss a perfect model reaches; the curves fall from ln(vocab) to ln(active) (the tokens used, learnt
first) and then towards it (the successors). With 4096 tokens, 16 successors and lr 3e-4, llama1b reached
only the first plateau in 300 steps (run 123); the defaults are a chain it can learn in that time.

Variants (bf16 autocast, fp32 parameters, fused AdamW with a linear warm-up, clipping at 1.0):
``bf16`` (optimize(model)), ``fp8-rowwise``, ``fp8-tensorwise`` and ``fp8-blockwise`` (optimize(model, fp8=...)),
``torchao-rowwise`` and ``torchao-tensorwise`` (torchao's float8 training on every projection but
the LM head, + torch.compile: torchtitan's recipe; where torchao is installed). Each curve is
smoothed by a moving average of ``--window`` steps; the gap of a variant is the largest relative
difference of its smoothed loss from bf16's after ``--warmup`` steps. A PNG of the curves (raw,
faint; smoothed, solid) and of the gaps goes next to the JSON.
"""
from __future__ import annotations

import argparse
import json
import math
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "benchmarks"))

import torchfuser  # noqa: E402
from train_step import _torchao_float8, build, environment  # noqa: E402

VARIANTS = ("bf16", "fp8-rowwise", "fp8-tensorwise", "fp8-blockwise", "torchao-rowwise", "torchao-tensorwise")


def bigram(active: int, fanout: int, seed: int):
    """(successors (active, fanout) int64, probabilities (active, fanout)) of a fixed random bigram model."""
    g = torch.Generator().manual_seed(seed)
    successors = torch.stack([torch.randperm(active, generator=g)[:fanout] for _ in range(active)])
    weights = -torch.rand(active, fanout, generator=g).log()  # Exponential(1): normalised, Dirichlet(1)
    return successors, weights / weights.sum(-1, keepdim=True)


def entropy_rate(successors, probs, iterations: int = 200) -> float:
    """The chain's entropy per token in nats, under its stationary distribution (power iteration)."""
    pi = torch.full((successors.shape[0],), 1.0 / successors.shape[0], dtype=torch.float64)
    p = probs.double()
    for _ in range(iterations):
        pi = torch.zeros_like(pi).index_add_(0, successors.flatten(), (pi[:, None] * p).flatten())
    return float((pi * -(p * p.clamp_min(1e-300).log()).sum(-1)).sum())


def sample(successors, probs, n: int, batch: int, seq: int, seed: int, device):
    """n batches of (batch, seq) token ids drawn from the chain, the first token uniform."""
    g = torch.Generator().manual_seed(seed + 1)
    active = successors.shape[0]
    out = torch.empty(n, batch, seq, dtype=torch.int64)
    tok = torch.randint(0, active, (n, batch), generator=g)
    for t in range(seq):
        out[:, :, t] = tok
        choice = torch.multinomial(probs[tok.flatten()], 1, generator=g).view(n, batch)
        tok = successors[tok, choice]
    return out.to(device)


def prepare(variant: str, model):
    if variant == "bf16":
        return torchfuser.optimize(model)
    if variant.startswith("fp8-"):
        return torchfuser.optimize(model, fp8=variant.removeprefix("fp8-"))
    _torchao_float8(model, variant.removeprefix("torchao-"))
    return torch.compile(model)


def curve(variant, args, data, device):
    model = build(args.model, device, args.seed)
    step_fn = prepare(variant, model)
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=0.0, fused=device.type == "cuda")
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: min(1.0, (s + 1) / args.lr_warmup))
    autocast = torch.autocast(device.type, dtype=torch.bfloat16)  # FP8 GEMMs take bf16 operands, the CPU's too
    losses, start = [], time.perf_counter()
    for ids in data:
        with autocast:
            loss = step_fn(input_ids=ids, labels=ids, use_cache=False).loss
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        sched.step()
        opt.zero_grad(set_to_none=True)
        losses.append(loss.detach())
    losses = [float(x) for x in torch.stack(losses).cpu()]
    report = torchfuser.report(model)
    notes = [n for n in report.notes if n.startswith(("fp8", "fallback"))] if report.fused else []
    return {"losses": losses, "seconds": round(time.perf_counter() - start, 1), "notes": notes}


def smooth(xs, window: int):
    out, acc = [], 0.0
    for i, x in enumerate(xs):
        acc += x - (xs[i - window] if i >= window else 0.0)
        out.append(acc / min(i + 1, window))
    return out


def plot(result, path: Path):
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("matplotlib is not installed: no plot")
        return
    fig, (top, bottom) = plt.subplots(2, 1, figsize=(8, 7), sharex=True, height_ratios=(2, 1))
    for name, c in result["curves"].items():
        # bf16 wide and solid, the others dashed on top: curves that agree stay visible as two
        line, = top.plot(c["smoothed"], label=name, linewidth=3 if name == "bf16" else 1.3,
                         linestyle="-" if name == "bf16" else "--")
        top.plot(c["losses"], color=line.get_color(), alpha=0.2, linewidth=0.8)
        if name != "bf16":
            bottom.plot([100 * g for g in c["relative_gap"]], color=line.get_color(), label=name)
    top.axhline(result["entropy_rate"], color="grey", linestyle=":", label="entropy rate (best possible)")
    top.set_ylabel("loss")
    top.legend()
    top.set_title(f"{result['model']}: FP8 vs bf16, {result['gpu'] or result['device']}")
    bottom.axvline(result["warmup"], color="grey", linestyle=":")
    bottom.axhline(100 * result["tolerance"], color="red", linestyle="--", linewidth=0.8)
    bottom.axhline(-100 * result["tolerance"], color="red", linestyle="--", linewidth=0.8)
    bottom.set_ylabel("smoothed gap to bf16 (%)")
    bottom.set_xlabel("step")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    print(f"plot: {path}")


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="llama1b", help="a recipe in recipes/ (llama1b, tiny, ...)")
    parser.add_argument("--variants", nargs="+", default=["bf16", "fp8-rowwise", "torchao-rowwise"], choices=VARIANTS)
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--seq", type=int, default=1024)
    parser.add_argument("--lr", type=float, default=6e-4)
    parser.add_argument("--lr-warmup", type=int, default=30)
    parser.add_argument("--active", type=int, default=1024, help="tokens the bigram chain uses")
    parser.add_argument("--fanout", type=int, default=4, help="successors of each token")
    parser.add_argument("--window", type=int, default=20, help="moving-average window of the smoothed curves")
    parser.add_argument("--warmup", type=int, default=100, help="steps before the gap is judged")
    parser.add_argument("--tolerance", type=float, default=0.01)
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", help="JSON path; the PNG goes next to it")
    args = parser.parse_args()
    device = torch.device(args.device)
    vocab = build(args.model, torch.device("meta"), args.seed).config.vocab_size
    active = min(args.active, vocab)
    successors, probs = bigram(active, min(args.fanout, active), args.seed)
    data = sample(successors, probs, args.steps, args.batch, args.seq, args.seed, device)
    env = environment(device)
    result = {"model": args.model, "steps": args.steps, "batch": args.batch, "seq": args.seq, "lr": args.lr,
              "active_tokens": active, "fanout": args.fanout, "entropy_rate": entropy_rate(successors, probs),
              "initial_loss_uniform": math.log(vocab), "window": args.window, "warmup": args.warmup,
              "tolerance": args.tolerance, "gpu": env.get("gpu"), **env, "curves": {}}
    for variant in args.variants:
        if variant.startswith("torchao") and not _has_torchao():
            print(f"{variant}: torchao is not installed, skipped")
            continue
        c = curve(variant, args, data, device)
        c["smoothed"] = smooth(c["losses"], args.window)
        result["curves"][variant] = c
        print(f"{variant:20s} loss {c['losses'][0]:.3f} → {c['smoothed'][-1]:.3f} (smoothed) in {c['seconds']} s; "
              f"every 50 steps: {' '.join(f'{x:.2f}' for x in c['smoothed'][::50])}", flush=True)
        if args.out:  # kept as it goes: a run cut short keeps the curves it finished
            Path(args.out).parent.mkdir(parents=True, exist_ok=True)
            Path(args.out).write_text(json.dumps(result, indent=1))
    base = result["curves"].get("bf16")
    for name, c in result["curves"].items():
        if base is None or name == "bf16":
            continue
        c["relative_gap"] = [(a - b) / b for a, b in zip(c["smoothed"], base["smoothed"])]
        judged = c["relative_gap"][args.warmup:]
        c["max_gap_after_warmup"] = max(map(abs, judged)) if judged else None
        c["final_gap"] = c["relative_gap"][-1]
        c["passed"] = c["max_gap_after_warmup"] is not None and c["max_gap_after_warmup"] <= args.tolerance
        print(f"{name:20s} largest smoothed gap to bf16 after step {args.warmup}: "
              f"{100 * (c['max_gap_after_warmup'] or 0):.2f} % (final {100 * c['final_gap']:+.2f} %) "
              f"→ {'PASS' if c['passed'] else 'FAIL'} at {100 * args.tolerance:.1f} %")
    print(f"entropy rate of the data: {result['entropy_rate']:.3f} nats (uniform over the vocabulary: "
          f"{result['initial_loss_uniform']:.3f})")
    if args.out:
        out = Path(args.out)
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(json.dumps(result, indent=1))
        plot(result, out.with_suffix(".png"))


def _has_torchao() -> bool:
    import importlib.util

    return importlib.util.find_spec("torchao") is not None


if __name__ == "__main__":
    main()
