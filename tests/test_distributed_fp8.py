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
from test_fsdp import VOCAB, _full_params, _model, two_ranks

fsdp = pytest.importorskip("torch.distributed.fsdp")
if not (dist.is_available() and hasattr(fsdp, "fully_shard")):
    pytest.skip("torch.distributed FSDP2 (fully_shard) is not available", allow_module_level=True)


def _train_bf16(model, rank: int, steps: int = 2):
    opt = torch.optim.SGD(model.parameters(), lr=0.5)
    gen = torch.Generator().manual_seed(10 + rank)
    losses = []
    for _ in range(steps):
        ids = torch.randint(0, VOCAB, (2, 16), generator=gen)  # 32 tokens: FP8 GEMMs take multiples of 16
        with torch.autocast("cpu", dtype=torch.bfloat16):
            loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        losses.append(loss.item())
        opt.step()
        opt.zero_grad(set_to_none=True)
    return losses, _full_params(model)


def _compare(rank: int):
    fused = torchfuser.optimize(_model(), backend="reference", fp8="rowwise")
    assert any(n.startswith("fp8: rowwise") for n in torchfuser.report(fused).notes)
    ddp_losses, ddp = _train_bf16(_ddp(copy.deepcopy(fused)), rank)
    sharded_losses, sharded = _train_bf16(_fsdp2(fused), rank)
    assert not torchfuser.report(fused).fallbacks  # every projection ran its FP8 GEMMs, sharded too
    assert sharded_losses == pytest.approx(ddp_losses, rel=1e-5)
    assert list(sharded) == list(ddp)
    for name, want in ddp.items():
        err = (sharded[name] - want).abs().max() / want.abs().max().clamp_min(1e-12)
        assert err < 1e-4, (name, err.item())


def test_two_ranks_fp8_under_fsdp2_as_under_ddp(tmp_path):
    errors = two_ranks(tmp_path, _compare)
    assert not errors, errors
