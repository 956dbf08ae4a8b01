"""Two ranks on the CPU (gloo): ``optimize(model, fp8="rowwise")`` under FSDP2 trains as the same FP8 model
under DDP — the FP8 weight copies are made from the unsharded weights FSDP2 gathers for the layer (no
all-gather of their own), so sharding changes nothing of the math: losses and every parameter agree."""
from __future__ import annotations

import copy

import pytest
import torch
import torch.distributed as dist

import torchfuser
from test_distributed_lora import _ddp, _fsdp2
from test_fsdp import _model, _train, two_ranks

fsdp = pytest.importorskip("torch.distributed.fsdp")
if not (dist.is_available() and hasattr(fsdp, "fully_shard")):
    pytest.skip("torch.distributed FSDP2 (fully_shard) is not available", allow_module_level=True)


def _compare(rank: int):
    fused = torchfuser.optimize(_model(), backend="reference", fp8="rowwise")
    assert any(n.startswith("fp8: rowwise") for n in torchfuser.report(fused).notes)
    ddp_losses, ddp = _train(_ddp(copy.deepcopy(fused)), rank, seq=16, autocast=True)  # 32 tokens: FP8 takes multiples of 16
    sharded_losses, sharded = _train(_fsdp2(fused), rank, seq=16, autocast=True)
    assert not torchfuser.report(fused).fallbacks  # every projection ran its FP8 GEMMs, sharded too
    assert sharded_losses == pytest.approx(ddp_losses, rel=1e-5)
    assert list(sharded) == list(ddp)
    for name, want in ddp.items():
        err = (sharded[name] - want).abs().max() / want.abs().max().clamp_min(1e-12)
        assert err < 1e-4, (name, err.item())


def test_two_ranks_fp8_under_fsdp2_as_under_ddp(tmp_path):
    errors = two_ranks(tmp_path, _compare)
    assert not errors, errors
