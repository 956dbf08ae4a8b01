"""Shape coincidences never make a candidate vanish from the report.

The patterns read roles from shapes first (an MLP's projections chain H → I → H), then let a probe
decide. Where sizes coincide (an intermediate size equal to the hidden size: gate, up and down all
H → H) the shapes alone name no role; the probe, whose widths differ, decides among every assignment
the shapes allow, and the block is fused (or listed as skipped with the reason). Before, a gated MLP
with I = H was no candidate at all: neither fused nor skipped ("0 skipped")."""
from __future__ import annotations

import copy

import pytest
import torch
from torch import nn
from transformers import AutoConfig, AutoModelForCausalLM

import torchfuser
from torchfuser.modules.mlp import FusedGatedMLP, FusedMLP

H = 64
BASE = {
    "llama": dict(vocab_size=128, hidden_size=H, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
                  num_key_value_heads=2),
    "qwen2_moe": dict(vocab_size=128, hidden_size=H, intermediate_size=96, moe_intermediate_size=32,
                      shared_expert_intermediate_size=48, num_experts=4, num_experts_per_tok=2, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2),
    "mixtral": dict(vocab_size=128, hidden_size=H, intermediate_size=96, num_local_experts=4, num_experts_per_tok=2,
                    num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2),
    "gpt2": dict(vocab_size=128, n_embd=H, n_inner=96, n_layer=2, n_head=4, n_positions=64),
}
# (model type, name, overrides): sizes that coincide
COINCIDENCES = [
    ("llama", "intermediate=hidden", dict(intermediate_size=H)),
    ("llama", "2*intermediate=hidden", dict(intermediate_size=H // 2)),
    ("llama", "vocab=hidden", dict(vocab_size=H)),
    ("llama", "vocab=intermediate", dict(vocab_size=96)),
    ("llama", "q size=kv size (MHA)", dict(num_key_value_heads=4)),
    ("llama", "heads*head_dim!=hidden", dict(head_dim=32)),
    ("qwen2_moe", "shared expert intermediate=hidden", dict(shared_expert_intermediate_size=H)),
    ("qwen2_moe", "expert intermediate=hidden", dict(moe_intermediate_size=H)),
    ("mixtral", "expert intermediate=hidden", dict(intermediate_size=H)),
    ("mixtral", "2*expert intermediate=hidden", dict(intermediate_size=H // 2)),
    ("mixtral", "experts=hidden", dict(num_local_experts=H)),
    ("mixtral", "experts=top-k", dict(num_local_experts=2)),
    ("gpt2", "inner=hidden", dict(n_inner=H)),
    ("gpt2", "vocab=hidden", dict(vocab_size=H)),
]


def _model(model_type: str, **overrides):
    torch.manual_seed(0)
    cfg = AutoConfig.for_model(model_type, **{**BASE[model_type], **overrides})
    for name in ("pad_token_id", "bos_token_id", "eos_token_id"):
        if isinstance(getattr(cfg, name, None), int) and getattr(cfg, name) >= cfg.vocab_size:
            setattr(cfg, name, 0)
    return AutoModelForCausalLM.from_config(cfg).float()


def _candidates(model) -> dict[str, int]:
    """Per pattern, the candidates the report lists (fused or skipped)."""
    return {p: c["fused"] + c["skipped"] for p, c in torchfuser.report(model).counts().items()}


@pytest.mark.parametrize("model_type, what, overrides", COINCIDENCES, ids=[f"{t}-{w}" for t, w, _ in COINCIDENCES])
def test_every_candidate_is_in_the_report_whatever_the_sizes(model_type, what, overrides):
    want = _candidates(torchfuser.optimize(_model(model_type), backend="reference"))
    model = torchfuser.optimize(_model(model_type, **overrides), backend="reference")
    assert _candidates(model) == want, f"{model_type} with {what}: {torchfuser.report(model)}"
    assert not torchfuser.report(model).skipped or model_type == "qwen2_moe"  # (as with its default sizes)


def _step(model, ids):
    model.zero_grad(set_to_none=True)
    loss = model(input_ids=ids, labels=ids).loss
    loss.backward()
    return loss.detach(), {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


@pytest.mark.parametrize("model_type, overrides", [("llama", dict(intermediate_size=H)),
                                                   ("qwen2_moe", dict(shared_expert_intermediate_size=H))],
                         ids=["llama", "qwen2_moe-shared-expert"])
def test_gated_mlp_with_intermediate_equal_to_hidden_is_fused_and_exact(model_type, overrides):
    base = _model(model_type, **overrides)
    fused = torchfuser.optimize(copy.deepcopy(base), backend="reference")
    report = torchfuser.report(fused)
    assert report.counts()["gated_mlp"] == {"fused": 2, "skipped": 0}, report
    mlps = [m for m in fused.modules() if isinstance(m, FusedGatedMLP)]
    assert len(mlps) == 2 and all((m.spec.gate, m.spec.up, m.spec.down) == ("gate_proj", "up_proj", "down_proj")
                                  for m in mlps)
    assert list(fused.state_dict()) == list(base.state_dict())
    ids = torch.randint(0, 128, (2, 12), generator=torch.Generator().manual_seed(1))
    want, want_g = _step(base, ids)
    got, got_g = _step(fused, ids)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)
    assert list(got_g) == list(want_g)
    for name, g in want_g.items():
        torch.testing.assert_close(got_g[name], g, rtol=1e-4, atol=1e-6, msg=name)
    torchfuser.restore(fused)
    assert not any(isinstance(m, FusedGatedMLP) for m in fused.modules())


class _DownFirstGatedMLP(nn.Module):
    """A gated MLP whose children are declared down, up, gate, all H → H: nothing in names or order helps."""

    def __init__(self, d=16):
        super().__init__()
        self.c, self.b, self.a = nn.Linear(d, d, bias=False), nn.Linear(d, d, bias=False), nn.Linear(d, d, bias=False)
        self.act = nn.SiLU()

    def forward(self, x):
        return self.c(self.act(self.a(x)) * self.b(x))


class _OutFirstMLP(nn.Module):
    """A GELU MLP with I = H whose output projection is declared first."""

    def __init__(self, d=16):
        super().__init__()
        self.proj_out, self.proj_in, self.act = nn.Linear(d, d), nn.Linear(d, d), nn.GELU()

    def forward(self, x):
        return self.proj_out(self.act(self.proj_in(x)))


class _Block(nn.Module):
    def __init__(self, child):
        super().__init__()
        self.child = child

    def forward(self, x):
        return self.child(x)


@pytest.mark.parametrize("child, fused_type, roles", [
    (_DownFirstGatedMLP, FusedGatedMLP, dict(gate="a", up="b", down="c")),
    (_OutFirstMLP, FusedMLP, dict(fc_in="proj_in", fc_out="proj_out")),
], ids=["gated", "plain"])
def test_roles_of_square_projections_are_found_by_the_probe(child, fused_type, roles):
    torch.manual_seed(0)
    block = _Block(child())
    x = torch.randn(5, 16)
    want = block(x)
    torchfuser.optimize(block, backend="reference")
    assert isinstance(block.child, fused_type), torchfuser.report(block)
    assert {k: getattr(block.child.spec, k) for k in roles} == roles
    torch.testing.assert_close(block(x), want, rtol=1e-5, atol=1e-6)
