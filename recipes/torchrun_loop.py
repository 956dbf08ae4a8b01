"""A plain PyTorch training loop, on one process or under torchrun with DDP or FSDP2.

    python recipes/torchrun_loop.py                                          # one process
    torchrun --nproc_per_node=2 --standalone recipes/torchrun_loop.py --parallel ddp --compare
    torchrun --nproc_per_node=8 --standalone recipes/torchrun_loop.py --parallel fsdp2 --checkpoint ./my-model

Fuse first, then wrap: ``torchfuser.optimize`` before ``DistributedDataParallel`` or ``fully_shard``
(after ``fully_shard`` the parameters are DTensors and nothing is fused; the report says why).
On the CPU the ranks talk over gloo, on GPUs over NCCL, one GPU per rank (LOCAL_RANK).

FSDP2: pass ``fully_shard`` a mesh of the device the model lives on. Without one it takes the
accelerator's, so on a GPU machine a gloo (CPU) run would move every rank's shards to cuda:0.
"""
from __future__ import annotations

import argparse
import copy
import os
import sys

import torch
import torch.distributed as dist

import torchfuser
from common import (StepTimer, add_model_args, device, dtype, load_model, on_gpus, print_comparison, print_result,
                    random_tokens)


def wrap(model, parallel: str, dev: torch.device, low_dtype: torch.dtype):
    if parallel == "ddp":
        from torch.nn.parallel import DistributedDataParallel

        return DistributedDataParallel(model, device_ids=[dev.index] if dev.type == "cuda" else None)
    if parallel == "fsdp2":
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

        mesh = init_device_mesh(dev.type, (dist.get_world_size(),))
        mp = MixedPrecisionPolicy(param_dtype=low_dtype, reduce_dtype=torch.float32)
        for layer in model.model.layers:  # one unit per decoder layer, then the rest
            fully_shard(layer, mesh=mesh, mp_policy=mp)
        fully_shard(model, mesh=mesh, mp_policy=mp)
    return model


def train(args, base, fused: bool, rank: int, world: int) -> dict:
    dev = device()
    model = copy.deepcopy(base)
    if fused:
        torchfuser.optimize(model, backend=args.backend)  # before wrapping
        if rank == 0:
            print(torchfuser.report(model).summary())
    model = model.to(dev)  # fp32 master weights; bf16 compute on GPUs (autocast, or FSDP2's policy)
    model = wrap(model, args.parallel, dev, dtype(args)) if args.parallel != "none" else model
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr)
    vocab = base.config.vocab_size
    # Each rank its own rows; the same rows for the fused and the unfused run.
    data = random_tokens(vocab, args.steps * args.batch, args.seq, seed=args.seed + 1000 * rank)
    timer, losses = StepTimer(), []
    low = dtype(args) != torch.float32 and args.parallel != "fsdp2"
    autocast = torch.autocast(dev.type, dtype=dtype(args), enabled=low)
    for step in range(args.steps):
        ids = data[step * args.batch:(step + 1) * args.batch].to(dev)
        timer.start()
        with autocast:
            loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        timer.stop()
        mean = loss.detach().clone()
        if world > 1:
            dist.all_reduce(mean)
            mean /= world
        losses.append(mean.item())
    tokens = args.batch * args.seq * world
    if rank == 0:
        return print_result("fused" if fused else "unfused", losses, timer.tokens_per_s(tokens), timer.ms_per_step(),
                            parallel=args.parallel, world_size=world)
    return {"losses": losses, "tokens_per_s": timer.tokens_per_s(tokens)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_model_args(parser, steps=10, batch=4, seq=128)
    parser.add_argument("--parallel", choices=["none", "ddp", "fsdp2"], default="none")
    args = parser.parse_args()
    distributed = "RANK" in os.environ
    if args.parallel != "none" and not distributed:
        parser.error(f"--parallel {args.parallel} runs under torchrun (torchrun --nproc_per_node=N ...)")
    if distributed:
        if on_gpus():
            torch.cuda.set_device(int(os.environ["LOCAL_RANK"]))
        dist.init_process_group("nccl" if on_gpus() else "gloo")
    rank, world = (dist.get_rank(), dist.get_world_size()) if distributed else (0, 1)
    base = load_model(args)  # the same weights on every rank (same seed, or the checkpoint)
    try:
        fused = train(args, base, fused=True, rank=rank, world=world)
        if args.compare:
            unfused = train(args, base, fused=False, rank=rank, world=world)
            if rank == 0:
                print_comparison(fused, unfused)
    finally:
        if distributed:
            dist.barrier()
            dist.destroy_process_group()
    if distributed and not on_gpus():
        # gloo's threads now and then abort the interpreter's teardown ("terminate called without an
        # active exception", SIGABRT) after everything has finished: skip the teardown.
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(0)


if __name__ == "__main__":
    main()
