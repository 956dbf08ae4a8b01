"""Blocks that return more than the residual-norm pattern's stand-ins assumed: an MLP returning a tuple whose first
item the layer adds (GPT-OSS: ``hidden_states, _ = self.mlp(…)``, the MoE block's router scores after its output:
``ResidualNormSpec.mlp_tuple``), an attention returning three items (JetMoE's ``hidden_states, _, _ =
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


@pytest.mark.parametrize("model_type, mlp_tuple", [("gpt_oss", True), ("jetmoe", False)])
def test_training_step_matches_unfused(model_type, mlp_tuple):
    torch.manual_seed(0)
    ref = AutoModelForCausalLM.from_config(tiny_config(model_type)).float().train()
    fused = copy.deepcopy(ref)
    torchfuser.optimize(fused, backend="reference")
    found = [m for m in fused.modules() if isinstance(m.__dict__.get("forward"), ResidualNormForward)]
    assert len(found) == 2, str(torchfuser.report(fused))
    assert all(m.forward.spec.mlp_tuple == mlp_tuple for m in found)
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
