"""Dropout between a decoder layer's blocks in training, with PyTorch's semantics: the fused forward calls the
layer's own dropout (its nn.Dropout child, or the functional dropout with the p it reads) on the attention's
and the MLP's output at the point and in the order of random draws of the original
(``patterns._residual_dropout`` finds the place; ``ResidualNormSpec.attention_dropout`` / ``mlp_dropout``).
From one seed the masks are the original's: one training step with p > 0, the loss and every gradient against
the unfused model, per family form (sequential, parallel with one or two norms, post-norm, config-read p),
under gradient checkpointing too; a layer whose dropout draws elsewhere in the order is not placed."""
from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

import torchfuser
from torchfuser.patterns.residual_norm import ResidualNormPattern

from numerics import assert_cuda_steps_like, assert_trains_like
from tiny_lm import fused_layers, lm_step as step, tiny_model
from test_residual_norm import Layer

# model type, its dropout fields at p > 0, the (attention's, MLP's) dropout the probe must place
_FORMS = [
    ("phi3", dict(resid_pdrop=0.2), ("resid_attn_dropout", "resid_mlp_dropout")),  # sequential, two children
    ("gpt_neox", dict(hidden_dropout=0.2), ("post_attention_dropout", "post_mlp_dropout")),  # parallel, two norms
    ("phi", dict(resid_pdrop=0.2), ("resid_dropout", "resid_dropout")),  # parallel, one norm, one child twice
    ("stablelm", dict(hidden_dropout=0.2), (None, "dropout")),
    ("opt", dict(dropout=0.2), ("dropout", "dropout")),  # a float attribute read by the functional dropout
]


@pytest.mark.parametrize("model_type, fields, placed", _FORMS, ids=[f[0] for f in _FORMS])
def test_training_step_with_dropout_matches_unfused(model_type, fields, placed):
    ref = tiny_model(model_type, **fields)
    fused = copy.deepcopy(ref)
    torchfuser.optimize(fused, backend="reference")
    found = fused_layers(fused)
    assert len(found) == 2, str(torchfuser.report(fused))
    assert {(m.forward.spec.attention_dropout, m.forward.spec.mlp_dropout) for m in found} == {placed}
    assert step(ref) != step(tiny_model(model_type)), "the dropout is not on: the test would not see it"
    ref.zero_grad(set_to_none=True)
    assert_trains_like(ref, fused, step, list(ref.state_dict()))


@pytest.mark.parametrize("model_type", ["biogpt", "xglm"])
def test_an_inline_mlps_activation_dropout_is_placed(model_type):
    """OPT-style layers holding fc1 → activation → dropout(activation_dropout) → fc2 themselves: the inner dropout
    is applied by the fused forward between the activation and fc2 (``mlp_inner_dropout``)."""
    ref = tiny_model(model_type, dropout=0.2, activation_dropout=0.3)
    fused = copy.deepcopy(ref)
    torchfuser.optimize(fused, backend="reference")
    found = fused_layers(fused)
    assert len(found) == 2, str(torchfuser.report(fused))
    assert {(m.forward.spec.attention_dropout, m.forward.spec.mlp_dropout, m.forward.spec.mlp_inner_dropout)
            for m in found} == {("dropout", "dropout", "activation_dropout")}
    assert_trains_like(ref, fused, step, list(ref.state_dict()))


def test_under_gradient_checkpointing_the_recompute_draws_the_same_masks():
    ref = tiny_model("phi3", resid_pdrop=0.2)
    fused = copy.deepcopy(ref)
    torchfuser.optimize(fused, backend="reference")
    for m in (ref, fused):
        m.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    assert len(fused_layers(fused)) == 2
    assert_trains_like(ref, fused, step, list(ref.state_dict()))


class _LateDraws(Layer):
    """Parallel: both blocks run first, then both outputs are dropped. The sum is x + drop(a) + drop(m), as a
    layer dropping each block's output right after it, but the draws come in another order (the MLP's own
    draws before the attention output's mask): not placed, kept off-only."""

    def __init__(self):
        super().__init__()
        self.resid_pdrop = 0.0

    def forward(self, hidden_states, **kwargs):
        a, _ = self.self_attn(hidden_states=self.input_layernorm(hidden_states), **kwargs)
        m = self.mlp(self.post_attention_layernorm(hidden_states))
        p = self.resid_pdrop
        return hidden_states + nn.functional.dropout(a, p, self.training) + nn.functional.dropout(m, p, self.training)


class _EarlyDraws(_LateDraws):
    def forward(self, hidden_states, **kwargs):
        a, _ = self.self_attn(hidden_states=self.input_layernorm(hidden_states), **kwargs)
        a = nn.functional.dropout(a, self.resid_pdrop, self.training)
        m = self.mlp(self.post_attention_layernorm(hidden_states))
        return hidden_states + a + nn.functional.dropout(m, self.resid_pdrop, self.training)


def test_the_order_of_draws_decides_the_place():
    torch.manual_seed(0)
    early = ResidualNormPattern().match(_EarlyDraws())
    assert (early.attention_dropout, early.mlp_dropout, early.float_dropouts) == ("resid_pdrop", "resid_pdrop", ())
    late = ResidualNormPattern().match(_LateDraws())
    assert (late.attention_dropout, late.mlp_dropout, late.float_dropouts) == (None, None, ("resid_pdrop",))
    layer = _LateDraws()
    layer.resid_pdrop = 0.1
    skip = ResidualNormPattern().match(layer)
    assert "at a place the fused forward does not apply it" in skip.reason, skip


class _MlpFirst(Layer):
    """Parallel, the MLP called before the attention: the fused forward calls the attention first, so the blocks'
    own random draws (their dropouts) would come in another order: left alone with the reason."""

    def forward(self, hidden_states, **kwargs):
        m = self.mlp(self.post_attention_layernorm(hidden_states))
        a, _ = self.self_attn(hidden_states=self.input_layernorm(hidden_states), **kwargs)
        return hidden_states + a + m


def test_a_parallel_layer_calling_its_mlp_first_is_left_alone():
    torch.manual_seed(0)
    skip = ResidualNormPattern().match(_MlpFirst())
    assert "calls the MLP before the attention" in skip.reason, skip


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("model_type, fields, placed", _FORMS[:3], ids=[f[0] for f in _FORMS[:3]])
def test_on_cuda_with_the_defaults(model_type, fields, placed):
    ref = tiny_model(model_type, **fields).cuda()
    fused = copy.deepcopy(ref)
    torchfuser.optimize(fused)
    assert len(fused_layers(fused)) == 2, str(torchfuser.report(fused))
    assert_cuda_steps_like(ref, fused, step)
