"""Two ranks on the CPU (gloo): a model whose MoE blocks are fused trains under FSDP2 (the stacked expert
weights sharded along the experts) and under DDP as the unfused one does — losses and every parameter,
experts and router included, after SGD steps — and its sharded checkpoint loads into plain transformers."""
from __future__ import annotations

import copy

import pytest
import torch
import torch.distributed as dist
from transformers import MixtralConfig, MixtralForCausalLM

import torchfuser
from test_distributed_lora import _checkpoint, _ddp, _fsdp2, load_whole
from test_fsdp import VOCAB, _train, two_ranks

fsdp = pytest.importorskip("torch.distributed.fsdp")
if not (dist.is_available() and hasattr(fsdp, "fully_shard")):
    pytest.skip("torch.distributed FSDP2 (fully_shard) is not available", allow_module_level=True)


def _mixtral():
    cfg = MixtralConfig(hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
                        num_key_value_heads=2, vocab_size=VOCAB, num_local_experts=4, num_experts_per_tok=2,
                        tie_word_embeddings=False, attn_implementation="sdpa")
    torch.manual_seed(0)
    return MixtralForCausalLM(cfg)


def _compare(rank: int, wrap):
    base = _mixtral()
    fused = torchfuser.optimize(copy.deepcopy(base), backend="reference")
    assert sum(e.pattern == "moe" for e in torchfuser.report(fused).fused) == 2
    plain_losses, plain = _train(wrap(base), rank)
    fused_losses, got = _train(wrap(fused), rank)
    assert fused_losses == pytest.approx(plain_losses, rel=1e-5)
    assert list(got) == list(plain)
    for name, want in plain.items():
        err = (got[name] - want).abs().max() / want.abs().max().clamp_min(1e-12)
        assert err < 5e-5, (name, err.item())
    moved = [n for n in plain if "experts" in n and not torch.equal(plain[n], _mixtral().state_dict()[n])]
    assert moved, "the experts did not train: nothing was compared"


def _both(rank: int, ckpt: str):
    _compare(rank, _fsdp2)
    _compare(rank, _ddp)
    _checkpoint(rank, ckpt, _mixtral)


def test_two_ranks_moe_under_fsdp2_and_ddp_and_a_sharded_checkpoint(tmp_path):
    ckpt = str(tmp_path / "ckpt")
    errors = two_ranks(tmp_path, _both, ckpt)
    assert not errors, errors
    load_whole(_mixtral(), ckpt)  # the sharded checkpoint, read whole into plain transformers
