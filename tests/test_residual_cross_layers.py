"""Decoder layers of encoder-decoder families used as causal LMs (BART, mBART, Marian, Pegasus, PLBart, Whisper,
Blenderbot: ``*ForCausalLM``): a self-attention, an inline MLP (fc1 → activation → fc2) and two norms, post-norm
(BART) or pre-norm (mBART), beside a cross-attention and its norm that run only with encoder states
(``_residual_roles.cross_pairs``: the probe's stand-ins for the pair raise, so ``encoder_hidden_states`` must stay
at its default for the fused path; with encoder states each call runs the original forward). One fp32 training step
fused vs unfused (loss and every gradient), the dropouts on, decoding, and the seq2seq model."""
from __future__ import annotations

import copy
import re

import pytest
import torch
from torch import nn

import torchfuser
from torchfuser.modules import fallbacks
from torchfuser.patterns.residual_norm import ResidualNormPattern

from numerics import assert_step_like, assert_trains_like
from tiny_lm import assert_generates_like, fused_layers, lm_step as step, tiny_model
from test_residual_norm import H, Layer

# model type, post-norm
_TYPES = [("bart", True), ("mbart", False), ("whisper", False)]


@pytest.mark.parametrize("model_type, post", _TYPES, ids=[t[0] for t in _TYPES])
def test_training_step_matches_unfused(model_type, post):
    ref = tiny_model(model_type)
    fused = copy.deepcopy(ref)
    torchfuser.optimize(fused, backend="reference")
    found = fused_layers(fused)
    assert len(found) == 2, str(torchfuser.report(fused))
    specs = {m.forward.spec for m in found}
    assert {(s.post_norm, s.attention, s.norm_in, s.norm_mid, s.mlp_inline[::2]) for s in specs} == {
        (post, "self_attn", "self_attn_layer_norm", "final_layer_norm", ("fc1", "fc2"))}
    assert all("encoder_hidden_states" in s.at_default for s in specs)
    assert_trains_like(ref, fused, step, list(ref.state_dict()))


def test_the_dropouts_are_placed():
    ref = tiny_model("bart", dropout=0.2, activation_dropout=0.3)
    fused = copy.deepcopy(ref)
    torchfuser.optimize(fused, backend="reference")
    found = fused_layers(fused)
    assert len(found) == 2, str(torchfuser.report(fused))
    assert {(m.forward.spec.attention_dropout, m.forward.spec.mlp_dropout, m.forward.spec.mlp_inner_dropout)
            for m in found} == {("dropout", "dropout", "activation_dropout")}
    assert_trains_like(ref, fused, step, list(ref.state_dict()))


def test_generate_equals_unfused():
    ref = tiny_model("mbart").eval()
    fused = copy.deepcopy(ref)
    torchfuser.optimize(fused, backend="reference")
    assert_generates_like(ref, fused)
    assert len(fused_layers(fused)) == 2 and not fallbacks.counts(fused), fallbacks.counts(fused)


def test_with_encoder_states_the_original_runs():
    """The seq2seq model: its decoder layers get encoder states, so each call runs the original forward (counted
    with the reason), and the step is the unfused one."""
    from transformers import AutoModelForSeq2SeqLM

    cfg = tiny_model("bart").config
    torch.manual_seed(0)
    ref = AutoModelForSeq2SeqLM.from_config(cfg).float().train()
    fused = copy.deepcopy(ref)
    torchfuser.optimize(fused, backend="reference")
    ids = torch.randint(3, 128, (2, 10), generator=torch.Generator().manual_seed(1))

    def step_on_ids(m):
        loss = m(input_ids=ids, labels=ids, use_cache=False).loss
        loss.backward()
        return loss.detach()

    assert_step_like(ref, fused, step_on_ids)
    decoder = {n: c for n, c in fallbacks.counts(fused).items() if re.search(r"decoder\.layers\.\d+$", n)}
    assert len(decoder) == 2 and all(c == {"keywords its forward does not pass on to the attention": 1}
                                     for c in decoder.values()), decoder


class _Unpassed(Layer):
    """A parameter of its own it hands no child (BART's use_cache)."""

    def forward(self, hidden_states, attention_mask=None, use_cache=None, **kwargs):
        h, _ = self.self_attn(hidden_states=self.input_layernorm(hidden_states), attention_mask=attention_mask, **kwargs)
        h = hidden_states + h
        return h + self.mlp(self.post_attention_layernorm(h))


def test_a_parameter_the_original_passes_on_to_no_child_is_not_passed_on():
    layer = _Unpassed()
    assert ResidualNormPattern().match(layer).unpassed == ("use_cache",)
    model = nn.ModuleDict(dict(layer=layer))
    torchfuser.optimize(model, backend="reference")
    model.layer(torch.randn(2, 3, H), attention_mask=None, use_cache=True, other=1)
    assert layer.self_attn.calls[-1] == dict(attention_mask=None, other=1), layer.self_attn.calls[-1]
    assert not fallbacks.counts(model)
