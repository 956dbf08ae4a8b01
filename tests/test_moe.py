"""Mixture-of-experts blocks: listed as skipped with the reason (not fused yet), their stacked experts
left alone, per-expert MLPs and shared experts fused one by one and exact; look-alikes not listed."""
from __future__ import annotations

import copy

import pytest
import torch
from torch import nn
from transformers import AutoConfig, AutoModelForCausalLM

import torchfuser
from torchfuser.modules import FusedGatedMLP
from torchfuser.patterns.moe import MoEPattern

from arch_sweep import tiny_config


@pytest.mark.parametrize("model_type, block", [
    ("mixtral", "MixtralSparseMoeBlock"), ("qwen3_moe", "Qwen3MoeSparseMoeBlock"), ("olmoe", "OlmoeSparseMoeBlock"),
    ("qwen2_moe", "Qwen2MoeSparseMoeBlock"), ("deepseek_v3", "DeepseekV3MoE"), ("gpt_oss", "GptOssMLP"),
    ("jetmoe", "JetMoeMoE"),
])
def test_moe_blocks_are_listed_as_skipped(model_type, block):
    cfg = tiny_config(model_type) if model_type != "deepseek_v3" else AutoConfig.for_model(
        "deepseek_v3", hidden_size=64, intermediate_size=128, moe_intermediate_size=32, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=4, vocab_size=128, n_routed_experts=4, num_experts_per_tok=2,
        n_group=1, topk_group=1, first_k_dense_replace=0, kv_lora_rank=16, q_lora_rank=16, qk_rope_head_dim=8,
        qk_nope_head_dim=8, v_head_dim=16)
    torch.manual_seed(0)
    ref = AutoModelForCausalLM.from_config(cfg).float()
    model = torchfuser.optimize(copy.deepcopy(ref), backend="reference")
    rep = torchfuser.report(model)
    moe = [e for e in rep.entries if e.pattern == "moe" and e.original == block]
    assert moe and not any(e.is_fused for e in moe)
    assert all(e.reason.startswith("mixture-of-experts block (4 experts") and "not fused yet" in e.reason for e in moe)
    inside = [e for e in rep.fused if any(e.name.startswith(m.name + ".") for m in moe)]
    assert all("shared_expert" in e.name and e.pattern == "gated_mlp" for e in inside)  # stacked experts: nobody's
    ids = torch.randint(3, 128, (2, 8), generator=torch.Generator().manual_seed(1))
    torch.testing.assert_close(model(input_ids=ids).logits, ref(input_ids=ids).logits, rtol=1e-5, atol=1e-5)


class Expert(nn.Module):
    def __init__(self, h=16, i=24):
        super().__init__()
        self.w1, self.w3, self.w2 = nn.Linear(h, i, bias=False), nn.Linear(h, i, bias=False), nn.Linear(i, h, bias=False)
        self.act_fn = nn.SiLU()

    def forward(self, x):
        return self.w2(self.act_fn(self.w1(x)) * self.w3(x))


class PerExpertMoE(nn.Module):
    """Mixtral's block before transformers 5: a Linear router and a ModuleList of expert MLPs."""

    def __init__(self, h=16, n=4):
        super().__init__()
        self.gate = nn.Linear(h, n, bias=False)
        self.experts = nn.ModuleList([Expert(h) for _ in range(n)])

    def forward(self, x):
        weights, chosen = self.gate(x).softmax(-1).topk(2, dim=-1)
        out = torch.zeros_like(x)
        for k in range(2):
            for e, expert in enumerate(self.experts):
                rows = chosen[..., k] == e
                out[rows] += weights[..., k][rows, None] * expert(x[rows])
        return out


def test_per_expert_mlps_are_fused_one_by_one_and_exact():
    torch.manual_seed(0)
    ref = nn.Sequential(PerExpertMoE()).double()
    model = torchfuser.optimize(copy.deepcopy(ref), backend="reference")
    rep = torchfuser.report(model)
    assert [e.pattern for e in rep.skipped] == ["moe"] and "4 modules in 'experts'" in rep.skipped[0].reason
    assert all(isinstance(m, FusedGatedMLP) for m in model[0].experts) and len(rep.fused) == 4
    x = torch.randn(3, 5, 16, dtype=torch.float64)
    torch.testing.assert_close(model(x), ref(x))


class TwoLayers(nn.Module):  # a stack of two blocks and a projection: not a MoE block
    def __init__(self):
        super().__init__()
        self.proj = nn.Linear(16, 2)
        self.layers = nn.ModuleList([nn.Sequential(PerExpertMoE()), nn.Sequential(PerExpertMoE())])


class Convs(nn.Module):  # Mamba's mixer: a conv's 3-D weight is not a stack of experts
    def __init__(self):
        super().__init__()
        self.conv1d = nn.Conv1d(8, 8, 4, groups=8)
        self.dt_proj = nn.Linear(16, 8)


@pytest.mark.parametrize("cls", [TwoLayers, Convs, Expert])
def test_look_alikes_are_not_candidates(cls):
    assert MoEPattern().match(cls()) is None
