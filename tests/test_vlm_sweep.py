"""The image-text-to-text sweep (tests/vlm_sweep.py) as tests: four representative types in the quick suite
(both towers fused, the LM head + loss on the outer model included, loss and every gradient exact), every
type of the installed transformers in the slow one (zero wrong results and crashes; the README's table is
the one the sweep prints)."""
from __future__ import annotations

import re
from pathlib import Path

import pytest
import torch
import transformers

import vlm_sweep

README = Path(__file__).resolve().parents[1] / "README.md"
# Qwen2.5-VL (flattened patches + grid_thw, multimodal rotary), Gemma 3 (vocabulary in the text config,
# pooled image tokens), LLaVA (CLIP tower + projector), Idefics3 / SmolVLM (pixel-shuffle connector, 5-D pixels).
# The vision attention each fuses: over cu_seqlens (windowed and full layers) or batched.
REPRESENTATIVE = {"qwen2_5_vl": "varlen_attention", "gemma3": "attention", "llava": "attention", "idefics3": "attention"}


@pytest.mark.parametrize("model_type", REPRESENTATIVE)
def test_representative_type_fused_in_both_towers_and_exact(model_type):
    r = vlm_sweep.run_one(model_type)
    assert r.kind == "fused", (r.kind, r.detail)
    assert r.towers.get("vision", {}).get(REPRESENTATIVE[model_type]) == 2, (r.towers, r.skipped)
    assert r.towers.get("text", {}).get("lm_head_loss") == 1, f"LM head + loss not fused: {r.skipped.get('lm_head_loss')}"


def test_zero_gradient_is_judged_against_a_norm_floor():
    """A gradient that is zero in exact arithmetic differs by rounding only: not a failure; a real
    difference is one."""
    a, b = torch.nn.Linear(4, 4), torch.nn.Linear(4, 4)
    b.load_state_dict(a.state_dict())
    a.weight.grad, b.weight.grad = torch.ones(4, 4), torch.ones(4, 4)
    a.bias.grad, b.bias.grad = torch.zeros(4), torch.full((4,), 1e-9)
    assert vlm_sweep.grads_match(a, b) is None
    b.bias.grad = torch.full((4,), 1e-2)
    assert "bias" in vlm_sweep.grads_match(a, b)


def test_image_tokens_are_placed_and_masked():
    cfg = vlm_sweep.tiny_config("llava")
    model = vlm_sweep._model_class("llava")._from_config(cfg)
    inputs = vlm_sweep.build_inputs(model, next(vlm_sweep.pixel_candidates(model, 2)))
    image = vlm_sweep._image_token(cfg)
    is_image = inputs["input_ids"] == image
    assert is_image.sum(1).tolist() == [is_image.sum().item() // 2] * 2 and is_image.any()
    assert (inputs["labels"][is_image] == -100).all() and (inputs["labels"][~is_image] >= 0).all()


@pytest.fixture(scope="module")
def results():
    return vlm_sweep.sweep()


@pytest.mark.slow
def test_every_type_no_wrong_result_and_no_crash(results):
    failed = [f"{r.model_type}: {r.kind}: {r.detail}" for r in results if r.failed]
    print("\n" + vlm_sweep.summary(results))
    assert not failed, "\n".join(failed)
    by_type = {r.model_type: r for r in results}
    assert all(by_type[t].kind == "fused" for t in REPRESENTATIVE if t in by_type)


@pytest.mark.slow
def test_readme_table_is_generated(results):
    text = README.read_text()
    assert vlm_sweep._BEGIN in text, "the README has no VLM table: run `python tests/vlm_sweep.py --readme`"
    found = re.search(r"with transformers (\S+?):", text[text.find(vlm_sweep._BEGIN):])
    if found is None or found.group(1) != transformers.__version__:
        pytest.skip(f"the README's VLM table is for another transformers than {transformers.__version__}")
    assert vlm_sweep.table(results) in text, "the README's VLM table is stale: run `python tests/vlm_sweep.py --readme`"


# type → {tower: attention blocks fused}: BLIP's family's vision attention (its head width read from its input's
# width; a mask of its own; a Dropout of p = 0 on the probabilities), Gemma 4's text attention (a weightless v norm,
# k and v handed on through shared_kv_states) and its vision attention (projections wrapped in clippable modules,
# here with use_clipped_linears=True as Gemma 4's checkpoints set it, the slow sweep's default False; a 2-D rotary:
# one rotate-half part per axis of position_ids; bounds that clip: tests/test_attention_gemma4_vision.py).
ATTENTION = {"blip": {"vision": 2}, "blip-2": {"vision": 2}, "gemma4": {"text": 2, "vision": 2},
             "gemma4_unified": {"text": 2}}
VISION_FIELDS = {"gemma4": {"use_clipped_linears": True}}


@pytest.mark.parametrize("model_type", ATTENTION)
def test_attention_fused_and_exact(model_type):
    if model_type not in vlm_sweep.model_types():
        pytest.skip(f"{model_type} is not an image-text-to-text type of this transformers")
    r = vlm_sweep.run_one(model_type, VISION_FIELDS.get(model_type))
    assert r.kind == "fused", (r.kind, r.detail)
    for tower, count in ATTENTION[model_type].items():
        assert r.towers.get(tower, {}).get("attention") == count, (tower, r.towers, r.skipped.get("attention"))


def test_vision_attention_with_q_and_k_norms_fused():
    """InternVL's vision attention: RMS q/k norms over all heads (use_qk_norm=True)."""
    r = vlm_sweep.run_one("internvl", {"use_qk_norm": True})  # off (Identity): the slow sweep's internvl
    assert r.kind == "fused", (r.kind, r.detail)
    assert r.towers.get("vision", {}).get("attention") == 2, r.skipped.get("attention")


def test_vision_attention_with_unbatched_2d_rotary_tables_fused():
    """Mistral 3 (Pixtral's vision tower): rotary tables S × D from 2-D patch positions, shared by the batch;
    its gated MLP uses exact (erf) GELU."""
    r = vlm_sweep.run_one("mistral3")
    assert r.kind == "fused", (r.kind, r.detail)
    vision = r.towers.get("vision", {})
    assert vision.get("attention") == 2 and vision.get("gated_mlp") == 2, (vision, r.skipped)

