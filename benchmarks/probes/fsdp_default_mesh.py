"""Where FSDP2's ``fully_shard`` puts a CPU model's shards when no mesh is given, on a machine with
a GPU: the explanation of the two-rank gloo test's SIGSEGV on the H200 (each rank's shards went to
cuda:0, and gloo's collectives ran on them). With a CPU mesh they stay on the CPU.

    python3 benchmarks/probes/fsdp_default_mesh.py
"""
from __future__ import annotations

import os
import tempfile

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard


def main() -> None:
    with tempfile.TemporaryDirectory() as tmp:
        dist.init_process_group("gloo", init_method=f"file://{os.path.join(tmp, 'store')}", rank=0, world_size=1)
        try:
            default = fully_shard(nn.Linear(8, 8))
            mesh = fully_shard(nn.Linear(8, 8), mesh=init_device_mesh("cpu", (1,)))
            print(f"cuda available: {torch.cuda.is_available()}; fully_shard without a mesh: shards on "
                  f"{default.weight.device}; with a CPU mesh: {mesh.weight.device}")
        finally:
            dist.destroy_process_group()


if __name__ == "__main__":
    main()
