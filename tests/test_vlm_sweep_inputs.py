"""The image-text sweep's processor-style inputs (tests/vlm_pixels.py, tests/vlm_configs.py): types that were
unbuildable before their inputs were made as their processors make them, now built, fused and exact (loss and
every gradient, as tests/vlm_sweep.py checks); pixels that do not reach the loss are told from pixels that do; per-layer tables keyed by strings land in the tiny depth."""
from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

import vlm_configs
import vlm_sweep

# type → (tower, pattern, fused blocks): what each must fuse, besides being exact.
BUILT = {
    "mllama": ("vision", "attention", 4),  # tiles, aspect ratios, cross-attention mask; its global layers
    "gemma4": ("text", "lm_head_loss", 1),  # patches with (x, y) positions, per-layer table, vision tower filled in
    "blip-2": ("vision", "attention", 2),  # image token id the config leaves None
    "kosmos-2": ("vision", "attention", 3),  # image positions by mask
    "got_ocr2": ("vision", "rel_pos_attention", 2),  # SAM-style vision attention with decomposed relative positions
    "minicpm_ocr": ("vision", "varlen_attention", 3),  # packed patch strips; its attention requires max_seqlen
    "ovis2_5": ("vision", "varlen_attention", 2),  # the image's run between its start and end tokens
    "pix2struct": ("vision", "attention", 2),  # T5-style head width d_kv made tiny with the heads
    "pp_formulanet": ("vision", "rel_pos_attention", 2),  # the encoder's width as its decoder reads it
    "step3p7": ("vision", "attention", 2),  # a sliding window its config declares but leaves None
    "unlimited_ocr": ("vision", "rel_pos_attention", 2),  # a SAM map's channels as the next encoder's width
    "deepseek_ocr2": ("vision", "rel_pos_attention", 2),  # per-layer MLP kinds left None
    "inkling2": ("vision", "varlen_attention", 2),  # channels-last token images; adjacent-pair rotary over cu_seqlens
    "muse_spark": ("vision", "varlen_attention", 2),  # per-stage audio lists cut; merged patch width kept as merged
    "muse_glimmer": ("vision", "varlen_attention", 2),  # patch_temporal; merged patch width kept as merged
    "mistral_large4": ("vision", "attention", 2),  # per-layer kinds padded to the depth; runs only without GQA
    "apertus1p5": ("text", "attention", 2),  # image and audio codes at fixed offsets; WavTokenizer codebook_dim tied
    "chameleon": ("text", "gated_mlp", 2),  # a vocabulary map of its VQ codes (its LM head left alone: masked columns)
    "emu3": ("text", "attention", 2),  # a vocabulary map of its VQ codes and row ends
    "cohere_compass": ("vision", "varlen_attention", 2),  # a default rotary per layer type (none by default)
    "dots3_note": ("vision", "varlen_attention", 2),  # sliding layers' head_dim = no-rotary + rotary; adapter widths
    "glm5_next": ("vision", "varlen_attention", 2),  # NoPE DSA layers: a rotary width of 0 kept 0
    "granite4_vision": ("vision", "attention", 2),  # Window Q-Former projectors, deepstack map and spatial groups
    "mistral4": ("text", "moe", 2),  # a causal LM alone, run on text; head_dim = no-rotary + rotary
    "molmo2": ("vision", "attention", 3),  # crops, pooling indices and grids; feature layers within the depth
    "pi0": ("text", "attention", 6),  # a robot policy: state, actions, noise, time; its inner VLM's image token
    "pi05": ("text", "attention", 6),
    "qwen4_exp": ("vision", "varlen_attention", 2),  # a QSA indexer the config leaves None
}


def _installed(model_type):
    if model_type not in vlm_sweep.model_types():
        pytest.skip(f"{model_type} is not an image-text-to-text type of this transformers")


@pytest.mark.parametrize("model_type", BUILT)
def test_built_fused_and_exact(model_type):
    _installed(model_type)
    r = vlm_sweep.run_one(model_type)
    assert r.kind == "fused", (r.kind, r.detail)
    tower, pattern, count = BUILT[model_type]
    assert r.towers.get(tower, {}).get(pattern) == count, (r.towers, r.skipped.get(pattern))


class _TwoTowers(torch.nn.Module):
    """A language model and a vision tower whose output reaches the loss, or not."""

    def __init__(self, uses_pixels: bool):
        super().__init__()
        self.language_model, self.vision_tower, self.uses_pixels = torch.nn.Linear(4, 4), torch.nn.Linear(4, 4), uses_pixels

    def get_decoder(self):
        return self.language_model

    def forward(self, input_ids, pixel_values, labels, use_cache=False):
        h = self.language_model(input_ids.float())
        if self.uses_pixels:
            h = h + self.vision_tower(pixel_values).mean()
        return SimpleNamespace(loss=(h - labels).pow(2).mean())


@pytest.mark.parametrize("uses_pixels", [True, False])
def test_pixels_that_do_not_reach_the_loss_are_told_apart(uses_pixels):
    """A type whose config names no image token gets plain text beside its pixels: built only where they count."""
    model = _TwoTowers(uses_pixels)
    inputs = {"input_ids": torch.ones(2, 4), "pixel_values": torch.randn(2, 4), "labels": torch.zeros(2, 4)}
    vlm_sweep._step(model, inputs)
    assert vlm_sweep._image_reached_loss(model, inputs) is uses_pixels


def test_per_layer_table_keyed_by_strings_maps_into_the_tiny_depth():
    values = {"text_config": {"model_type": "x", "per_layer_config": {"05": {"head_dim": 512}}, "a_config": {}}}
    assert vlm_configs._int_layer_keys(values)["text_config"]["per_layer_config"] == {5: {"head_dim": 512}}
    merged = vlm_configs._merge(values, {"text_config": {"per_layer_config": {1: {"head_dim": 512}}}})
    assert merged["text_config"]["per_layer_config"] == {1: {"head_dim": 512}}  # replaced whole, not merged
    assert not vlm_configs._is_sub("per_layer_config", {"model_type": "x"})
