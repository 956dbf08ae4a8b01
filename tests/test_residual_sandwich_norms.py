"""Decoder layers with a norm before and after each block (Gemma-2/3's, GLM-4's, HyperCLOVA X's "sandwich"):
s = x + post_attention_norm(attention(norm_in(x))); out = s + post_mlp_norm(mlp(norm_mid(s))). The roles come from
the order the forward calls its four norms (``_residual_probe.sandwich_roles``), the formula from the probe; the
middle add goes into norm_mid's kernel (``ResidualNormSpec.post_attention_norm`` / ``post_mlp_norm``). One fp32
training step fused vs unfused (loss and every gradient), and what is left alone."""
from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

import torchfuser
from torchfuser.modules import fallbacks
from torchfuser.patterns.base import Skip
from torchfuser.patterns.residual_norm import ResidualNormPattern

from numerics import assert_bf16_within_rule, assert_trains_like
from tiny_lm import assert_generates_like, fused_layers, lm_step as step, tiny_model
from test_residual_norm import H, Layer, RMSNorm

# model type, (norm_in, post_attention_norm, norm_mid, post_mlp_norm)
_TYPES = [
    ("gemma2", ("input_layernorm", "post_attention_layernorm", "pre_feedforward_layernorm", "post_feedforward_layernorm")),
    ("glm4", ("input_layernorm", "post_self_attn_layernorm", "post_attention_layernorm", "post_mlp_layernorm")),
]


@pytest.mark.parametrize("model_type, roles", _TYPES, ids=[t[0] for t in _TYPES])
def test_training_step_matches_unfused(model_type, roles):
    ref = tiny_model(model_type)
    fused = copy.deepcopy(ref)
    torchfuser.optimize(fused, backend="reference")
    found = fused_layers(fused)
    assert len(found) == 2, str(torchfuser.report(fused))
    assert {(s.norm_in, s.post_attention_norm, s.norm_mid, s.post_mlp_norm)
            for s in (m.forward.spec for m in found)} == {roles}
    assert_trains_like(ref, fused, step, list(ref.state_dict()))


class _Sandwich(Layer):
    """Norms declared in another order than they are called: the roles come from the calls."""

    def __init__(self, drop: float | None = None):
        super().__init__()
        self.after_mlp, self.after_attn = RMSNorm(), RMSNorm()
        self.drop = nn.Identity() if drop is None else nn.Dropout(drop)

    def forward(self, hidden_states, attention_mask=None):
        a, _ = self.self_attn(hidden_states=self.input_layernorm(hidden_states), attention_mask=attention_mask)
        h = hidden_states + self.drop(self.after_attn(a))
        return h + self.after_mlp(self.mlp(self.post_attention_layernorm(h)))


def test_a_sandwich_layer_is_fused_exactly():
    torch.manual_seed(0)
    ref = _Sandwich().double()
    spec = ResidualNormPattern().match(ref)
    assert (spec.norm_in, spec.post_attention_norm, spec.norm_mid, spec.post_mlp_norm) == (
        "input_layernorm", "after_attn", "post_attention_layernorm", "after_mlp")
    model = nn.ModuleDict(dict(layer=copy.deepcopy(ref)))
    torchfuser.optimize(model, backend="reference")
    x = torch.randn(2, 5, H, dtype=torch.float64, requires_grad=True)
    x2 = x.detach().clone().requires_grad_()
    g = torch.randn(2, 5, H, dtype=torch.float64)
    (ref(x) * g).sum().backward()
    (model.layer(x2) * g).sum().backward()
    torch.testing.assert_close(x2.grad, x.grad)
    for (n, a), (_, b) in zip(ref.named_parameters(), model.layer.named_parameters()):
        torch.testing.assert_close(b.grad, a.grad, msg=n)
    assert not fallbacks.counts(model)


def test_a_sandwich_with_a_dropout_is_left_alone_with_the_reason():
    found = ResidualNormPattern().match(_Sandwich(drop=0.1).train())
    assert isinstance(found, Skip) and "sandwich" in found.reason, found


def test_four_norms_in_another_order_are_not_a_sandwich():
    class _TwoBefore(_Sandwich):  # two norms in a row before the attention: no sandwich
        def forward(self, hidden_states, attention_mask=None):
            n = self.after_attn(self.input_layernorm(hidden_states))
            h = hidden_states + self.self_attn(hidden_states=n, attention_mask=attention_mask)[0]
            return h + self.after_mlp(self.mlp(self.post_attention_layernorm(h)))

    assert not hasattr(ResidualNormPattern().match(_TwoBefore()), "post_attention_norm")


@pytest.mark.parametrize("model_type", ["gemma3_text", "glm4", "modernbert-decoder", "ctrl", "bamba"])
def test_bf16_within_the_rule(model_type):
    """bf16 weights and activations, each new form (sandwich, identity first norm, v/k/q attention, one-tensor
    mixer): the fused model's loss and every gradient no further from the float64 model's than twice the unfused
    bf16 model's error (+ a small atol)."""
    ref64 = tiny_model(model_type).double()
    plain = copy.deepcopy(ref64).to(torch.bfloat16)
    fused = copy.deepcopy(plain)
    torchfuser.optimize(fused, backend="reference")
    assert len(fused_layers(fused)) == 2, str(torchfuser.report(fused))
    assert_bf16_within_rule(fused, plain, ref64, step)


@pytest.mark.parametrize("model_type", ["gemma2", "modernbert-decoder", "bamba", "llama4_text"])
def test_under_gradient_checkpointing(model_type):
    """transformers' gradient checkpointing on: the fused forward checkpoints each new form itself (a sandwich, an
    identity first norm, a layer returning (hidden, None), a viewed tuple MLP), exactly as the unfused model."""
    ref = tiny_model(model_type)
    ref.gradient_checkpointing_enable()
    fused = copy.deepcopy(ref)
    torchfuser.optimize(fused, backend="reference")
    assert len(fused_layers(fused)) == 2, str(torchfuser.report(fused))
    assert_trains_like(ref, fused, step, list(ref.state_dict()))


@pytest.mark.parametrize("model_type", ["gemma3_text", "modernbert-decoder", "ctrl", "qwen3_next", "llama4_text"])
def test_generate_equals_unfused(model_type):
    """Greedy decoding with the cache (no_grad: the fused forward's decode path) gives the unfused model's tokens,
    every call fused."""
    ref = tiny_model(model_type).eval()
    fused = copy.deepcopy(ref)
    torchfuser.optimize(fused, backend="reference")
    assert_generates_like(ref, fused)
    assert len(fused_layers(fused)) == 2 and not fallbacks.counts(fused), fallbacks.counts(fused)
