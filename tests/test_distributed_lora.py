"""Two ranks on the CPU (gloo): a fused model with PEFT LoRA adapters trained under FSDP2 and under DDP
goes as the unfused one does (losses, every trained adapter, frozen bases untouched), and a fused
FSDP2 model's sharded checkpoint (torch.distributed.checkpoint) loads whole into plain transformers."""
from __future__ import annotations

import copy
import os

import pytest
import torch
import torch.distributed as dist

import torchfuser
from test_fsdp import VOCAB, _full_params, _model, _train, two_ranks

peft = pytest.importorskip("peft")
fsdp = pytest.importorskip("torch.distributed.fsdp")
if not (dist.is_available() and hasattr(fsdp, "fully_shard")):
    pytest.skip("torch.distributed FSDP2 (fully_shard) is not available", allow_module_level=True)


def _with_lora(model):
    torch.manual_seed(1)
    cfg = peft.LoraConfig(r=4, lora_alpha=8, target_modules="all-linear", lora_dropout=0.0, init_lora_weights=False)
    return peft.get_peft_model(model, cfg)  # B ≠ 0: the adapters change the loss from the first step


def _layers(model):
    return next(m for n, m in model.named_modules() if n.endswith("model.layers"))


def _fsdp2(model):
    from torch.distributed.device_mesh import init_device_mesh

    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    for layer in _layers(model):
        fsdp.fully_shard(layer, mesh=mesh)
    fsdp.fully_shard(model, mesh=mesh)
    return model


def _ddp(model):
    return torch.nn.parallel.DistributedDataParallel(model)


def _compare_lora(rank: int, wrap):
    base = _with_lora(_model())
    fused = torchfuser.optimize(copy.deepcopy(base), backend="reference")
    assert "LoRA r=4" in " ".join(torchfuser.report(fused).notes)
    frozen = {n: p.detach().clone() for n, p in base.named_parameters() if not p.requires_grad}
    plain_model, fused_model = wrap(base), wrap(fused)
    plain_losses, plain = _train(plain_model, rank)
    fused_losses, got = _train(fused_model, rank)
    assert fused_losses == pytest.approx(plain_losses, rel=1e-5)
    assert list(got) == list(plain)
    trained = [n for n in plain if "lora_" in n]
    assert trained and all(not torch.equal(plain[n], _with_lora(_model()).state_dict()[n]) for n in trained[:2])
    for name, want in plain.items():
        # fp32 sums in another order (the joint A GEMM), through two SGD steps at rate 0.5: ~1e-5
        err = (got[name] - want).abs().max() / want.abs().max().clamp_min(1e-12)
        assert err < 5e-5, (name, err.item())
    for name, was in frozen.items():
        assert torch.equal(got[name], was), f"{name}: a frozen base changed"


def _checkpoint(rank: int, path: str, build=_model):
    """A fused FSDP2 model of ``build`` trained a step and saved sharded (each rank writes its shards),
    with its gathered parameters beside the checkpoint (rank 0)."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_model_state_dict

    model = _fsdp2(torchfuser.optimize(build(), backend="reference"))
    _train(model, rank, steps=1)
    dcp.save(get_model_state_dict(model), checkpoint_id=path)
    full = _full_params(model)
    if rank == 0:
        torch.save(full, os.path.join(path, "gathered.pt"))


def load_whole(plain, path: str):
    """The sharded checkpoint at ``path``, read whole without a process group into the plain transformers
    model ``plain``: every parameter equals the gathered one."""
    import torch.distributed.checkpoint as dcp

    state = plain.state_dict()
    dcp.load(state, checkpoint_id=path, no_dist=True)
    plain.load_state_dict(state)
    gathered = torch.load(os.path.join(path, "gathered.pt"))
    assert list(gathered) == [n for n, _ in plain.named_parameters()]
    for name, p in plain.named_parameters():
        assert torch.equal(p, gathered[name]), name
    return plain


def _lora_and_checkpoint(rank: int, ckpt: str):
    _compare_lora(rank, _fsdp2)
    _compare_lora(rank, _ddp)
    _checkpoint(rank, ckpt)


def test_two_ranks_lora_under_fsdp2_and_ddp_and_a_sharded_checkpoint(tmp_path):
    ckpt = str(tmp_path / "ckpt")
    errors = two_ranks(tmp_path, _lora_and_checkpoint, ckpt)
    assert not errors, errors
    plain = load_whole(_model(), ckpt)
    ids = torch.randint(0, VOCAB, (1, 8))
    assert torch.isfinite(plain(input_ids=ids, labels=ids).loss)
