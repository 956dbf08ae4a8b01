"""A decoder layer's own buffers (``patterns._residual_output_scale``): Gemma 4's ``hidden_states *= layer_scalar``
(a one-element buffer a checkpoint fills) is followed by the fused forward at each call, and a layer reading a buffer
of its own otherwise is left alone. One fp32 training step fused vs unfused (loss and every gradient)."""
from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

import torchfuser
from torchfuser.patterns.base import Skip
from torchfuser.patterns.residual_norm import ResidualNormPattern

from torchfuser.modules import fallbacks

from numerics import assert_bf16_within_rule
from tiny_lm import fused_layers, lm_step as step, tiny_model
from test_residual_norm import H, Layer

# gemma4_text without per-layer inputs: Gemma 4's larger models' layers (a sandwich times layer_scalar)
_TYPES = [("gemma4_unified_text", {}), ("gemma4_text", {"hidden_size_per_layer_input": 0})]


def _trains_like(ref, fused):
    """One fp32 training step: the loss and every gradient equal; no fused layer fell back (Gemma 4's attention
    runs its own forward in training without a ``shared_kv_states`` dict: that is the attention pattern's, counted
    on the attention); ``restore`` keeps the keys."""
    keys = list(ref.state_dict())
    assert list(fused.state_dict()) == keys
    torch.testing.assert_close(step(fused), step(ref), rtol=1e-6, atol=1e-6)
    for (n, a), (_, b) in zip(ref.named_parameters(), fused.named_parameters()):
        assert (a.grad is None) == (b.grad is None), n
        if a.grad is not None:
            torch.testing.assert_close(b.grad, a.grad, rtol=1e-5, atol=1e-6, msg=n)
    layers = {n for n, m in fused.named_modules() if m in fused_layers(fused)}
    assert layers and not layers & set(fallbacks.counts(fused)), fallbacks.counts(fused)
    torchfuser.restore(fused)
    assert list(fused.state_dict()) == keys


def _set_scales(model, values=(0.5, 1.75)):
    layers = [m for m in model.modules() if "layer_scalar" in m._buffers]
    assert layers
    for m, v in zip(layers, values * len(layers)):
        m.layer_scalar.fill_(v)


@pytest.mark.parametrize("model_type, fields", _TYPES, ids=[t[0] for t in _TYPES])
@pytest.mark.parametrize("when", ["before", "after"])
def test_the_layer_scalar_is_followed(model_type, fields, when):
    """The scale set before ``optimize`` (a checkpoint loaded) and after it (a checkpoint loaded into the fused
    model: the fused forward reads the buffer at each call)."""
    ref = tiny_model(model_type, **fields)
    if when == "before":
        _set_scales(ref)
    fused = copy.deepcopy(ref)
    torchfuser.optimize(fused, backend="reference")
    found = fused_layers(fused)
    assert len(found) == 2, str(torchfuser.report(fused))
    assert {m.forward.spec.output_scale for m in found} == {"layer_scalar"}
    if when == "after":
        _set_scales(ref)
        _set_scales(fused)
    _trains_like(ref, fused)


def test_bf16_within_the_rule():
    ref64 = tiny_model("gemma4_unified_text").double()
    _set_scales(ref64, (0.3, 1.3))
    plain = copy.deepcopy(ref64).to(torch.bfloat16)
    fused = copy.deepcopy(plain)
    torchfuser.optimize(fused, backend="reference")
    assert len(fused_layers(fused)) == 2, str(torchfuser.report(fused))
    assert_bf16_within_rule(fused, plain, ref64, step)


class _Scaled(Layer):
    def __init__(self, shape=(1,)):
        super().__init__()
        self.layer_scalar = nn.Buffer(torch.full(shape, 0.75))


class _OutputScale(_Scaled):
    def forward(self, hidden_states, attention_mask=None, position_embeddings=None, **kwargs):
        out = Layer.forward(self, hidden_states, attention_mask, position_embeddings, **kwargs)
        out *= self.layer_scalar
        return out


class _AddsItsBuffer(_Scaled):  # a buffer added, not a factor
    def forward(self, hidden_states, attention_mask=None, position_embeddings=None, **kwargs):
        return Layer.forward(self, hidden_states, attention_mask, position_embeddings, **kwargs) + self.layer_scalar


class _ScalesTheAttention(_Scaled):  # a factor, but of one block's output: not the output scale
    def forward(self, hidden_states, **kwargs):
        h, _ = self.self_attn(hidden_states=self.input_layernorm(hidden_states), **kwargs)
        h = hidden_states + h * self.layer_scalar
        return h + self.mlp(self.post_attention_layernorm(h))


class _VectorScale(_Scaled):  # a per-channel factor: not one element
    def __init__(self):
        super().__init__((H,))

    forward = _OutputScale.forward


class _UnreadBuffer(_Scaled):
    forward = Layer.forward


def test_a_layer_with_an_output_scale_is_fused_exactly():
    torch.manual_seed(0)
    ref = _OutputScale().double()
    assert ResidualNormPattern().match(ref).output_scale == "layer_scalar"
    model = nn.ModuleDict(dict(layer=copy.deepcopy(ref)))
    torchfuser.optimize(model, backend="reference")
    for m in (ref, model.layer):
        m.layer_scalar.fill_(-1.5)  # after optimize
    x = torch.randn(2, 5, H, dtype=torch.float64, requires_grad=True)
    x2 = x.detach().clone().requires_grad_()
    g = torch.randn(2, 5, H, dtype=torch.float64)
    (ref(x) * g).sum().backward()
    (model.layer(x2) * g).sum().backward()
    torch.testing.assert_close(x2.grad, x.grad)
    for (n, a), (_, b) in zip(ref.named_parameters(), model.layer.named_parameters()):
        torch.testing.assert_close(b.grad, a.grad, msg=n)


@pytest.mark.parametrize("cls, why", [(_AddsItsBuffer, "not the pre-norm"), (_ScalesTheAttention, "own buffer"),
                                      (_VectorScale, "")])
def test_a_buffer_read_otherwise_leaves_the_layer_alone(cls, why):
    """(an added buffer and a per-channel one break the formula at the probe's values; a factor of one block's
    output shows only when the buffer changes)"""
    found = ResidualNormPattern().match(cls())
    assert isinstance(found, Skip) and why in found.reason, found


def test_a_buffer_not_read_is_no_scale():
    assert ResidualNormPattern().match(_UnreadBuffer()).output_scale is None


def test_the_probe_does_not_touch_the_buffer():
    layer = _OutputScale()
    ResidualNormPattern().match(layer)
    assert layer.layer_scalar.tolist() == [0.75]
