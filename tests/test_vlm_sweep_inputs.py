"""The image-text sweep's processor-style inputs (tests/vlm_pixels.py, tests/vlm_configs.py): types that were
unbuildable before their inputs were made as their processors make them, now built, fused and exact (loss and
every gradient, as tests/vlm_sweep.py checks); a type whose pixels do not reach the loss is not counted as
built; per-layer tables keyed by strings land in the tiny depth."""
from __future__ import annotations

import pytest

import vlm_configs
import vlm_sweep

# type → (tower, pattern, fused blocks): what each must fuse, besides being exact.
BUILT = {
    "mllama": ("vision", "attention", 4),  # tiles, aspect ratios, cross-attention mask; its global layers
    "gemma4": ("text", "lm_head_loss", 1),  # patches with (x, y) positions, per-layer table, vision tower filled in
    "blip-2": ("text", "lm_head_loss", 1),  # image token id the config leaves None
    "kosmos-2": ("vision", "attention", 3),  # image positions by mask
    "got_ocr2": ("vision", "rel_pos_attention", 2),  # SAM-style vision attention with decomposed relative positions
    "minicpm_ocr": ("vision", "varlen_attention", 3),  # packed patch strips; its attention requires max_seqlen
}


@pytest.mark.parametrize("model_type", BUILT)
def test_built_fused_and_exact(model_type):
    r = vlm_sweep.run_one(model_type)
    assert r.kind == "fused", (r.kind, r.detail)
    tower, pattern, count = BUILT[model_type]
    assert r.towers.get(tower, {}).get(pattern) == count, (r.towers, r.skipped.get(pattern))


def test_pixels_that_do_not_reach_the_loss_are_not_built():
    """Mistral 4's config names no image token: plain text beside the pixels leaves the image unused."""
    r = vlm_sweep.run_one("mistral4")
    assert r.kind == "unbuildable" and "do not reach the loss" in r.detail, (r.kind, r.detail)


def test_per_layer_table_keyed_by_strings_maps_into_the_tiny_depth():
    values = {"text_config": {"model_type": "x", "per_layer_config": {"05": {"head_dim": 512}}, "a_config": {}}}
    assert vlm_configs._int_layer_keys(values)["text_config"]["per_layer_config"] == {5: {"head_dim": 512}}
    merged = vlm_configs._merge(values, {"text_config": {"per_layer_config": {1: {"head_dim": 512}}}})
    assert merged["text_config"]["per_layer_config"] == {1: {"head_dim": 512}}  # replaced whole, not merged
    assert not vlm_configs._is_sub("per_layer_config", {"model_type": "x"})
