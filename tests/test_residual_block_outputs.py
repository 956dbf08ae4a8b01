"""Blocks that return more than the residual-norm pattern's stand-ins assumed: an MLP returning a tuple whose first
item the layer adds (GPT-OSS: ``hidden_states, _ = self.mlp(…)``, the MoE block's router scores after its output:
``ResidualNormSpec.mlp_tuple``; Llama 4's, whose (tokens, hidden) rows the layer views back: ``mlp_view``), an attention returning three items (JetMoE's ``hidden_states, _, _ =
self.self_attention(…)``). One training step fused vs unfused (loss and every gradient); a plain MLP is not
taken for a tuple one."""
from __future__ import annotations

import copy

import pytest
import torch
from torch import nn
from transformers import AutoModelForCausalLM

import torchfuser
from torchfuser.modules.residual_norm import ResidualNormForward
from torchfuser.patterns.base import Skip
from torchfuser.patterns.residual_norm import ResidualNormPattern

from arch_sweep import tiny_config
from numerics import assert_trains_like
from tiny_lm import lm_step as step
from test_residual_norm import H, Layer


@pytest.mark.parametrize("model_type, mlp_tuple", [("gpt_oss", True), ("jetmoe", False), ("llama4_text", True)])
def test_training_step_matches_unfused(model_type, mlp_tuple):
    torch.manual_seed(0)
    ref = AutoModelForCausalLM.from_config(tiny_config(model_type)).float().train()
    fused = copy.deepcopy(ref)
    torchfuser.optimize(fused, backend="reference")
    found = [m for m in fused.modules() if isinstance(m.__dict__.get("forward"), ResidualNormForward)]
    assert len(found) == 2, str(torchfuser.report(fused))
    assert all(m.forward.spec.mlp_tuple == mlp_tuple for m in found)
    # Llama 4's MoE block returns (tokens, hidden) rows, which its layer views back: ``mlp_view``
    assert all(m.forward.spec.mlp_view == (model_type == "llama4_text") for m in found)
    assert_trains_like(ref, fused, step, list(ref.state_dict()))


class _TupleMLP(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(H, H)

    def forward(self, x):
        return self.fc(x), None


class _TakesFirst(Layer):
    def __init__(self):
        super().__init__()
        self.mlp = _TupleMLP()

    def forward(self, hidden_states, **kwargs):
        h, _ = self.self_attn(hidden_states=self.input_layernorm(hidden_states), **kwargs)
        h = hidden_states + h
        m, _ = self.mlp(self.post_attention_layernorm(h))
        return h + m


def test_the_probe_tells_a_tuple_mlp_from_a_plain_one():
    torch.manual_seed(0)
    assert ResidualNormPattern().match(_TakesFirst()).mlp_tuple
    assert not ResidualNormPattern().match(Layer()).mlp_tuple


class _RoutedMLP(_TupleMLP):
    """An MLP the layer calls differently by its type (Ernie 4.5 VL's MoE block: token types in, a tuple out)."""

    def forward(self, x, token_types):
        return self.fc(x) * (1 + token_types.unsqueeze(-1)), None


class _Branches(Layer):
    def __init__(self, routed: bool):
        super().__init__()
        self.mlp = _RoutedMLP() if routed else nn.Linear(H, H)

    def forward(self, hidden_states, token_types=None, **kwargs):
        h, _ = self.self_attn(hidden_states=self.input_layernorm(hidden_states), **kwargs)
        h = hidden_states + h
        n = self.post_attention_layernorm(h)
        if isinstance(self.mlp, _RoutedMLP):
            m, _ = self.mlp(n, token_types)
        else:
            m = self.mlp(n)
        return h + m


def test_the_probe_takes_the_branch_the_real_child_takes():
    """The stand-ins are instances of the children's classes: a layer branching on its MLP's type is probed on the
    branch its real MLP takes (here: passed more than its input, so left alone), not on the plain one."""
    torch.manual_seed(0)
    assert ResidualNormPattern().match(_Branches(routed=False)) is not None
    found = ResidualNormPattern().match(_Branches(routed=True))
    assert isinstance(found, Skip) and "passes its MLP or norms more than their input" in found.reason


class _FlatMoE(_TupleMLP):
    def forward(self, x):
        return self.fc(x).reshape(-1, H), None


class _ViewsBack(Layer):
    """Llama 4's MoE layer: ``hidden_states, _ = self.feed_forward(…)``, then ``residual + hidden_states.view(…)``."""

    def __init__(self, views: bool = True):
        super().__init__()
        self.mlp, self.views = _FlatMoE(), views

    def forward(self, hidden_states, **kwargs):
        h, _ = self.self_attn(hidden_states=self.input_layernorm(hidden_states), **kwargs)
        h = hidden_states + h
        m, _ = self.mlp(self.post_attention_layernorm(h))
        return h + (m.view(h.shape) if self.views else m)


def test_a_flattened_tuple_mlp_output_viewed_back():
    torch.manual_seed(0)
    ref = _ViewsBack().double()
    spec = ResidualNormPattern().match(ref)
    assert spec.mlp_tuple and spec.mlp_view
    fused = copy.deepcopy(ref)
    torchfuser.optimize(nn.ModuleDict(dict(layer=fused)), backend="reference")
    x = torch.randn(2, 3, H, dtype=torch.float64)
    torch.testing.assert_close(fused(x), ref(x))
    # without the view the layer cannot add (tokens, hidden) rows to (batch, seq, hidden): not taken for a tuple MLP
    assert not getattr(ResidualNormPattern().match(_ViewsBack(views=False)), "mlp_view", False)
