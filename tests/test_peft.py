"""LoRA adapters (PEFT) with fused models, in either order: loss and every adapter gradient as the
unfused model's; the blocks stay fused either way (the LoRA math itself: tests/test_lora_fused.py)."""
from __future__ import annotations

import copy

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM

import torchfuser
from torchfuser.modules import FusedAttention, FusedGatedMLP

peft = pytest.importorskip("peft")

TARGETS = ["q_proj", "v_proj", "gate_proj", "down_proj"]


def _base():
    cfg = LlamaConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                      num_key_value_heads=2, vocab_size=128, attn_implementation="sdpa")
    torch.manual_seed(0)
    return LlamaForCausalLM(cfg)


def _lora(model):
    config = peft.LoraConfig(r=4, target_modules=TARGETS, lora_dropout=0.0, init_lora_weights=False)
    return peft.get_peft_model(model, config)


def _same_training(ref, fused):
    ids = torch.randint(0, 128, (2, 10), generator=torch.Generator().manual_seed(1))
    a, b = ref(input_ids=ids, labels=ids), fused(input_ids=ids, labels=ids)
    torch.testing.assert_close(b.loss, a.loss, rtol=1e-5, atol=1e-6)
    a.loss.backward()
    b.loss.backward()
    grads = {n: p.grad for n, p in ref.named_parameters() if p.grad is not None}
    assert grads and all("lora_" in n for n in grads)  # the base model is frozen
    fused_grads = {n: p.grad for n, p in fused.named_parameters() if p.grad is not None}
    assert list(fused_grads) == list(grads)
    for n, g in grads.items():
        torch.testing.assert_close(fused_grads[n], g, rtol=1e-4, atol=1e-6, msg=n)


def test_lora_after_optimize_keeps_the_fusion():
    ref = _lora(_base())
    fused = _lora(torchfuser.optimize(_base(), backend="reference"))
    assert list(fused.state_dict()) == list(ref.state_dict())
    fused.load_state_dict(ref.state_dict())  # the same adapter weights (their init draws differ)
    layer = fused.base_model.model.model.layers[0]
    assert isinstance(layer.self_attn, FusedAttention) and isinstance(layer.mlp, FusedGatedMLP)
    assert isinstance(layer.self_attn.q_proj, peft.tuners.lora.Linear)  # run as itself inside the fused block
    _same_training(ref, fused)
    merged = fused.merge_and_unload()  # adapters folded into the weights: plain Linear again, still fused
    assert isinstance(merged.model.layers[0].mlp, FusedGatedMLP)
    ids = torch.randint(0, 128, (2, 10))
    ref_merged = copy.deepcopy(ref).merge_and_unload()
    torch.testing.assert_close(merged(input_ids=ids, labels=ids).loss, ref_merged(input_ids=ids, labels=ids).loss,
                               rtol=1e-5, atol=1e-6)


def test_lora_before_optimize_keeps_the_fusion():
    ref = _lora(_base())
    fused = copy.deepcopy(ref)
    torchfuser.optimize(fused, backend="reference")
    rep = torchfuser.report(fused)
    assert rep.counts()["attention"] == {"fused": 2, "skipped": 0}
    assert rep.counts()["gated_mlp"] == {"fused": 2, "skipped": 0}
    assert list(fused.state_dict()) == list(ref.state_dict())
    layer = fused.base_model.model.model.layers[0]
    assert layer.self_attn.lora_summary == layer.mlp.lora_summary == "LoRA r=4"
    _same_training(ref, fused)


def test_lora_after_optimize_on_a_bf16_base_within_the_rule():
    """Frozen bf16 base, PEFT's fp32 adapters, no autocast (the fused node's hi/lo bf16 GEMMs): loss and
    every adapter gradient within DESIGN.md's rule against the same PEFT model in float64."""
    from numerics import assert_within_rule
    ref = _lora(_base().to(torch.bfloat16))
    fused = _lora(torchfuser.optimize(_base().to(torch.bfloat16), backend="reference"))
    fused.load_state_dict(ref.state_dict())
    assert fused.base_model.model.model.layers[0].self_attn.q_proj.lora_A.default.weight.dtype == torch.float32
    ref64 = copy.deepcopy(ref).double()
    ids = torch.randint(0, 128, (2, 10), generator=torch.Generator().manual_seed(1))
    runs = []
    for model in (fused, ref, ref64):
        loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        runs.append((loss.detach(), {n: p.grad for n, p in model.named_parameters() if p.grad is not None}))
    (lf, gf), (ls, gs), (l64, g64) = runs
    assert_within_rule(lf, ls, l64, 1e-3, "loss")
    assert list(gf) == list(g64) and len(g64) == 2 * 2 * len(TARGETS)
    for n, g in g64.items():
        assert_within_rule(gf[n], gs[n], g, 2 ** -7 * g.abs().max().item(), n)
