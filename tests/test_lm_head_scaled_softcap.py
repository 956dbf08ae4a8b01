"""LM head + loss forms the image-text sweep found unfused: a scale before the final softcap, c·tanh(s·z/c) (MuSE
Spark's and Glimmer's ``output_multiplier``), measured on the probe; a head of another width than the config's
vocabulary (Inkling 2's ``unpadded_vocab_size``), fused where the probe shows the loss runs over the head's whole
width; a Linear subclass whose own forward is h·Wᵀ + b on a probe (IDEFICS' decoupled Linear without additional
features). Loss and every gradient against the unfused model (fp32); the forms the fused loss does not reproduce
(the scale after the softcap, logits cut to the config's vocabulary, a subclass computing something else) stay
unfused with their reason."""
from __future__ import annotations

import copy

import pytest
import torch
from torch import nn
from transformers import LlamaConfig, LlamaForCausalLM
from transformers.modeling_outputs import CausalLMOutputWithPast

import torchfuser
from torchfuser.patterns.base import Skip
from torchfuser.patterns.lm_head import LMHeadLossPattern

import vlm_sweep

VOCAB, CAP, MULT = 96, 20.0, 0.19611613513818404


def _config(**kw):
    cfg = LlamaConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2,
                      num_key_value_heads=1, vocab_size=VOCAB, tie_word_embeddings=False, **kw)
    cfg._attn_implementation = "sdpa"
    return cfg


class _Head(LlamaForCausalLM):
    """A causal LM whose forward transforms the head's output with ``transform`` before transformers' loss."""

    def forward(self, input_ids=None, attention_mask=None, labels=None, use_cache=None, **kwargs):
        h = self.model(input_ids=input_ids, attention_mask=attention_mask).last_hidden_state
        logits = self.transform(self.lm_head(h))
        loss = None if labels is None else self.loss_function(logits, labels, logits.shape[-1], **kwargs)
        return CausalLMOutputWithPast(loss=loss, logits=logits)


class ScaledSoftcapForCausalLM(_Head):  # MuSE Spark's: c·tanh(s·z/c)
    def transform(self, z):
        return torch.tanh(z * self.config.output_multiplier / self.config.final_logit_softcapping) * self.config.final_logit_softcapping


class SoftcapThenScaleForCausalLM(_Head):  # s·c·tanh(z/c): no form of the fused loss
    def transform(self, z):
        c = self.config.final_logit_softcapping
        return torch.tanh(z / c) * c * self.config.output_multiplier


class OwnSoftcapNameForCausalLM(_Head):  # RecurrentGemma's logits_soft_cap: c·tanh(z/c), c under a name of its own
    def transform(self, z):
        return torch.tanh(z / self.config.logits_soft_cap) * self.config.logits_soft_cap


class ConstantSoftcapForCausalLM(_Head):  # a softcap by a constant of the code, in no config field
    def transform(self, z):
        return torch.tanh(z / 31.0) * 31.0


class CutVocabForCausalLM(_Head):  # a padded head whose logits are cut to the config's vocabulary
    def transform(self, z):
        return z[..., : self.config.vocab_size]


def _model(cls, head_width=VOCAB, softcap=CAP):
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        model = cls(_config(final_logit_softcapping=softcap, output_multiplier=MULT)).float().train()
        if head_width != VOCAB:
            model.lm_head = nn.Linear(32, head_width, bias=False)
    return model


def _step(model, vocab=VOCAB):
    ids = torch.randint(3, vocab, (2, 9), generator=torch.Generator().manual_seed(1))
    labels = ids.clone()
    labels[0, :3] = -100  # an image's tokens
    loss = model(input_ids=ids, labels=labels).loss
    loss.backward()
    return loss.detach()


def _fused_and_exact(model, vocab=VOCAB):
    fused = torchfuser.optimize(copy.deepcopy(model), backend="reference")
    assert "lm_head_loss" in {e.pattern for e in torchfuser.report(fused).fused}, torchfuser.report(fused)
    want, got = _step(model, vocab), _step(fused, vocab)
    torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-6)
    grads = [(n, a.grad, b.grad) for (n, a), (_, b) in zip(model.named_parameters(), fused.named_parameters())]
    assert len(grads) > 5
    for n, a, b in grads:
        assert a is not None and b is not None and a.abs().max() > 0, n
        torch.testing.assert_close(b, a, rtol=1e-5, atol=1e-7, msg=n)


def test_a_scale_before_the_softcap_is_measured_and_fused_exactly():
    model = _model(ScaledSoftcapForCausalLM)
    spec = LMHeadLossPattern().match(model)
    assert not isinstance(spec, Skip), spec.reason
    assert spec.softcap == CAP and spec.logit_scale == pytest.approx(MULT, rel=1e-12)
    _fused_and_exact(model)


def test_a_scale_after_the_softcap_is_not_fused():
    spec = LMHeadLossPattern().match(_model(SoftcapThenScaleForCausalLM))
    assert isinstance(spec, Skip) and "softcap" in spec.reason


def test_a_softcap_by_a_config_value_of_another_name_is_measured_and_fused_exactly():
    model = _model(OwnSoftcapNameForCausalLM, softcap=None)
    model.config.logits_soft_cap = 30.0
    spec = LMHeadLossPattern().match(model)
    assert not isinstance(spec, Skip), spec.reason
    assert spec.softcap == 30.0 and spec.logit_scale == 1.0  # the config's value itself, not the bisection's
    _fused_and_exact(model)


def test_a_softcap_by_no_config_value_is_not_fused():
    spec = LMHeadLossPattern().match(_model(ConstantSoftcapForCausalLM, softcap=None))
    assert isinstance(spec, Skip) and "softcap by a value of its config" in spec.reason, spec


def test_a_head_narrower_than_the_config_vocabulary_is_fused_when_its_loss_uses_all_of_it():
    """Inkling 2: the head has unpadded_vocab_size outputs, fewer than vocab_size; its loss is over all of them."""
    model = _model(ScaledSoftcapForCausalLM, head_width=VOCAB - 16)
    spec = LMHeadLossPattern().match(model)
    assert not isinstance(spec, Skip), spec.reason
    _fused_and_exact(model, vocab=VOCAB - 16)


def test_logits_cut_to_the_config_vocabulary_are_not_fused():
    """A head wider than the vocabulary whose logits are cut to it: the fused loss (over the whole head) would
    differ, and the probe shows it."""
    spec = LMHeadLossPattern().match(_model(CutVocabForCausalLM, head_width=VOCAB + 16, softcap=None))
    assert isinstance(spec, Skip) and f"head has {VOCAB + 16} outputs" in spec.reason, spec


@pytest.mark.parametrize("model_type", ["muse_spark", "inkling2"])
def test_image_text_models_lm_head_fused_and_exact(model_type):
    if model_type not in vlm_sweep.model_types():
        pytest.skip(f"{model_type} is not an image-text-to-text type of this transformers")
    r = vlm_sweep.run_one(model_type)
    assert r.kind == "fused", (r.kind, r.detail)
    assert r.towers.get("text", {}).get("lm_head_loss") == 1, r.skipped.get("lm_head_loss")


class _PlainSubclass(nn.Linear):  # IDEFICS' decoupled Linear without additional features
    def forward(self, x):
        return nn.functional.linear(x, self.weight, self.bias)


class _Doubling(nn.Linear):
    def forward(self, x):
        return 2 * super().forward(x)


def test_a_linear_subclass_is_a_plain_head_only_where_its_forward_computes_h_wt_plus_b():
    from torchfuser.patterns.lm_head import _not_plain_linear

    assert _not_plain_linear(_PlainSubclass(4, 3)) == "" and _not_plain_linear(_PlainSubclass(4, 3, bias=False)) == ""
    assert "forward of its own" in _not_plain_linear(_Doubling(4, 3))
    head = nn.Linear(4, 3)
    head.forward = lambda x: 2 * x  # set on the instance (accelerate's hooks): never run by the fused loss
    assert "forward of its own" in _not_plain_linear(head)


def test_idefics_lm_head_fused_and_exact():
    if "idefics" not in vlm_sweep.model_types():
        pytest.skip("idefics is not an image-text-to-text type of this transformers")
    r = vlm_sweep.run_one("idefics")
    assert r.kind == "fused", (r.kind, r.detail)
    assert r.towers.get("text", {}).get("lm_head_loss") == 1, r.skipped.get("lm_head_loss")


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA (the Triton linear_cross_entropy kernel)")
def test_cuda_bf16_scaled_softcap_within_the_numerics_rule():
    """On a GPU (backend auto): the scale before the softcap in the fused kernel, loss and every gradient in bf16
    within twice PyTorch's own bf16 error against float64."""
    from numerics import assert_within_rule

    model = _model(ScaledSoftcapForCausalLM)
    ref = copy.deepcopy(model).double()
    want = copy.deepcopy(model).cuda().bfloat16()
    fused = torchfuser.optimize(copy.deepcopy(model).cuda().bfloat16())
    assert "lm_head_loss" in {e.pattern for e in torchfuser.report(fused).fused}
    ids = torch.randint(3, VOCAB, (2, 9), generator=torch.Generator().manual_seed(1))
    losses = [m(input_ids=ids.to(next(m.parameters()).device), labels=ids.to(next(m.parameters()).device)).loss
              for m in (ref, want, fused)]
    for loss in losses:
        loss.backward()
    assert_within_rule(losses[2].float().cpu(), losses[1].float().cpu(), losses[0].cpu(), 1e-3, "loss")
    for (n, r), (_, a), (_, b) in zip(ref.named_parameters(), want.named_parameters(), fused.named_parameters()):
        assert_within_rule(b.grad.float().cpu(), a.grad.float().cpu(), r.grad, 1e-2 * r.grad.abs().max().item(), n)
