"""A dropout on the MLP's activation output, before its last projection (ModernBERT-decoder's gated MLP:
``Wo(drop(act(input) · gate))``; ProphetNet's: ``dropout(output(dropout(act(intermediate(x)), activation_dropout)))``):
``GatedMLPSpec.inner_dropout`` / ``MLPSpec.inner_dropout``. The fused MLP calls the same functional dropout
on the same tensor at the same point, so from one seed its masks are the original's draws: one training
step with p > 0, loss and every gradient against the unfused model; where it would differ, the MLP is
left alone with the reason."""
from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

import torchfuser
from torchfuser.modules.mlp import FusedGatedMLP, FusedMLP
from torchfuser.patterns.base import Skip
from torchfuser.patterns.mlp import MLPPattern

from numerics import assert_cuda_steps_like, assert_trains_like
from tiny_lm import lm_step as step, tiny_model


@pytest.mark.parametrize("model_type, dropouts, cls, where", [
    ("modernbert-decoder", dict(mlp_dropout=0.25), FusedGatedMLP, dict(inner_dropout="drop", dropout=None)),
    ("prophetnet", dict(activation_dropout=0.2, dropout=0.1), FusedMLP,
     dict(inner_dropout="activation_dropout", dropout="dropout")),
])
def test_training_step_with_dropout_matches_unfused(model_type, dropouts, cls, where):
    ref = tiny_model(model_type, **dropouts)
    fused = copy.deepcopy(ref)
    keys = list(ref.state_dict())
    torchfuser.optimize(fused, backend="reference")
    mlps = [m for m in fused.modules() if isinstance(m, cls)]
    assert len(mlps) == 2, str(torchfuser.report(fused))
    assert {k: getattr(mlps[0].spec, k) for k in where} == where
    assert step(ref) != step(tiny_model(model_type)), "the dropout is not on: the test would not see it"
    ref.zero_grad(set_to_none=True)
    assert_trains_like(ref, fused, step, keys, loss_rtol=1e-6)


class _InnerDrop(nn.Module):
    """fc_out(drop(gelu(fc_in(x)))) without biases: in eval the dropout's place does not show (3·W(h) =
    W(3·h)); the training probe tells which."""

    def __init__(self, where: str = "inner", bias: bool = False):
        super().__init__()
        self.fc_in, self.act = nn.Linear(16, 24, bias=bias), nn.GELU()
        self.fc_out, self.where = nn.Linear(24, 16, bias=bias), where
        if where == "input_float":
            self.input_dropout = 0.3  # read by a functional dropout: the eval probe does not see it
        else:
            self.drop = nn.Dropout(0.3)

    def forward(self, x):
        if self.where == "input":  # a dropout no fused MLP has: before the first projection
            x = self.drop(x)
        if self.where == "input_float":
            x = nn.functional.dropout(x, self.input_dropout, self.training)
        h = self.act(self.fc_in(x))
        if self.where == "inner":
            h = self.drop(h)
        out = self.fc_out(h)
        return self.drop(out) if self.where == "outer" else out


@pytest.mark.parametrize("where, bias", [("inner", False), ("inner", True), ("outer", False)])
def test_module_forward_and_every_gradient_with_the_same_masks(where, bias):
    torch.manual_seed(0)
    original = _InnerDrop(where, bias).train()
    spec = MLPPattern().match(original)
    assert not isinstance(spec, Skip) and spec is not None, spec
    assert (spec.inner_dropout, spec.dropout) == (("drop", None) if where == "inner" else (None, "drop"))
    fused = FusedMLP(copy.deepcopy(original), spec, "reference").train()
    x = torch.randn(3, 5, 16, requires_grad=True)
    outs, grads = [], []
    for m in (original, fused):
        torch.manual_seed(7)
        xi = x.detach().clone().requires_grad_()
        out = m(xi)
        out.square().sum().backward()
        outs.append(out.detach())
        grads.append([xi.grad] + [p.grad for p in m.parameters()])
    assert torch.equal(outs[0], outs[1])
    for a, b in zip(*grads):
        torch.testing.assert_close(b, a, rtol=1e-6, atol=1e-7)


@pytest.mark.parametrize("where, reason", [("input", "does not compute"), ("input_float", "in training its output differs")])
def test_a_dropout_before_the_first_projection_is_left_alone_with_the_reason(where, reason):
    found = MLPPattern().match(_InnerDrop(where).train())
    assert isinstance(found, Skip) and reason in found.reason, found


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_on_cuda_with_the_defaults():
    """The gated kernel's output dropped before Wo on the GPU: from one seed the masks are the original's."""
    ref = tiny_model("modernbert-decoder", mlp_dropout=0.25).cuda()
    fused = copy.deepcopy(ref)
    torchfuser.optimize(fused)
    assert sum(isinstance(m, FusedGatedMLP) for m in fused.modules()) == 2, str(torchfuser.report(fused))
    assert_cuda_steps_like(ref, fused, step)
