"""The inputs the lm_head_loss probes run a forward on (``_lm_head_probe_inputs``): token ids alone for a forward that
runs on text, and for one that requires pixel values (BLIP-2, InstructBLIP, InstructBLIP-Video) pixel values of its
vision config's image size with its image tokens placed as its processor places them (as many a row as its
``get_image_features`` / ``get_video_features`` makes). The image tokens are what lets the probe see a forward that
masks the image positions' labels itself (its loss is then not the fused loss's: left unfused); a forward that
requires an input of another kind is not probed, and says so. (Exactness of the three fused types: in
test_lm_head_vlm_forms.py.)"""
from __future__ import annotations

import copy

import pytest
import torch

import torchfuser
from torchfuser.patterns import _lm_head_probe as probe
from torchfuser.patterns.base import Skip
from torchfuser.patterns.lm_head import LMHeadLossPattern

import vlm_sweep

_BUILT: dict = {}


def _model(model_type: str):
    if model_type not in vlm_sweep.model_types():
        pytest.skip(f"{model_type} is not an image-text-to-text type of this transformers")
    if model_type not in _BUILT:
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(0)
            cfg = vlm_sweep.tiny_config(model_type)
            _BUILT[model_type] = vlm_sweep._model_class(model_type)._from_config(cfg).float().train()
    return copy.deepcopy(_BUILT[model_type])


def test_a_text_forward_gets_token_ids_alone():
    model = _model("blip-2").language_model
    inputs = probe.forward_inputs(model)
    assert inputs.keys() == {"input_ids"} and inputs["input_ids"].shape == (probe._B, probe._S)


@pytest.mark.parametrize("model_type, pixels, others", [
    ("blip-2", (2, 3, 112, 112), set()),
    ("instructblip", (2, 3, 112, 112), {"qformer_input_ids"}),
    ("instructblipvideo", (2, 1, 3, 112, 112), {"qformer_input_ids"}),  # a video: one frame a row
])
def test_pixel_values_and_image_tokens_as_a_processor_makes_them(model_type, pixels, others):
    model = _model(model_type)
    size = model.config.vision_config.image_size
    assert pixels[-1] == size  # (the tiny config's image size)
    state, weights = torch.get_rng_state(), copy.deepcopy(model.state_dict())
    inputs = probe.forward_inputs(model)
    assert torch.equal(torch.get_rng_state(), state)  # the vision tower ran in eval mode, under saved generators
    assert all(m.training for m in model.modules())  # ... and every module's training flag is put back
    assert all(torch.equal(t, model.state_dict()[k]) for k, t in weights.items())
    assert inputs.keys() == {"input_ids", "pixel_values", *others}
    assert inputs["pixel_values"].shape == pixels and inputs["pixel_values"].dtype == torch.float32
    ids = inputs["input_ids"]
    cfg = model.config
    token = next(getattr(cfg, n) for n in ("image_token_id", "video_token_id") if getattr(cfg, n, None) is not None)
    n = cfg.num_query_tokens * (pixels[1] if len(pixels) == 5 else 1)  # the features a row the model makes
    assert ids.shape == (2, probe._S + n)
    assert (ids == token).sum(1).tolist() == [n, n] and (ids[:, 1:1 + n] == token).all()


def _subclass(model, forward):
    """The model as an instance of a class of the same name whose forward is ``forward`` around the original's."""
    cls = type(model)
    model.__class__ = type(cls.__name__, (cls,), {"forward": forward})
    return model


def test_a_forward_that_masks_image_labels_itself_is_left_unfused():
    """Were the probe's ids text alone, this forward's loss would look like the fused loss's, which would then count
    labels the forward ignores (image positions not given -100 by the user)."""
    base = type(_model("blip-2"))

    def forward(self, pixel_values, input_ids, labels=None, **kwargs):
        if labels is not None:
            labels = labels.masked_fill(input_ids == self.config.image_token_id, -100)
        return base.forward(self, pixel_values=pixel_values, input_ids=input_ids, labels=labels, **kwargs)

    model = _subclass(_model("blip-2"), forward)
    spec = LMHeadLossPattern().match(model)
    assert isinstance(spec, Skip) and "not a cross-entropy of shifted or unshifted labels" in spec.reason, spec
    torchfuser.optimize(model, backend="reference", patterns=["lm_head_loss"])
    assert "forward" not in model.__dict__  # the model's own head and loss run


def test_a_forward_that_requires_another_input_is_not_probed():
    base = type(_model("blip-2"))

    def forward(self, pixel_values, input_ids, image_scale, labels=None, **kwargs):
        return base.forward(self, pixel_values=pixel_values * image_scale, input_ids=input_ids, labels=labels, **kwargs)

    model = _subclass(_model("blip-2"), forward)
    assert probe.forward_inputs(model) is None
    spec = LMHeadLossPattern().match(model)
    assert isinstance(spec, Skip) and "it needs other inputs" in spec.reason, spec


def test_on_the_meta_device_nothing_is_run():
    with torch.device("meta"):
        model = vlm_sweep._model_class("blip-2")._from_config(vlm_sweep.tiny_config("blip-2"))
    assert probe.forward_inputs(model) is None
