"""Post-block-norm layers (OLMo-2, OLMo-3, EXAONE 4, FlexOlmo: s = x + norm(attention(x)), then s + norm(mlp(s))):
recognised and left alone with the reason (a norm-then-add kernel, out = r + rms_norm(a), is missing), the model
still exact with its norms, attention and MLP fused."""
from __future__ import annotations

import copy

import pytest

import torchfuser
from torchfuser.patterns.base import Skip
from torchfuser.patterns.residual_norm import ResidualNormPattern

from numerics import assert_trains_like
from tiny_lm import fused_layers, lm_step as step, tiny_model
from test_residual_norm import Layer


class _PostBlock(Layer):
    def forward(self, hidden_states, attention_mask=None, **kwargs):
        a, _ = self.self_attn(hidden_states=hidden_states, attention_mask=attention_mask, **kwargs)
        s = hidden_states + self.input_layernorm(a)
        return s + self.post_attention_layernorm(self.mlp(s))


class _NormBeforeTheMLPOnly(Layer):  # neither form: no reason of the post-block kind
    def forward(self, hidden_states, attention_mask=None, **kwargs):
        a, _ = self.self_attn(hidden_states=hidden_states, attention_mask=attention_mask, **kwargs)
        s = hidden_states + self.input_layernorm(a)
        return s + self.mlp(self.post_attention_layernorm(s))


def test_a_post_block_layer_is_left_alone_with_the_reason():
    found = ResidualNormPattern().match(_PostBlock())
    assert isinstance(found, Skip) and "norm-then-add" in found.reason, found


def test_another_form_gets_no_post_block_reason():
    found = ResidualNormPattern().match(_NormBeforeTheMLPOnly())
    assert not (isinstance(found, Skip) and "post-block" in found.reason), found


@pytest.mark.parametrize("model_type", ["olmo2", "flex_olmo"])
def test_the_report_says_why_and_the_model_is_exact(model_type):
    ref = tiny_model(model_type)
    fused = copy.deepcopy(ref)
    torchfuser.optimize(fused, backend="reference")
    assert not fused_layers(fused)
    reasons = [e.reason for e in torchfuser.report(fused).skipped if e.pattern == "residual_norm"]
    assert len(reasons) == 2 and all("post-block" in r for r in reasons), reasons
    assert_trains_like(ref, fused, step, list(ref.state_dict()))
