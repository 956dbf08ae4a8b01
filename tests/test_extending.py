"""A user's own pattern: register_pattern / unregister_pattern, the Pattern interface, its checks."""
from __future__ import annotations

import copy
from dataclasses import dataclass

import pytest
import torch
from torch import nn

import torchfuser
from torchfuser import functional as F
from torchfuser.patterns import PATTERNS, FusedModule, Pattern, Skip, adopt


class ScaledSiLU(nn.Module):
    def __init__(self, alpha: float):
        super().__init__()
        self.alpha = alpha

    def forward(self, x):
        return self.alpha * nn.functional.silu(x)


class ScaledMLP(nn.Module):
    def __init__(self, hidden=16, inter=24, alpha=0.5, bias=False):
        super().__init__()
        self.gate_proj, self.up_proj = nn.Linear(hidden, inter, bias=False), nn.Linear(hidden, inter, bias=False)
        self.down_proj = nn.Linear(inter, hidden, bias=bias)
        self.act = ScaledSiLU(alpha)

    def forward(self, x):
        return self.down_proj(self.act(self.gate_proj(x)) * self.up_proj(x))


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.blocks = nn.ModuleList([ScaledMLP(), ScaledMLP(alpha=2.0), ScaledMLP(bias=True)])

    def forward(self, x):
        for b in self.blocks:
            x = x + b(x)
        return x


@dataclass(frozen=True)
class ScaledSpec:
    alpha: float


class FusedScaledMLP(FusedModule):
    def __init__(self, original, spec, backend="auto"):
        super().__init__(spec, backend)
        adopt(self, original, ["gate_proj", "up_proj", "down_proj"])

    def forward(self, x):
        return self.down_proj(F.swiglu(self.gate_proj(x), self.up_proj(x), backend=self.backend)) * self.spec.alpha


class ScaledMLPPattern(Pattern):
    name = "scaled_mlp"
    fused = FusedScaledMLP

    def match(self, module):
        if not isinstance(getattr(module, "act", None), ScaledSiLU):
            return None
        if module.down_proj.bias is not None:
            return Skip("down_proj has a bias")
        return ScaledSpec(module.act.alpha)


@pytest.fixture
def registry():
    """The registry as it was after each test, whatever the test registered."""
    saved = dict(PATTERNS)
    yield PATTERNS
    PATTERNS.clear()
    PATTERNS.update(saved)


def _loss_and_grads(model, x):
    model.zero_grad(set_to_none=True)
    loss = model(x).square().mean()
    loss.backward()
    return loss.detach(), {n: p.grad for n, p in model.named_parameters()}


def test_a_registered_pattern_fuses_reports_and_restores(registry):
    torch.manual_seed(0)
    model, x = Net(), torch.randn(3, 5, 16)
    ref = copy.deepcopy(model)
    originals = list(model.blocks)
    assert torchfuser.register_pattern(p := ScaledMLPPattern()) is p and list(PATTERNS)[-1] == "scaled_mlp"
    torchfuser.optimize(model, backend="reference")
    assert [type(b) for b in model.blocks] == [FusedScaledMLP, FusedScaledMLP, ScaledMLP]
    rep = torchfuser.report(model)
    assert rep.counts()["scaled_mlp"] == {"fused": 2, "skipped": 1}
    assert next(e for e in rep.entries if e.name == "blocks.2").reason == "down_proj has a bias"
    assert model.blocks[1].act.alpha == 2.0  # attribute reads reach the original
    assert list(model.state_dict()) == list(ref.state_dict())
    (loss, grads), (loss_ref, grads_ref) = _loss_and_grads(model, x), _loss_and_grads(ref, x)
    torch.testing.assert_close(loss, loss_ref)
    assert grads.keys() == grads_ref.keys()
    for n in grads:
        torch.testing.assert_close(grads[n], grads_ref[n], msg=n)
    torchfuser.restore(model)
    assert all(a is b for a, b in zip(model.blocks, originals))
    assert torchfuser.unregister_pattern("scaled_mlp") is p and "scaled_mlp" not in PATTERNS
    torchfuser.optimize(model, backend="reference")
    assert not any(isinstance(b, FusedModule) for b in model.blocks)


def test_patterns_and_exclude_name_a_registered_pattern(registry):
    torchfuser.register_pattern(ScaledMLPPattern())
    model = torchfuser.optimize(Net(), backend="reference", exclude=["scaled_mlp"])
    assert not any(isinstance(b, FusedModule) for b in model.blocks)
    model = torchfuser.optimize(Net(), backend="reference", patterns=["scaled_mlp"])
    assert isinstance(model.blocks[0], FusedScaledMLP)


class _ClaimsEveryMLP(Pattern):
    """Claims what the built-in gated_mlp would fuse: it sees those blocks only when placed before it."""

    name = "mine"

    def match(self, module):
        return Skip("mine, not fused") if type(module).__name__ == "LlamaMLP" else None

    def build(self, module, spec, backend):  # never called: match only skips
        raise AssertionError


def test_before_puts_a_pattern_ahead_of_a_built_in_one(registry):
    from transformers import LlamaConfig, LlamaForCausalLM

    cfg = LlamaConfig(hidden_size=32, intermediate_size=48, num_hidden_layers=1, num_attention_heads=4,
                      num_key_value_heads=2, vocab_size=64)
    torchfuser.register_pattern(_ClaimsEveryMLP())
    rep = torchfuser.report(torchfuser.optimize(LlamaForCausalLM(cfg), backend="reference"))
    assert rep.counts()["gated_mlp"]["fused"] == 1 and "mine" not in rep.counts()
    torchfuser.unregister_pattern("mine")
    torchfuser.register_pattern(_ClaimsEveryMLP(), before="gated_mlp")
    names = list(PATTERNS)
    assert names.index("mine") == names.index("gated_mlp") - 1
    rep = torchfuser.report(torchfuser.optimize(LlamaForCausalLM(cfg), backend="reference"))
    assert "gated_mlp" not in rep.counts() and rep.counts()["mine"] == {"fused": 0, "skipped": 1}


class _NoMatch(Pattern):
    name = "no_match"
    fused = FusedScaledMLP


class _NoBuild(Pattern):
    name = "no_build"

    def match(self, module):
        return None


class _Unnamed(ScaledMLPPattern):
    name = ""


@pytest.mark.parametrize("pattern, kwargs, error, words", [
    (ScaledMLPPattern, {}, TypeError, "got the class ScaledMLPPattern"),
    (object(), {}, TypeError, "takes a torchfuser.Pattern"),
    (_Unnamed(), {}, ValueError, "non-empty string"),
    (_NoMatch(), {}, TypeError, "does not define match"),
    (_NoBuild(), {}, TypeError, "sets no fused class"),
    (ScaledMLPPattern(), {"before": "rmsnorm"}, ValueError, "is no registered pattern"),
])
def test_register_refuses_what_cannot_work(registry, pattern, kwargs, error, words):
    before = list(PATTERNS)
    with pytest.raises(error, match=words):
        torchfuser.register_pattern(pattern, **kwargs)
    assert list(PATTERNS) == before


def test_a_name_is_registered_once_and_unregistered_once(registry):
    torchfuser.register_pattern(ScaledMLPPattern())
    with pytest.raises(ValueError, match="registered already"):
        torchfuser.register_pattern(ScaledMLPPattern())
    torchfuser.unregister_pattern("scaled_mlp")
    with pytest.raises(KeyError, match="no pattern named 'scaled_mlp'"):
        torchfuser.unregister_pattern("scaled_mlp")


class _Copying(FusedScaledMLP):
    """A fused module that copies a weight (the second block's only: the first swap must be undone)."""

    def __init__(self, original, spec, backend="auto"):
        super().__init__(original, spec, backend)
        if spec.alpha == 2.0:
            self.up_proj = copy.deepcopy(original.up_proj)


class _CopyingPattern(ScaledMLPPattern):
    fused = _Copying


def test_a_fused_module_with_parameters_of_its_own_is_refused_and_nothing_changes(registry):
    torchfuser.register_pattern(_CopyingPattern())
    model = Net()
    before = list(model.blocks)
    with pytest.raises(ValueError, match=r"parameters the ScaledMLP does not hold \(up_proj.weight\)"):
        torchfuser.optimize(model, backend="reference")
    assert all(a is b for a, b in zip(model.blocks, before))
    assert "not called" in str(torchfuser.report(model))
