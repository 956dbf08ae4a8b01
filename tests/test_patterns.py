"""Patterns recognise blocks by their math, fuse unknown classes built from standard parts,
and skip, with a reason, what they cannot reproduce exactly."""
from __future__ import annotations

import pytest
import torch
from torch import nn

import torchfuser
from torchfuser.modules import FusedGatedMLP, FusedLayerNorm, FusedMLP, FusedRMSNorm


class ScaleNorm(nn.Module):
    """A user's own RMSNorm: no class-name hint, eps under an unusual name."""

    def __init__(self, d, epsilon=1e-5, plus_one=False):
        super().__init__()
        self.weight = nn.Parameter(torch.randn(d))
        self.epsilon = epsilon
        self.plus_one = plus_one

    def forward(self, x):
        w = self.weight + 1 if self.plus_one else self.weight
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.epsilon) * w


class WrongEpsNorm(ScaleNorm):
    def forward(self, x):  # uses a different eps than the attribute says
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-2) * self.weight


class MyMLP(nn.Module):
    def __init__(self, d=16, inner=40, act=nn.SiLU(), swap=False, extra=False):
        super().__init__()
        self.w_in_a, self.w_in_b, self.w_out = nn.Linear(d, inner), nn.Linear(d, inner), nn.Linear(inner, d)
        self.act, self.swap = act, swap
        if extra:
            self.scale = nn.Identity()

    def forward(self, x):
        a, b = self.w_in_a(x), self.w_in_b(x)
        if self.swap:
            a, b = b, a
        return self.w_out(self.act(a) * b)


class FusedGateUp(nn.Module):
    def __init__(self, d=16, inner=24):
        super().__init__()
        self.gate_up_proj, self.down_proj, self.act = nn.Linear(d, 2 * inner, bias=False), nn.Linear(inner, d, bias=False), nn.SiLU()

    def forward(self, x):
        up, gate = self.gate_up_proj(x).chunk(2, dim=-1)  # up first: the probe must find that out
        return self.down_proj(self.act(gate) * up)


class PlainMLP(nn.Module):
    def __init__(self, d=16, act=nn.GELU(approximate="tanh"), dropout_first=False):
        super().__init__()
        self.fc1, self.fc2, self.act, self.drop = nn.Linear(d, 64), nn.Linear(64, d), act, nn.Dropout(0.1)
        self.dropout_first = dropout_first

    def forward(self, x):
        h = self.act(self.fc1(x))
        if self.dropout_first:
            return self.fc2(self.drop(h))
        return self.drop(self.fc2(h))


class Block(nn.Module):
    def __init__(self, *children):
        super().__init__()
        self.parts = nn.ModuleList(children)

    def forward(self, x):
        for p in self.parts:
            x = p(x)
        return x


def _parity(block, x):
    want = block(x)
    want_grads = torch.autograd.grad(want.sum(), list(block.parameters()))
    torchfuser.optimize(block, backend="reference")
    got = block(x)
    got_grads = torch.autograd.grad(got.sum(), list(block.parameters()))
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    for g, w in zip(got_grads, want_grads):
        torch.testing.assert_close(g, w, rtol=1e-4, atol=1e-5)
    return torchfuser.report(block)


@pytest.mark.parametrize("plus_one", [False, True])
def test_unhinted_rms_norm_with_offset(plus_one):
    block = Block(ScaleNorm(16, plus_one=plus_one), nn.Linear(16, 16))
    rep = _parity(block, torch.randn(3, 16))
    assert isinstance(block.parts[0], FusedRMSNorm)
    assert block.parts[0].spec.offset == (1.0 if plus_one else 0.0)
    assert block.parts[0].spec.eps == 1e-5
    assert rep.counts()["rms_norm"]["fused"] == 1


def test_norm_whose_math_disagrees_is_skipped_with_reason():
    block = Block(WrongEpsNorm(16))
    torchfuser.optimize(block, backend="reference")
    assert isinstance(block.parts[0], WrongEpsNorm)
    (entry,) = torchfuser.report(block).skipped
    assert "does not compute" in entry.reason


@pytest.mark.parametrize("bias", [True, False])
def test_layer_norm_variants(bias):
    block = Block(nn.LayerNorm(16, bias=bias), nn.Linear(16, 4))
    _parity(block, torch.randn(5, 16) + 2)
    assert isinstance(block.parts[0], FusedLayerNorm)
    assert block.parts[0].spec.bias == ("bias" if bias else None)


def test_layer_norm_over_two_dims_is_skipped():
    block = Block(nn.LayerNorm((4, 16)))
    torchfuser.optimize(block, backend="reference")
    assert "2 dims" in torchfuser.report(block).skipped[0].reason


@pytest.mark.parametrize("swap", [False, True])
def test_gated_mlp_roles_found_by_probe(swap):
    block = Block(MyMLP(swap=swap))
    _parity(block, torch.randn(4, 16))
    spec = block.parts[0].spec
    assert isinstance(block.parts[0], FusedGatedMLP)
    assert (spec.gate, spec.up) == (("w_in_b", "w_in_a") if swap else ("w_in_a", "w_in_b"))


def test_gated_mlp_gelu_tanh_and_fused_gate_up():
    block = Block(MyMLP(act=nn.GELU(approximate="tanh")), FusedGateUp())
    _parity(block, torch.randn(4, 16))
    assert block.parts[0].spec.activation == "gelu_tanh"
    assert block.parts[1].spec.gate_up == "gate_up_proj" and block.parts[1].spec.gate_first is False


def test_gated_mlp_skips():
    block = Block(MyMLP(extra=True))
    torchfuser.optimize(block, backend="reference")
    reasons = [e.reason for e in torchfuser.report(block).skipped]
    assert any("unrecognised submodules ['scale']" in r for r in reasons)


def test_gated_mlp_exact_gelu():
    """Exact (erf) GELU gating (Pixtral's vision MLP) runs geglu with approximate='none'."""
    block = Block(MyMLP(act=nn.GELU()))
    _parity(block, torch.randn(4, 16))
    assert isinstance(block.parts[0], FusedGatedMLP) and block.parts[0].spec.activation == "gelu"


def test_plain_mlp_and_dropout_position():
    block = Block(PlainMLP(), PlainMLP(act=nn.GELU()), PlainMLP(dropout_first=True))
    block.eval()
    _parity(block, torch.randn(4, 16))
    assert isinstance(block.parts[0], FusedMLP) and block.parts[0].spec.approximate == "tanh"
    assert isinstance(block.parts[1], FusedMLP) and block.parts[1].spec.approximate == "none"
    # a dropout on the activation's output, before fc2: the fused MLP applies it there too (inner_dropout)
    assert isinstance(block.parts[2], FusedMLP) and (block.parts[2].spec.inner_dropout, block.parts[2].spec.dropout) == ("drop", None)


def test_fused_plain_mlp_keeps_dropout_in_training():
    block = Block(PlainMLP())
    torchfuser.optimize(block, backend="reference")
    block.train()
    x = torch.randn(64, 16)
    assert (block(x) == 0).any()  # dropout still applied
    block.eval()
    assert not (block(x) == 0).any()


def test_meta_device_model_is_inspected_without_memory():
    with torch.device("meta"):
        block = Block(ScaleNorm(4096), MyMLP(4096, 11008))
    torchfuser.optimize(block)
    rep = torchfuser.report(block)
    assert rep.counts() == {"gated_mlp": {"fused": 1, "skipped": 0}, "rms_norm": {"fused": 1, "skipped": 0}}
    assert "decided when run" in str(rep)


def test_strict_raises_before_changing_anything():
    block = Block(ScaleNorm(16), WrongEpsNorm(16))
    with pytest.raises(ValueError, match="parts.1: forward does not compute"):
        torchfuser.optimize(block, strict=True, backend="reference")
    assert isinstance(block.parts[0], ScaleNorm)


class DropoutGatedMLP(nn.Module):
    """A gated MLP with a dropout: a child after down, or a functional one reading a float p
    (before down when ``early``: the fused module's ``inner_dropout``)."""

    def __init__(self, d=16, inner=24, child=False, early=False):
        super().__init__()
        self.gate, self.up, self.down, self.act = (nn.Linear(d, inner), nn.Linear(d, inner), nn.Linear(inner, d), nn.SiLU())
        self.drop = nn.Dropout(0.1) if child else None
        self.hidden_dropout, self.early = 0.0, early  # p = 0 today: still a dropout once configured

    def forward(self, x):
        h = self.act(self.gate(x)) * self.up(x)
        if self.early:
            h = nn.functional.dropout(h, self.hidden_dropout, self.training)
        y = self.down(h)
        if self.drop is not None:
            return self.drop(y)
        return y if self.early else nn.functional.dropout(y, self.hidden_dropout, self.training)


def test_gated_mlp_dropouts_found_by_the_training_probe():
    block = Block(DropoutGatedMLP(child=True), DropoutGatedMLP(), DropoutGatedMLP(early=True))
    torchfuser.optimize(block, backend="reference")
    assert isinstance(block.parts[0], FusedGatedMLP) and block.parts[0].spec.dropout == "drop"
    assert isinstance(block.parts[1], FusedGatedMLP) and block.parts[1].spec.dropout == "hidden_dropout"
    assert isinstance(block.parts[2], FusedGatedMLP) and block.parts[2].spec.inner_dropout == "hidden_dropout"
    assert block.parts[2].spec.dropout is None
    block.parts[1].hidden_dropout = 0.5  # the fused module reads its own copy of p, as the original did its attribute
    block.train()
    assert (block.parts[1](torch.randn(64, 16)) == 0).any()
