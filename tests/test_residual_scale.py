"""Layers that add each block's output times a float attribute of theirs (Granite's ``residual_multiplier``,
MiniCPM3's ``residual_scale``): ``ResidualNormSpec.attention_scale`` / ``mlp_scale``, read at each call as the
original reads them. One training step fused vs unfused (loss and every gradient), the attribute changed after
``optimize`` followed, and a factor written in the code left alone with the reason."""
from __future__ import annotations

import copy

import pytest
import torch

import torchfuser
from torchfuser.patterns.residual_norm import ResidualNormPattern

from numerics import assert_trains_like
from tiny_lm import fused_layers, lm_step as step, tiny_model
from test_residual_norm import ScaledResidual

_CASES = [("granite", dict(residual_multiplier=0.22), "residual_multiplier"),
          ("granitemoe", dict(residual_multiplier=0.22), "residual_multiplier"),
          ("minicpm3", dict(scale_depth=1.4), "residual_scale")]


@pytest.mark.parametrize("model_type, fields, name", _CASES, ids=[c[0] for c in _CASES])
def test_training_step_matches_unfused(model_type, fields, name):
    ref = tiny_model(model_type, **fields)
    fused = copy.deepcopy(ref)
    torchfuser.optimize(fused, backend="reference")
    found = fused_layers(fused)
    assert len(found) == 2, str(torchfuser.report(fused))
    assert {(m.forward.spec.attention_scale, m.forward.spec.mlp_scale) for m in found} == {(name, name)}
    assert getattr(found[0], name) != 1.0
    assert_trains_like(ref, fused, step, list(ref.state_dict()))


def test_the_attribute_is_read_at_each_call():
    ref = tiny_model("granite", residual_multiplier=0.22)
    fused = copy.deepcopy(ref)
    torchfuser.optimize(fused, backend="reference")
    for m in (ref, fused):
        for layer in m.model.layers:
            layer.residual_multiplier = 0.7
    assert_trains_like(ref, fused, step, list(ref.state_dict()))


def test_a_factor_written_in_the_code_is_left_alone_with_the_reason():
    torch.manual_seed(0)
    skip = ResidualNormPattern().match(ScaledResidual())
    assert "a residual scale not held in one float attribute of the layer" in skip.reason, skip


def test_a_multiplier_at_one_today_is_followed_when_set_later():
    """Granite's default residual_multiplier is 1.0: the layer is the plain form today, and the probe still
    finds the attribute it reads, so that a multiplier set after ``optimize`` is followed."""
    ref = tiny_model("granite", residual_multiplier=1.0)
    fused = copy.deepcopy(ref)
    torchfuser.optimize(fused, backend="reference")
    assert {(m.forward.spec.attention_scale, m.forward.spec.mlp_scale) for m in fused_layers(fused)} == {
        ("residual_multiplier", "residual_multiplier")}
    for m in (ref, fused):
        for layer in m.model.layers:
            layer.residual_multiplier = 0.5
    assert_trains_like(ref, fused, step, list(ref.state_dict()))


def test_a_plain_layer_gets_no_scale():
    ref = tiny_model("llama")
    torchfuser.optimize(ref, backend="reference")
    assert {(m.forward.spec.attention_scale, m.forward.spec.mlp_scale) for m in fused_layers(ref)} == {(None, None)}
