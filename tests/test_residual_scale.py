"""Layers that add each block's output times a float attribute of theirs (Granite's ``residual_multiplier``,
MiniCPM3's ``residual_scale``): ``ResidualNormSpec.attention_scale`` / ``mlp_scale``, read at each call as the
original reads them. One training step fused vs unfused (loss and every gradient), the attribute changed after
``optimize`` followed, and a factor written in the code left alone with the reason."""
from __future__ import annotations

import copy

import pytest
import torch
from transformers import AutoModelForCausalLM

import torchfuser
from torchfuser.modules.residual_norm import ResidualNormForward
from torchfuser.patterns.residual_norm import ResidualNormPattern

from arch_sweep import tiny_config
from numerics import assert_trains_like
from test_residual_norm import ScaledResidual

VOCAB = 128
_CASES = [("granite", dict(residual_multiplier=0.22), "residual_multiplier"),
          ("granitemoe", dict(residual_multiplier=0.22), "residual_multiplier"),
          ("minicpm3", dict(scale_depth=1.4), "residual_scale")]


def _model(model_type: str, **fields):
    cfg = tiny_config(model_type)
    for k, v in fields.items():
        setattr(cfg, k, v)
    torch.manual_seed(0)
    return AutoModelForCausalLM.from_config(cfg).float().train()


def step(model, device="cpu"):
    ids = torch.randint(3, VOCAB, (2, 10), generator=torch.Generator().manual_seed(1)).to(device)
    torch.manual_seed(0)
    loss = model(input_ids=ids, labels=ids, use_cache=False).loss
    loss.backward()
    return loss.detach()


def layers(model):
    return [m for m in model.modules() if isinstance(m.__dict__.get("forward"), ResidualNormForward)]


@pytest.mark.parametrize("model_type, fields, name", _CASES, ids=[c[0] for c in _CASES])
def test_training_step_matches_unfused(model_type, fields, name):
    ref = _model(model_type, **fields)
    fused = copy.deepcopy(ref)
    torchfuser.optimize(fused, backend="reference")
    found = layers(fused)
    assert len(found) == 2, str(torchfuser.report(fused))
    assert {(m.forward.spec.attention_scale, m.forward.spec.mlp_scale) for m in found} == {(name, name)}
    assert getattr(found[0], name) != 1.0
    assert_trains_like(ref, fused, step, list(ref.state_dict()))


def test_the_attribute_is_read_at_each_call():
    ref = _model("granite", residual_multiplier=0.22)
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
    ref = _model("granite", residual_multiplier=1.0)
    fused = copy.deepcopy(ref)
    torchfuser.optimize(fused, backend="reference")
    assert {(m.forward.spec.attention_scale, m.forward.spec.mlp_scale) for m in layers(fused)} == {
        ("residual_multiplier", "residual_multiplier")}
    for m in (ref, fused):
        for layer in m.model.layers:
            layer.residual_multiplier = 0.5
    assert_trains_like(ref, fused, step, list(ref.state_dict()))


def test_a_plain_layer_gets_no_scale():
    ref = _model("llama")
    torchfuser.optimize(ref, backend="reference")
    assert {(m.forward.spec.attention_scale, m.forward.spec.mlp_scale) for m in layers(ref)} == {(None, None)}
