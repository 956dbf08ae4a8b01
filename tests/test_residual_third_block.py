"""A third block after a decoder layer's attention and MLP (``patterns._residual_tail``): Gemma 4's per-layer inputs
(E2B, E4B), ``out = o + norm(fc_out(act(fc_in(o)) * per_layer_input))`` after the sandwich, then ``out *= layer_scalar``.
The sandwich's adds fused, the third block run as the original runs it. One fp32 training step fused vs unfused (loss
and every gradient, the per-layer embedding's included), under gradient checkpointing, bf16, decoding."""
from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

import torchfuser
from torchfuser.modules import fallbacks
from torchfuser.patterns.base import Skip
from torchfuser.patterns.residual_norm import ResidualNormPattern

from numerics import assert_bf16_within_rule
from tiny_lm import assert_generates_like, fused_layers, lm_step as step, tiny_model
from test_residual_norm import H, Layer, RMSNorm
from test_residual_output_scale import _set_scales, _trains_like

_TAIL = ("per_layer_input_gate", "act_fn", "per_layer_projection", "post_per_layer_input_norm")


@pytest.mark.parametrize("model_type", ["gemma4_text", "gemma4"])
def test_training_step_matches_unfused(model_type):
    ref = tiny_model(model_type)
    _set_scales(ref)
    fused = copy.deepcopy(ref)
    torchfuser.optimize(fused, backend="reference")
    found = fused_layers(fused)
    assert len(found) == 2, str(torchfuser.report(fused))
    assert {(m.forward.spec.tail, m.forward.spec.tail_input, m.forward.spec.post_mlp_norm) for m in found} == {
        (_TAIL, "per_layer_input", "post_feedforward_layernorm")}
    _trains_like(ref, fused)


@pytest.mark.parametrize("reentrant", [False, True])
def test_under_gradient_checkpointing(reentrant):
    """The per-layer input goes through transformers' checkpoint as a positional tensor (reentrant checkpointing
    passes gradients to those only): its gradient (the per-layer embedding's) is the unfused model's."""
    ref = tiny_model("gemma4_text")
    ref.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": reentrant})
    fused = copy.deepcopy(ref)
    torchfuser.optimize(fused, backend="reference")
    assert len(fused_layers(fused)) == 2, str(torchfuser.report(fused))
    _trains_like(ref, fused)


def test_bf16_within_the_rule():
    ref64 = tiny_model("gemma4_text").double()
    _set_scales(ref64, (0.3, 1.3))
    plain = copy.deepcopy(ref64).to(torch.bfloat16)
    fused = copy.deepcopy(plain)
    torchfuser.optimize(fused, backend="reference")
    assert len(fused_layers(fused)) == 2, str(torchfuser.report(fused))
    assert_bf16_within_rule(fused, plain, ref64, step)


def test_generate_equals_unfused():
    ref = tiny_model("gemma4_text").eval()
    fused = copy.deepcopy(ref)
    torchfuser.optimize(fused, backend="reference")
    assert_generates_like(ref, fused)
    layers = {n for n, m in fused.named_modules() if m in fused_layers(fused)}
    assert len(layers) == 2 and not layers & set(fallbacks.counts(fused)), fallbacks.counts(fused)


class _Tail(Layer):
    """A pre-norm layer with a third block on its output, gated by an argument."""

    def __init__(self, drop: float | None = None):
        super().__init__()
        self.gate, self.proj, self.act, self.tail_norm = nn.Linear(H, 8, bias=False), nn.Linear(8, H), nn.GELU(), RMSNorm()
        self.drop = nn.Identity() if drop is None else nn.Dropout(drop)

    def forward(self, hidden_states, gate_input=None, attention_mask=None, **kwargs):
        a, _ = self.self_attn(hidden_states=self.input_layernorm(hidden_states), attention_mask=attention_mask, **kwargs)
        h = hidden_states + self.drop(a)
        h = h + self.mlp(self.post_attention_layernorm(h))
        return h + self.tail_norm(self.proj(self.act(self.gate(h)) * gate_input))


def test_a_third_block_is_fused_exactly():
    torch.manual_seed(0)
    ref = _Tail().double()
    spec = ResidualNormPattern().match(ref)
    assert (spec.tail, spec.tail_input) == (("gate", "act", "proj", "tail_norm"), "gate_input")
    model = nn.ModuleDict(dict(layer=copy.deepcopy(ref)))
    torchfuser.optimize(model, backend="reference")
    x = torch.randn(2, 5, H, dtype=torch.float64, requires_grad=True)
    g = torch.randn(2, 5, 8, dtype=torch.float64, requires_grad=True)
    x2, g2 = (t.detach().clone().requires_grad_() for t in (x, g))
    dy = torch.randn(2, 5, H, dtype=torch.float64)
    (ref(x, g) * dy).sum().backward()
    (model.layer(x2, g2) * dy).sum().backward()
    torch.testing.assert_close(x2.grad, x.grad)
    torch.testing.assert_close(g2.grad, g.grad)
    for (n, a), (_, b) in zip(ref.named_parameters(), model.layer.named_parameters()):
        torch.testing.assert_close(b.grad, a.grad, msg=n)
    assert not fallbacks.counts(model)
    with pytest.raises(TypeError):  # without its argument: the original forward, which raises as it would
        model.layer(x2)
    assert fallbacks.counts(model)


def test_a_third_block_with_a_dropout_is_left_alone_with_the_reason():
    found = ResidualNormPattern().match(_Tail(drop=0.1).train())
    assert isinstance(found, Skip) and "third block" in found.reason, found
