"""LM head + loss with the head inside a wrapper of the model's own, not a child of the model: BERT's family's
``cls.predictions.decoder`` after its transform (dense, activation, LayerNorm; RemBERT's to a width of its own),
RoBERTa's ``lm_head.decoder``. The head's input is captured where the head is called, so the wrapper's own layers
before it run (and get their gradients) as the model's code; what runs after it the probes see. Loss and every
gradient against the unfused model (fp32, through the causal-LM sweep's checks), restore. An encoder-decoder forward
that makes its decoder's inputs from the labels (T5Gemma 2's) is given them as its
prepare_decoder_input_ids_from_labels makes them, checked on the probe. A head inside a causal LM of its own, inside
the decoder, or a scale the wrapper reads from a parameter after the head stay unfused with their reasons (decoder
inputs made from the labels by a shift of the forward's own: tests/test_lm_head_vlm_forms.py)."""
from __future__ import annotations

import copy

import pytest
import torch
from torch import nn
from transformers import BertConfig, BertLMHeadModel

import torchfuser
from torchfuser.patterns.base import Skip
from torchfuser.patterns.lm_head import LMHeadLossPattern

import arch_sweep
import vlm_sweep


@pytest.mark.parametrize("model_type", ["bert", "roberta", "rembert"])
def test_a_head_inside_a_wrapper_is_fused_exactly(model_type):
    r = arch_sweep.run_one(model_type)
    assert r.kind == "fused", (r.kind, r.detail)
    assert r.fused.get("lm_head_loss") == 1, r.skipped.get("lm_head_loss")


def _bert():
    cfg = BertConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2, vocab_size=64,
                     is_decoder=True)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        return BertLMHeadModel(cfg).train()


def test_the_path_is_the_head_s_and_restore_gives_the_original_back():
    model = _bert()
    spec = LMHeadLossPattern().match(model)
    assert not isinstance(spec, Skip), spec.reason
    assert spec.head == "cls.predictions.decoder" and spec.shift is True
    fused = torchfuser.optimize(copy.deepcopy(model), backend="reference", patterns=["lm_head_loss"])
    assert "forward" in fused.__dict__
    ids = torch.randint(3, 64, (2, 7), generator=torch.Generator().manual_seed(0))
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(1)  # the same dropout masks in both
        loss = fused(input_ids=ids, labels=ids).loss
        torch.manual_seed(1)
        want = model(input_ids=ids, labels=ids).loss
    assert type(fused.cls.predictions.decoder) is nn.Linear  # put back after the call
    torch.testing.assert_close(loss, want, rtol=1e-6, atol=1e-6)
    torchfuser.restore(fused)
    assert "forward" not in fused.__dict__


class _Scaled(nn.Module):
    """A wrapper multiplying the head's output by a parameter of its own."""

    def __init__(self, head: nn.Linear):
        super().__init__()
        self.decoder = head
        self.scale = nn.Parameter(torch.tensor(0.5))

    def forward(self, h):
        return self.decoder(h) * self.scale


def test_a_scale_read_from_the_wrapper_s_parameter_is_not_fused():
    model = _bert()
    model.cls.predictions = _Scaled(model.cls.predictions.decoder)
    spec = LMHeadLossPattern().match(model)
    assert isinstance(spec, Skip) and "parameter or buffer" in spec.reason, spec


def _head_spec(model_type: str):
    """What the LM head pattern finds on a tiny model of an image-text-to-text type (skipped where it is not one)."""
    if model_type not in vlm_sweep.model_types():
        pytest.skip(f"{model_type} is not an image-text-to-text type of this transformers")
    cfg = vlm_sweep.tiny_config(model_type)
    with torch.random.fork_rng(devices=[]):
        model = vlm_sweep._model_class(model_type)._from_config(cfg)
    return LMHeadLossPattern().match(model)


@pytest.mark.parametrize("model_type, why", [("pix2struct", "takes labels and computes a loss of its own")])
def test_heads_left_alone_say_why(model_type, why):
    spec = _head_spec(model_type)
    assert isinstance(spec, Skip) and why in spec.reason, spec


@pytest.mark.parametrize("model_type, from_labels", [("t5gemma2", True), ("pp_formulanet", False)])
def test_encoder_decoder_inputs_made_from_labels_are_made_alike(model_type, from_labels):
    """T5Gemma 2 makes its decoder's inputs from the labels where none are given (prepare_decoder_input_ids_from_labels;
    the fused loss calls its forward without labels, so it passes them itself); PP-FormulaNet makes them from its
    input_ids. The sweep's step gives labels alone: loss and every gradient exact."""
    spec = _head_spec(model_type)
    assert not isinstance(spec, Skip), spec.reason
    assert spec.decoder_inputs_from_labels is from_labels
    r = vlm_sweep.run_one(model_type)
    assert r.kind == "fused", (r.kind, r.detail)
    assert r.towers.get("text", {}).get("lm_head_loss") == 1, r.skipped.get("lm_head_loss")
