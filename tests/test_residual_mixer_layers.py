"""Pre-norm layers of hybrid models whose attention-like block is a linear-attention or recurrent mixer returning
one tensor, not transformers' (output, weights) pair (Qwen3-Next's and Qwen3.5's Gated DeltaNet, Jamba's and
Bamba's Mamba, Kimi Linear's: ``ResidualNormSpec.attention_single``), and layers returning (hidden states, None)
(Bamba's: ``returns_none``), and two MLP blocks on one norm's output summed (Granite 4's MoE and shared MLP:
``mlp2``). One fp32 training step fused vs unfused (loss and every gradient)."""
from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

import torchfuser
from torchfuser.modules import fallbacks
from torchfuser.patterns.residual_norm import ResidualNormPattern

from numerics import assert_trains_like
from tiny_lm import fused_layers, lm_step as step, tiny_model
from test_residual_norm import H, Layer

# model type, (attention_single, returns_none) of its two fused layers
_TYPES = [
    ("qwen3_next", {(True, False), (False, False)}),  # a Gated DeltaNet layer and a full-attention one
    ("jamba", {(True, False)}),  # Mamba layers (its attention layers come later)
    ("bamba", {(True, True)}),  # Mamba layers returning (hidden states, None)
    ("granitemoehybrid", {(True, False)}),  # Mamba layers, their MoE and shared MLP summed (``mlp2``)
]


@pytest.mark.parametrize("model_type, forms", _TYPES, ids=[t[0] for t in _TYPES])
def test_training_step_matches_unfused(model_type, forms):
    ref = tiny_model(model_type)
    fused = copy.deepcopy(ref)
    torchfuser.optimize(fused, backend="reference")
    found = fused_layers(fused)
    assert len(found) == 2, str(torchfuser.report(fused))
    assert {(m.forward.spec.attention_single, m.forward.spec.returns_none) for m in found} == forms
    assert {(m.forward.spec.mlp, m.forward.spec.mlp2) for m in found} == (
        {("block_sparse_moe", "shared_mlp")} if model_type == "granitemoehybrid" else {(found[0].forward.spec.mlp, None)})
    assert_trains_like(ref, fused, step, list(ref.state_dict()))


class _Mixer(nn.Module):
    """A recurrent-style mixer: one tensor out, takes an attention mask (so the layer's attention-like block)."""

    def __init__(self):
        super().__init__()
        self.in_proj, self.out_proj = nn.Linear(H, 2 * H), nn.Linear(H, H)

    def forward(self, hidden_states, attention_mask=None):
        a, b = self.in_proj(hidden_states).chunk(2, -1)
        return self.out_proj(torch.cumsum(a * torch.sigmoid(b), dim=1))


class _MixerLayer(Layer):
    def __init__(self, returns_none: bool = False):
        super().__init__()
        self.self_attn, self.returns_none = _Mixer(), returns_none

    def forward(self, hidden_states, attention_mask=None):
        h = hidden_states + self.self_attn(self.input_layernorm(hidden_states), attention_mask=attention_mask)
        out = h + self.mlp(self.post_attention_layernorm(h))
        return (out, None) if self.returns_none else out


@pytest.mark.parametrize("returns_none", [False, True])
def test_a_mixer_returning_one_tensor(returns_none):
    torch.manual_seed(0)
    ref = _MixerLayer(returns_none).double()
    spec = ResidualNormPattern().match(ref)
    assert spec.attention_single and spec.returns_none == returns_none
    model = nn.ModuleDict(dict(layer=copy.deepcopy(ref)))
    torchfuser.optimize(model, backend="reference")
    x = torch.randn(2, 5, H, dtype=torch.float64, requires_grad=True)
    x2 = x.detach().clone().requires_grad_()
    want, got = ref(x), model.layer(x2)
    if returns_none:
        assert got[1] is None and len(got) == 2
        want, got = want[0], got[0]
    g = torch.randn_like(want)
    (want * g).sum().backward()
    (got * g).sum().backward()
    torch.testing.assert_close(x2.grad, x.grad)
    for (n, a), (_, b) in zip(ref.named_parameters(), model.layer.named_parameters()):
        torch.testing.assert_close(b.grad, a.grad, msg=n)
    assert not fallbacks.counts(model)


def test_a_layer_indexing_a_one_tensor_mixer_is_not_taken_for_one():
    class _Indexes(_MixerLayer):  # takes row 0 of the mixer's output: neither form
        def forward(self, hidden_states, attention_mask=None):
            h = hidden_states + self.self_attn(self.input_layernorm(hidden_states), attention_mask=attention_mask)[0]
            return h + self.mlp(self.post_attention_layernorm(h))

    found = ResidualNormPattern().match(_Indexes())
    assert not getattr(found, "attention_single", False)


class _TwoMLPs(Layer):
    """Granite 4's form: the MoE block's and the shared MLP's outputs summed, times a residual multiplier."""

    def __init__(self, product: bool = False):
        super().__init__()
        self.shared, self.product, self.residual_multiplier = nn.Linear(H, H), product, 0.5

    def forward(self, hidden_states, attention_mask=None):
        a, _ = self.self_attn(hidden_states=self.input_layernorm(hidden_states), attention_mask=attention_mask)
        h = hidden_states + a * self.residual_multiplier
        n = self.post_attention_layernorm(h)
        m = self.mlp(n) * self.shared(n) if self.product else self.mlp(n) + self.shared(n)
        return h + m * self.residual_multiplier


def test_two_mlps_summed():
    torch.manual_seed(0)
    ref = _TwoMLPs().double()
    spec = ResidualNormPattern().match(ref)
    assert (spec.mlp, spec.mlp2, spec.attention_scale, spec.mlp_scale) == (
        "mlp", "shared", "residual_multiplier", "residual_multiplier")
    model = nn.ModuleDict(dict(layer=copy.deepcopy(ref)))
    torchfuser.optimize(model, backend="reference")
    x = torch.randn(2, 5, H, dtype=torch.float64)
    torch.testing.assert_close(model.layer(x), ref(x))
    assert not fallbacks.counts(model)
    assert not hasattr(ResidualNormPattern().match(_TwoMLPs(product=True)), "mlp2")  # a product is not that form
