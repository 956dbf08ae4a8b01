"""Pre-norm layers whose first norm or attention call differ from Llama's: a first norm that is an ``nn.Identity``
(ModernBERT-decoder's layer 0: ``ResidualNormSpec.norm_in_identity``), an attention passed its input three times
(CTRL's ``attn(normed, normed, normed)`` as v, k, q: ``attention_repeats``). One fp32 training step fused vs unfused
(loss and every gradient, dropouts on), what the probe accepts and rejects, and the call-time fallbacks."""
from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

import torchfuser
from torchfuser.modules import fallbacks
from torchfuser.modules.attention import FusedAttention
from torchfuser.patterns.base import Skip
from torchfuser.patterns.residual_norm import ResidualNormPattern

from numerics import assert_trains_like
from tiny_lm import fused_layers, lm_step as step, tiny_model
from test_residual_norm import H, Layer, RMSNorm


@pytest.mark.parametrize("model_type, fields", [
    ("modernbert-decoder", {}),
    ("modernbert-decoder", dict(mlp_dropout=0.2, attention_dropout=0.1)),
    ("ctrl", {}),
    ("ctrl", dict(resid_pdrop=0.2)),
], ids=["modernbert", "modernbert-dropout", "ctrl", "ctrl-dropout"])
def test_training_step_matches_unfused(model_type, fields):
    ref = tiny_model(model_type, **fields)
    fused = copy.deepcopy(ref)
    torchfuser.optimize(fused, backend="reference")
    found = fused_layers(fused)
    assert len(found) == 2, str(torchfuser.report(fused))  # both layers, layer 0 of ModernBERT too
    specs = [m.forward.spec for m in found]
    if model_type == "ctrl":
        assert {(s.attention_repeats, s.norm_in_identity) for s in specs} == {(3, False)}
        attention = [m for m in fused.modules() if isinstance(m, FusedAttention)]
        assert [m.spec.same_input for m in attention] == [("k", "q")] * 2  # forward(v, k, q): k and q are v
    else:
        assert [(s.attention_repeats, s.norm_in_identity) for s in specs] == [(1, True), (1, False)]
    if fields:
        assert step(ref) != step(tiny_model(model_type)), "the dropout is not on: the test would not see it"
        ref.zero_grad(set_to_none=True)
    assert_trains_like(ref, fused, step, list(ref.state_dict()))


def test_ctrls_attention_given_other_q_runs_the_original():
    ref = tiny_model("ctrl")
    fused = copy.deepcopy(ref)
    torchfuser.optimize(fused, backend="reference")
    a, b = ref.transformer.h[0].multi_head_attention, fused.transformer.h[0].multi_head_attention
    assert isinstance(b, FusedAttention)
    x, q = torch.randn(2, 2, 5, 64).unbind(0)
    mask = torch.zeros(2, 1, 5, 5)
    with torch.no_grad():
        torch.testing.assert_close(b(x, x, x, attention_mask=mask)[0], a(x, x, x, attention_mask=mask)[0])
        assert not fallbacks.counts(fused)
        torch.testing.assert_close(b(x, x, q, attention_mask=mask)[0], a(x, x, q, attention_mask=mask)[0])
    assert "not the hidden states themselves" in str(fallbacks.counts(fused))


class _NoFirstNorm(Layer):
    """A pre-norm layer whose first norm is an identity (ModernBERT-decoder's layer 0)."""

    def __init__(self, first: nn.Module | None = None):
        super().__init__()
        self.input_layernorm = first if first is not None else nn.Identity()


class _PostNoFirstNorm(_NoFirstNorm):
    def forward(self, hidden_states, **kwargs):  # h = id(x + attn(x)); out = norm(h + mlp(h)): not a pre-norm layer
        h = self.input_layernorm(hidden_states + self.self_attn(hidden_states=hidden_states, **kwargs)[0])
        return self.post_attention_layernorm(h + self.mlp(h))


def _fuse_one(layer):
    model = nn.ModuleDict(dict(layer=layer))
    torchfuser.optimize(model, backend="reference")
    return model.layer


def test_an_identity_first_norm_is_fused_exactly():
    torch.manual_seed(0)
    ref = _NoFirstNorm().double()
    spec = ResidualNormPattern().match(ref)
    assert spec.norm_in_identity and spec.norm_in == "input_layernorm" and not spec.parallel
    fused = _fuse_one(copy.deepcopy(ref))
    x = torch.randn(2, 5, H, dtype=torch.float64, requires_grad=True)
    x2 = x.detach().clone().requires_grad_()
    g = torch.randn(2, 5, H, dtype=torch.float64)
    (ref(x) * g).sum().backward()
    (fused(x2) * g).sum().backward()
    torch.testing.assert_close(x2.grad, x.grad)
    for (n, a), (_, b) in zip(ref.named_parameters(), fused.named_parameters()):
        torch.testing.assert_close(b.grad, a.grad, msg=n)
    assert not fallbacks.counts(fused)


def test_a_first_norm_that_is_not_an_identity_is_not_taken_for_one():
    # A parameter-free child that computes something (here tanh) is no missing norm: the probe's stand-in would
    # hide what it computes, so only an nn.Identity is tried in the first norm's place.
    assert ResidualNormPattern().match(_NoFirstNorm(nn.Tanh())) is None

    class _Shifted(nn.Identity):
        def forward(self, x):
            return x + 1

    assert ResidualNormPattern().match(_NoFirstNorm(_Shifted())) is None


def test_an_identity_first_norm_in_a_post_norm_layer_is_skipped():
    found = ResidualNormPattern().match(_PostNoFirstNorm())
    assert isinstance(found, Skip) and "first norm is an identity" in found.reason, found


def test_a_hook_on_the_identity_runs_the_original_forward():
    torch.manual_seed(0)
    fused = _fuse_one(_NoFirstNorm())
    seen = []
    fused.input_layernorm.register_forward_hook(lambda m, a, out: seen.append(out))
    fused(torch.randn(2, 3, H))
    assert len(seen) == 1
    assert "nn.Identity" in str(fallbacks.counts(fused))


class _ThreeInputs(nn.Module):
    """CTRL's MultiHeadAttention's calling convention: forward(v, k, q, layer_past=None, attention_mask=None)."""

    def __init__(self):
        super().__init__()
        self.wq, self.wk, self.wv = (nn.Linear(H, H) for _ in range(3))

    def forward(self, v, k, q, layer_past=None, attention_mask=None):
        s = (self.wq(q) @ self.wk(k).transpose(-1, -2)).softmax(-1)
        return s @ self.wv(v), None


class _VKQLayer(nn.Module):
    def __init__(self, same: bool = True):
        super().__init__()
        self.attn, self.same = _ThreeInputs(), same
        self.ffn = nn.Sequential(nn.Linear(H, 2 * H), nn.ReLU(), nn.Linear(2 * H, H))
        self.norm1, self.norm2 = RMSNorm(), RMSNorm()

    def forward(self, x, layer_past=None, attention_mask=None):
        n = self.norm1(x)
        a, _ = self.attn(n, n, n if self.same else x, layer_past=layer_past, attention_mask=attention_mask)
        h = x + a
        return h + self.ffn(self.norm2(h))


def test_an_attention_passed_its_input_three_times():
    torch.manual_seed(0)
    ref = _VKQLayer().double()
    spec = ResidualNormPattern().match(ref)
    assert spec.attention_repeats == 3 and spec.attention_input == ""
    assert {(n, k) for n, k, _ in spec.arguments} == {("layer_past", "layer_past"), ("attention_mask", "attention_mask")}
    fused = _fuse_one(copy.deepcopy(ref))
    x = torch.randn(2, 5, H, dtype=torch.float64)
    torch.testing.assert_close(fused(x), ref(x))
    assert not fallbacks.counts(fused)


def test_an_attention_passed_other_tensors_besides_its_input_is_skipped():
    found = ResidualNormPattern().match(_VKQLayer(same=False))
    assert isinstance(found, Skip) and "positional arguments besides its input" in found.reason
