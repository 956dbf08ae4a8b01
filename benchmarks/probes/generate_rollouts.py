"""Rollout speed as TRL's GRPO / RLOO make them: ``model.generate`` in training mode under ``no_grad``, TRL's
``fused_lm_head`` wrapper on the model's forward, a batch of left-padded prompts, KV cache, greedy; unfused
against fused (each backend asked for), interleaved rounds, median ms per generated token (one token for
every row of the batch). The tokens must be equal, or the run fails; with ``--report-mismatch`` (bf16 on a GPU,
where other kernels may round differently and a random-weight model's near-tied logits then pick other tokens)
the run goes on and each line says how many tokens matched (``tokens_equal``, ``first_mismatch``).

    python benchmarks/probes/generate_rollouts.py                                   # tiny.json, CPU
    python benchmarks/probes/generate_rollouts.py --config qwen15b --device cuda --batch 16 --new 256

On the CPU each variant's time is host time (the tiny model's kernels are microseconds): the fused
modules' per-call checks and dispatch are what is measured there, on one thread, as the thread's CPU
time (``time.thread_time``: on a machine shared with other work, wall time swings by 2x between runs).
"""
from __future__ import annotations

import argparse
import copy
import json
import statistics
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[2]
sys.path[:0] = [str(ROOT)]

import torchfuser  # noqa: E402


def build(config: str, device: str, dtype: torch.dtype):
    from transformers import AutoConfig, AutoModelForCausalLM

    path = Path(config) if config.endswith(".json") else ROOT / "recipes" / f"{config}.json"
    fields = json.loads(path.read_text())
    cfg = AutoConfig.for_model(fields.pop("model_type"), **fields)
    cfg._attn_implementation = "sdpa"
    torch.manual_seed(0)
    return AutoModelForCausalLM.from_config(cfg, dtype=dtype).to(device)


def prompts(batch: int, longest: int, vocab: int, device: str):
    gen = torch.Generator().manual_seed(1)
    lengths = torch.randint(max(1, longest // 4), longest + 1, (batch,), generator=gen)
    ids = torch.zeros(batch, longest, dtype=torch.long)
    mask = torch.zeros_like(ids)
    for row, n in enumerate(lengths.tolist()):
        ids[row, -n:] = torch.randint(4, vocab, (n,), generator=gen)
        mask[row, -n:] = 1
    return ids.to(device), mask.to(device)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--config", default="tiny")
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--prompt", type=int, default=32)
    parser.add_argument("--new", type=int, default=32)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--backends", nargs="+", default=["reference", "auto"])
    parser.add_argument("--report-mismatch", action="store_true",
                        help="time and report a variant whose greedy tokens differ instead of failing")
    parser.add_argument("--out")
    args = parser.parse_args()
    from trl.trainer.utils import add_fused_lm_head

    dtype = getattr(torch, args.dtype)
    base = build(args.config, args.device, dtype)
    models = {"unfused": base}
    for backend in args.backends:
        models[f"torchfuser-{backend}"] = torchfuser.optimize(copy.deepcopy(base), backend=backend)
    for m in models.values():
        add_fused_lm_head(m, outputs=("log_probs", "entropy"))
        m.train()  # the Trainer's mode, which TRL's rollouts keep
    ids, mask = prompts(args.batch, args.prompt, base.config.vocab_size, args.device)

    def run(model):
        with torch.no_grad():
            return model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=args.new, min_new_tokens=args.new,
                                  do_sample=False, pad_token_id=0, use_cache=True)

    cuda = args.device.startswith("cuda")
    sync = torch.cuda.synchronize if cuda else (lambda: None)
    clock = time.perf_counter if cuda else time.thread_time
    if not cuda:
        torch.set_num_threads(1)
    want = run(base)
    times = {name: [] for name in models}
    match = {}
    for name, m in models.items():  # warm-up (compiles) and the exactness check
        got = run(m)
        same = (got == want)[:, ids.shape[1]:]
        differs = (~same).any(dim=0).nonzero()
        match[name] = dict(tokens_equal=bool(same.all()), equal_fraction=round(same.float().mean().item(), 4),
                           first_mismatch=int(differs[0]) if len(differs) else None)
        if not same.all() and not args.report_mismatch:
            raise SystemExit(f"{name}: greedy tokens differ from the unfused model's ({match[name]})")
    for _ in range(args.rounds):
        for name, m in models.items():
            sync()
            t0 = clock()
            run(m)
            sync()
            times[name].append((clock() - t0) * 1e3 / args.new)
    base_ms = statistics.median(times["unfused"])
    lines = []
    for name, ts in times.items():
        ms = statistics.median(ts)
        line = dict(probe="generate_rollouts", variant=name, device=args.device, config=args.config, dtype=args.dtype,
                    batch=args.batch, prompt=args.prompt, clock=clock.__name__, new_tokens=args.new, ms_per_token=round(ms, 4),
                    vs_unfused=round(base_ms / ms, 3), rounds=[round(t, 4) for t in ts], torch=torch.__version__,
                    **match[name])
        lines.append(line)
        print(json.dumps(line))
    if args.out:
        with open(args.out, "a") as f:
            f.writelines(json.dumps(x) + "\n" for x in lines)


if __name__ == "__main__":
    main()
