"""LM head + loss of the image-text-to-text models whose loss takes a form of its own, fused where the fused loss
reproduces it exactly, with the reason where it does not:

- Florence-2 and UDOP (encoder-decoders) make their decoder's inputs from the labels with a shift of their own
  (``shift_tokens_right`` / ``_shift_right``, no ``prepare_decoder_input_ids_from_labels`` that does it): read off
  the probe as (start token, pad token) and made alike by the fused forward, every call of the stand-in encoder and
  decoder checked against the labelled forward's; UDOP scales the decoder's output by d_model^-0.5 before a tied
  head (captured with the head's input); Florence-2 turns the cache off with labels and raises on ``shift_labels=``;
- GIT scores only the text after its image's positions (``logits[:, N:-1]`` against ``labels[:, 1:]``): N found
  with a loss function that records the positions it is given, then the whole loss checked at that geometry;
- Llama 4, Nemotron-H Omni and Kosmos-2.5 hold the head in an inner causal LM; the first two call it without
  labels and compute the loss from its logits themselves (the inner model's fused loss never ran): the model's own
  is fused at the inner head's path, the probes standing in for the inner model's decoder; so do BLIP-2,
  InstructBLIP and InstructBLIP-Video, whose forward needs pixel values (built by the probes from the config), and
  VisionEncoderDecoder, whose decoder is a causal LM (BERT's) it calls without labels on decoder inputs it makes from
  them.

Loss and every gradient (the head's weight, tied or not, included) against the unfused model in fp32, the fused
loss run (one fused call); BLIP's text decoder (handed the labels by BLIP) fused where it smooths no labels; the
heads left alone (Pix2Struct's inside its decoder) say why."""
from __future__ import annotations

import copy

import pytest
import torch

import torchfuser
from torchfuser.modules.lm_head import FusedLMHeadLoss, shift_right
from torchfuser.patterns.base import Skip
from torchfuser.patterns.lm_head import LMHeadLossPattern

import vlm_sweep
from vlm_pixels import pixel_candidates


_BUILT: dict = {}


def _model(model_type: str, **fields):
    """A tiny model of the type and the sweep's inputs for it (built once a type and fields, copied each time)."""
    key = (model_type, tuple(sorted(fields.items())))
    if key not in _BUILT:
        _BUILT[key] = _build(model_type, **fields)
    model, inputs = _BUILT[key]
    return copy.deepcopy(model), inputs


def _build(model_type: str, **fields):
    if model_type not in vlm_sweep.model_types():
        pytest.skip(f"{model_type} is not an image-text-to-text type of this transformers")
    try:
        cfg = vlm_sweep.tiny_config(model_type)
    except ValueError as err:  # (transformers 5.17 builds no VisionEncoderDecoder config from defaults)
        pytest.skip(f"no tiny config of {model_type} in this transformers: {err}")
    for k, v in fields.items():
        setattr(cfg, k, v)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        model = vlm_sweep._model_class(model_type)._from_config(cfg).float().train()
    for pixels in pixel_candidates(model, 2):
        try:
            inputs = vlm_sweep.build_inputs(model, pixels)
            with torch.no_grad():
                model(**inputs, use_cache=False)
            return model, inputs
        except Exception:
            continue
    pytest.skip(f"no inputs built for {model_type}")


def _step(model, inputs, **extra):
    model.zero_grad(set_to_none=True)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        out = model(**{k: v.clone() for k, v in inputs.items()}, **extra)
    out.loss.backward()
    return out, {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


def _fused_head(model) -> FusedLMHeadLoss:
    return model.__dict__["forward"]


def _check_exact(model, inputs, **extra):
    fused = torchfuser.optimize(copy.deepcopy(model), backend="reference", patterns=["lm_head_loss"])
    head = _fused_head(fused)
    assert head.model is fused  # the model's own (an inner causal LM's, Kosmos-2.5's, idle in its calls)
    want, want_g = _step(model, inputs, **extra)
    got, got_g = _step(fused, inputs, **extra)
    assert head.calls.n == 1  # the fused loss ran
    torch.testing.assert_close(got.loss, want.loss, rtol=1e-5, atol=1e-6)
    assert got_g.keys() == want_g.keys()
    floor = 1e-6 * max(g.abs().max().item() for g in want_g.values())
    for name, g in want_g.items():
        torch.testing.assert_close(got_g[name], g, rtol=1e-4, atol=1e-4 * g.abs().max().item() + floor, msg=name)
    torchfuser.restore(fused)
    assert "forward" not in fused.__dict__
    return head


@pytest.mark.parametrize("model_type, fields", [
    ("florence2", dict(decoder_shift=(2, 1), cache_off=True, refused_kwargs=("shift_labels",), shift=False)),
    ("udop", dict(decoder_shift=(0, 0), shift=False, leading=0)),
    ("git", dict(leading=65, shift=True, cache_off=True)),
    ("llama4", dict(head="language_model.lm_head", shift=True)),
    ("nemotron_h_omni", dict(head="language_model.lm_head", shift=True)),
    ("kosmos-2.5", dict(head="text_model.lm_head", shift=True, cache_off=True)),
    ("blip-2", dict(head="language_model.lm_head", shift=True, leading=0)),
    ("instructblip", dict(head="language_model.lm_head", shift=True, leading=0)),
    ("instructblipvideo", dict(head="language_model.lm_head", shift=True, leading=0)),
    # its decoder (a BERT causal LM) called without labels on the labels shifted right, its loss unshifted
    ("vision-encoder-decoder", dict(head="decoder.cls.predictions.decoder", shift=False,
                                    decoder_inputs_from_labels=True, loss_kwargs=())),
])
def test_the_spec_is_probed(model_type, fields):
    model, _ = _model(model_type)
    spec = LMHeadLossPattern().match(model)
    assert not isinstance(spec, Skip), spec.reason
    for k, v in fields.items():
        assert getattr(spec, k) == v, (k, getattr(spec, k))


@pytest.mark.parametrize("model_type, fields", [pytest.param("florence2", {}, marks=pytest.mark.slow),  # ≈ 30 s here
                                                ("udop", {"tie_word_embeddings": True}),
                                                ("udop", {"tie_word_embeddings": False}), ("git", {}),
                                                ("llama4", {}), ("nemotron_h_omni", {}), ("kosmos-2.5", {}),
                                                ("blip-2", {}), ("instructblip", {}), ("instructblipvideo", {}),
                                                ("vision-encoder-decoder", {})])
def test_loss_and_every_gradient_exact(model_type, fields):
    model, inputs = _model(model_type, **fields)
    if "tie_word_embeddings" in fields:
        tied = model.lm_head.weight is model.get_input_embeddings().weight
        assert tied is fields["tie_word_embeddings"]
    _check_exact(model, inputs)


def test_git_honours_num_items_in_batch_and_shift_labels():
    model, inputs = _model("git")
    _check_exact(model, inputs, num_items_in_batch=torch.tensor(5))
    labels = inputs["labels"]
    shifted = torch.nn.functional.pad(labels, (0, 1), value=-100)[:, 1:].contiguous()
    _check_exact(model, inputs, shift_labels=shifted)


def test_git_with_labels_of_another_length_raises():
    model, inputs = _model("git")
    fused = torchfuser.optimize(copy.deepcopy(model), backend="reference", patterns=["lm_head_loss"])
    inputs = {**inputs, "labels": inputs["labels"][:, 1:]}
    with pytest.raises(Exception):
        model(**inputs)
    with pytest.raises(RuntimeError, match="one label per position"):
        fused(**inputs)


def test_blip2_with_labels_of_the_text_alone_raises():
    """BLIP-2 scores labels shorter than its input against the last positions (``logits[:, -labels.size(1):]``, the
    form of processors that put no image tokens in the ids; in fp32 transformers 5.25's own loss then fails on a view
    of the sliced logits, in bf16 it runs): the probe saw labels as long as the input only, so the fused forward
    raises, saying what to do, rather than score them against other positions."""
    model, inputs = _model("blip-2")
    fused = torchfuser.optimize(copy.deepcopy(model), backend="reference", patterns=["lm_head_loss"])
    inputs = {**inputs, "labels": inputs["labels"][:, -4:].contiguous()}
    with pytest.raises(RuntimeError, match="one label per position"):
        fused(**inputs)


def test_florence2_refuses_shift_labels_as_its_forward_does():
    model, inputs = _model("florence2")
    fused = torchfuser.optimize(copy.deepcopy(model), backend="reference", patterns=["lm_head_loss"])
    with pytest.raises(TypeError):
        model(**inputs, shift_labels=inputs["labels"])
    with pytest.raises(TypeError, match="shift_labels"):
        fused(**inputs, shift_labels=inputs["labels"])


def test_shift_right():
    labels = torch.tensor([[5, -100, 7, 8], [-100, 4, 3, -100]])
    assert torch.equal(shift_right(labels, 2, 1), torch.tensor([[2, 5, 1, 7], [2, 1, 4, 3]]))


def test_blip_text_decoder_fused_where_it_smooths_no_labels():
    """BLIP's head sits in its text decoder (``BlipTextLMHeadModel``), which its forward hands the labels: fused there;
    a call for per-row losses (``reduction="none"``) runs the original; label smoothing leaves it unfused, saying so."""
    model, inputs = _model("blip")
    fused = torchfuser.optimize(copy.deepcopy(model), backend="reference", patterns=["lm_head_loss"])
    head = fused.text_decoder.__dict__["forward"]
    assert isinstance(head, FusedLMHeadLoss) and head.spec.head == "cls.predictions.decoder"
    want, want_g = _step(model, inputs)
    got, got_g = _step(fused, inputs)
    assert head.calls.n == 1
    torch.testing.assert_close(got.loss, want.loss, rtol=1e-5, atol=1e-6)
    assert got_g.keys() == want_g.keys()
    for name, g in want_g.items():
        torch.testing.assert_close(got_g[name], g, rtol=1e-4, atol=1e-4 * g.abs().max().item() + 1e-8, msg=name)
    ids, labels = inputs["input_ids"], inputs["input_ids"]
    per_row = fused.text_decoder(input_ids=ids, labels=labels, reduction="none").loss
    assert per_row.shape == (ids.shape[0],) and head.calls.n == 1  # the original's, not fused
    smoothing = copy.deepcopy(model)
    smoothing.text_decoder.label_smoothing = 0.1
    spec = LMHeadLossPattern().match(smoothing.text_decoder)
    assert isinstance(spec, Skip) and "label_smoothing=0.1" in spec.reason, spec


@pytest.mark.parametrize("model_type, why", [
    ("pix2struct", "that decoder's forward takes labels and computes a loss of its own"),
])
def test_heads_left_alone_say_why(model_type, why):
    model, _ = _model(model_type)
    spec = LMHeadLossPattern().match(model)
    assert isinstance(spec, Skip) and why in spec.reason, spec


@pytest.mark.parametrize("model_type", ["udop", "git", "blip-2"])  # (Florence-2's: in the slow sweep test)
def test_the_sweep_fuses_the_head_exactly(model_type):
    r = vlm_sweep.run_one(model_type)
    assert r.kind == "fused", (r.kind, r.detail)
    assert r.towers.get("text", {}).get("lm_head_loss") == 1, r.skipped.get("lm_head_loss")


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("model_type", ["florence2", "git", "llama4", "blip-2", "instructblip", "vision-encoder-decoder"])
def test_cuda_fused_loss_and_gradients(model_type):
    """On the GPU (the Triton linear_cross_entropy kernel), fp32: loss and every gradient as the unfused model's."""
    model, inputs = _model(model_type)
    model, inputs = model.cuda(), {k: v.cuda() for k, v in inputs.items()}
    fused = torchfuser.optimize(copy.deepcopy(model), patterns=["lm_head_loss"])
    want, want_g = _step(model, inputs)
    got, got_g = _step(fused, inputs)
    assert _fused_head(fused).calls.n == 1
    torch.testing.assert_close(got.loss, want.loss, rtol=1e-4, atol=1e-5)
    for name, g in want_g.items():
        torch.testing.assert_close(got_g[name], g, rtol=1e-3, atol=1e-3 * g.abs().max().item() + 1e-7, msg=name)
