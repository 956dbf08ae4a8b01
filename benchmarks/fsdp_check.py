"""FSDP with TorchFuser: the same training as the unfused sharded model, and what it costs.

    torchrun --nproc_per_node=2 benchmarks/fsdp_check.py --out fsdp.json                   # GPUs, nccl
    torchrun --nproc_per_node=2 benchmarks/fsdp_check.py --recipe tiny --device cpu --seq 64   # gloo

Each rank builds a recipe model from one seed, optimizes it (or not), shards every decoder layer
and the root, and trains on its own random tokens: unfused first, then fused, from the same
initial weights. ``--wrap fsdp2`` shards with ``fully_shard``; ``fsdp1`` wraps the model in
``FullyShardedDataParallel`` (one unit per decoder layer, ``use_orig_params=True``).
``--precision mp-bf16`` shards with bf16 parameters and fp32 gradient reduction (no autocast);
``autocast`` keeps fp32 parameters under bf16 autocast. Rank 0 prints one JSON line per variant (ms/step median,
tokens/s over all ranks, peak memory, losses) and the fused-vs-unfused differences: the losses
of every step and the first step's all-gathered gradients. PASS needs the loss curves within
``--tolerance`` (relative) and every first-step gradient within 10 % of its largest unfused value
(a stale or unsharded parameter is off by far more; bf16 rounding is not).
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from contextlib import nullcontext
from pathlib import Path

import torch
import torch.distributed as dist

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import torchfuser  # noqa: E402
from profiling import profiled, write_tables  # noqa: E402
from torch.distributed.fsdp import FullyShardedDataParallel, MixedPrecision, MixedPrecisionPolicy, fully_shard  # noqa: E402
from torch.distributed.fsdp.wrap import ModuleWrapPolicy  # noqa: E402


def build(recipe: str, fused: bool, precision: str, wrap: str, device):
    from transformers import AutoConfig, AutoModelForCausalLM

    fields = json.loads((ROOT / "recipes" / f"{recipe}.json").read_text())
    cfg = AutoConfig.for_model(fields.pop("model_type"), **fields)
    cfg._attn_implementation = "sdpa"
    cfg.use_cache = False
    torch.manual_seed(0)
    with device:
        model = AutoModelForCausalLM.from_config(cfg).float().train()
    if fused:
        torchfuser.optimize(model)
    if wrap == "fsdp1":
        mixed = MixedPrecision(param_dtype=torch.bfloat16, reduce_dtype=torch.float32) if precision == "mp-bf16" else None
        layer = type(model.model.layers[0])
        return FullyShardedDataParallel(model, auto_wrap_policy=ModuleWrapPolicy({layer}), mixed_precision=mixed,
                                        use_orig_params=True, device_id=device)
    policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32) if precision == "mp-bf16" else MixedPrecisionPolicy()
    for layer in model.model.layers:
        fully_shard(layer, mp_policy=policy)
    fully_shard(model, mp_policy=policy)
    return model


def train(model, args, rank, device, label):
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4, fused=device.type == "cuda")
    gen = torch.Generator().manual_seed(100 + rank)
    vocab = model.config.vocab_size
    autocast = torch.autocast(device.type, dtype=torch.bfloat16) if args.precision == "autocast" else nullcontext()
    losses, times, first_grads = [], [], None
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    for step in range(args.warmup + args.steps):
        ids = torch.randint(0, vocab, (args.batch, args.seq), generator=gen).to(device)
        start = time.perf_counter()
        with autocast:
            loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        if step == 0:
            first_grads = full_grads(model)
        opt.step()
        opt.zero_grad(set_to_none=True)
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        if step >= args.warmup:
            times.append(time.perf_counter() - start)
        losses.append(loss.item())
    peak = torch.cuda.max_memory_allocated(device) / 2**30 if device.type == "cuda" else None
    if args.profile_dir:
        profile(model, opt, ids, autocast, device, rank, Path(args.profile_dir) / f"fsdp-{args.wrap}-{args.recipe}-{label}.txt")
    return losses, statistics.median(times), peak, first_grads


def profile(model, opt, ids, autocast, device, rank, path):
    """Two steps under the profiler on every rank (collectives need them all); rank 0 writes the
    ops by host time and by GPU time."""
    def step():
        with autocast:
            loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)

    prof = profiled(step, device, 2)
    if rank == 0:
        keys = ("self_cpu_time_total",) + (("self_cuda_time_total",) if device.type == "cuda" else ())
        write_tables(prof, path, keys, 45, 70)


def full_grads(model) -> list[torch.Tensor]:
    """Every parameter's whole gradient on this rank (gathered from the shards)."""
    if isinstance(model, FullyShardedDataParallel):
        with FullyShardedDataParallel.summon_full_params(model, with_grads=True):
            return [p.grad.float().cpu() for p in model.parameters()]
    return [p.grad.full_tensor().float().cpu() for p in model.parameters()]


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--recipe", default="llama1b")
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--precision", choices=("mp-bf16", "autocast"), default="mp-bf16")
    parser.add_argument("--wrap", choices=("fsdp2", "fsdp1"), default="fsdp2")
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--seq", type=int, default=2048)
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--steps", type=int, default=6)
    parser.add_argument("--tolerance", type=float, default=0.01)
    parser.add_argument("--out")
    parser.add_argument("--profile-dir", help="rank 0 writes a profiler table of two more steps per variant here")
    args = parser.parse_args()
    cuda = args.device == "cuda"
    dist.init_process_group("nccl" if cuda else "gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", rank))) if cuda else torch.device("cpu")
    if cuda:
        torch.cuda.set_device(device)
    rows, results = [], {}
    for variant in ("fsdp", "fsdp+torchfuser"):
        model = build(args.recipe, variant != "fsdp", args.precision, args.wrap, device)
        losses, step_s, peak, grads = train(model, args, rank, device, variant.replace("+", "_"))
        results[variant] = (losses, grads)
        rows.append({"variant": variant, "recipe": args.recipe, "precision": args.precision, "wrap": args.wrap, "world": world,
                     "batch_per_rank": args.batch, "seq": args.seq, "ms_per_step": round(step_s * 1e3, 2),
                     "tokens_per_s": round(world * args.batch * args.seq / step_s),
                     "peak_gib_rank0": None if peak is None else round(peak, 2), "losses": [round(x, 4) for x in losses]})
        del model
        if cuda:
            torch.cuda.empty_cache()
    (plain_losses, plain_grads), (fused_losses, fused_grads) = results["fsdp"], results["fsdp+torchfuser"]
    loss_diff = max(abs(a - b) / abs(a) for a, b in zip(plain_losses, fused_losses))
    grad_diff = max(((f - p).abs().max() / p.abs().max().clamp_min(1e-12)).item() for f, p in zip(fused_grads, plain_grads))
    ok = loss_diff <= args.tolerance and grad_diff <= 0.1
    if rank == 0:
        for row in rows:
            print(json.dumps(row))
        fused, plain = rows[1]["ms_per_step"], rows[0]["ms_per_step"]
        summary = {"pass": ok, "loss_rel_diff": loss_diff, "first_step_grad_rel_diff": grad_diff, "speed_up": round(plain / fused, 3),
                   "torch": torch.__version__, "device": torch.cuda.get_device_name(device) if cuda else "cpu"}
        print(json.dumps(summary))
        print("PASS" if ok else "FAIL", flush=True)
        if args.out:
            Path(args.out).write_text(json.dumps({"summary": summary, "rows": rows}, indent=1))
    dist.destroy_process_group()
    sys.exit(0 if ok else 1)


if __name__ == "__main__":
    main()
