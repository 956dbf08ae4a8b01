"""CUDA-graphed layers under DistributedDataParallel: the same training as without graphs.

    torchrun --nproc_per_node=2 benchmarks/ddp_graphs_check.py --out ddp-graphs.json

Each rank trains a tiny Llama-style model (same initial weights on every rank, different data per
rank) for a few AdamW steps with gradient accumulation under DDP, once fused without graphs and once
with ``cuda_graphs=True``. The gradients all-reduced by DDP and the parameters after training must
agree between the two runs on every rank; rank 0 writes the largest differences and exits non-zero
when they do not.
"""
from __future__ import annotations

import argparse
import json
from contextlib import nullcontext
import os
import sys
from pathlib import Path

import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torchfuser  # noqa: E402


def build(graphs: bool, device):
    from transformers import LlamaConfig, LlamaForCausalLM

    cfg = LlamaConfig(hidden_size=128, intermediate_size=256, num_hidden_layers=3, num_attention_heads=4,
                      num_key_value_heads=2, vocab_size=256, attn_implementation="sdpa", use_cache=False)
    torch.manual_seed(0)
    model = LlamaForCausalLM(cfg).to(device).train()
    return torchfuser.optimize(model, cuda_graphs=graphs)


def train(graphs: bool, rank: int, device, steps: int, micro: int):
    model = build(graphs, device)
    ddp = torch.nn.parallel.DistributedDataParallel(model, device_ids=[device.index])
    opt = torch.optim.AdamW(ddp.parameters(), lr=1e-3)
    gen = torch.Generator().manual_seed(100 + rank)
    grads = []
    for _ in range(steps):
        for m in range(micro):
            ids = torch.randint(0, 256, (2, 32), generator=gen).to(device)
            with torch.autocast("cuda", dtype=torch.bfloat16), (ddp.no_sync() if m < micro - 1 else nullcontext()):
                loss = ddp(input_ids=ids, labels=ids).loss
            loss.backward()
        grads.append([p.grad.detach().clone() for p in model.parameters()])
        opt.step()
        opt.zero_grad(set_to_none=True)
    params = [p.detach().clone() for p in model.parameters()]
    return grads, params, torchfuser.report(model).notes


def largest_relative(a, b):
    return max(((x - y).abs().max() / y.abs().max().clamp_min(1e-12)).item() for x, y in zip(a, b))


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--micro", type=int, default=2, help="micro-batches per step (gradient accumulation)")
    parser.add_argument("--tolerance", type=float, default=1e-4)
    parser.add_argument("--out")
    args = parser.parse_args()
    dist.init_process_group("nccl")
    rank = dist.get_rank()
    device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", rank)))
    torch.cuda.set_device(device)
    plain_grads, plain_params, _ = train(False, rank, device, args.steps, args.micro)
    graph_grads, graph_params, notes = train(True, rank, device, args.steps, args.micro)
    grad_diff = max(largest_relative(a, b) for a, b in zip(graph_grads, plain_grads))
    param_diff = largest_relative(graph_params, plain_params)
    # All ranks must hold the same all-reduced gradients: compare rank 0's with everyone's.
    reference = [g.clone() for g in graph_grads[-1]]
    for g in reference:
        dist.broadcast(g, 0)
    rank_diff = largest_relative(graph_grads[-1], reference)
    row = {"rank": rank, "world": dist.get_world_size(), "steps": args.steps, "micro": args.micro,
           "grad_rel_diff": grad_diff, "param_rel_diff": param_diff, "rank_vs_rank0_rel_diff": rank_diff,
           "notes": [n for n in notes if n.startswith("cuda graphs")],
           "torch": torch.__version__, "gpu": torch.cuda.get_device_name(device)}
    rows = [None] * dist.get_world_size()
    dist.all_gather_object(rows, row)
    ok = all(r["grad_rel_diff"] <= args.tolerance and r["param_rel_diff"] <= args.tolerance
             and r["rank_vs_rank0_rel_diff"] <= args.tolerance
             and any("replayed" in n and "eager calls" not in n for n in r["notes"]) for r in rows)
    if rank == 0:
        for r in rows:
            print(json.dumps(r))
        print("PASS" if ok else "FAIL", flush=True)
        if args.out:
            Path(args.out).write_text(json.dumps({"pass": ok, "tolerance": args.tolerance, "ranks": rows}, indent=1))
    dist.destroy_process_group()
    sys.exit(0 if ok else 1)


if __name__ == "__main__":
    main()
