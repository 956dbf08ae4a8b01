"""ALiBi attention fused (modules/attention_bias.py): the position bias a model passes its attention
(BLOOM's ``alibi``, MPT's ``position_bias``; Falcon's in transformers 5.17) goes into SDPA's additive
mask, in the layout and at the place the probe found; BLOOM's attention also adds the residual it is
given. One training step fused vs unfused on the reference backend, with padding: loss and every
gradient in fp32; dropout on (same draws on the CPU); bf16 by the numerics rule; calls the fused
attention cannot reproduce run the original, counted."""
from __future__ import annotations

import copy

import pytest
import torch
from transformers import AutoConfig, AutoModelForCausalLM

import torchfuser
from torchfuser import switches
from torchfuser.modules import fallbacks
from torchfuser.modules.attention import FusedAttention

from numerics import assert_within_rule

VOCAB = 96
_COMMON = dict(vocab_size=VOCAB, bos_token_id=1, eos_token_id=2, pad_token_id=0)
CONFIGS = {
    "bloom": ("bloom", dict(hidden_size=32, n_layer=2, n_head=4, hidden_dropout=0.0, attention_dropout=0.0)),
    # 6 heads: BLOOM's and MPT's slopes for a head count that is no power of two
    "bloom-6": ("bloom", dict(hidden_size=48, n_layer=2, n_head=6, hidden_dropout=0.0, attention_dropout=0.0)),
    "mpt": ("mpt", dict(d_model=32, n_layers=2, n_heads=4, expansion_ratio=2, max_seq_len=32)),
    "mpt-6": ("mpt", dict(d_model=48, n_layers=2, n_heads=6, expansion_ratio=2, max_seq_len=32)),
    "falcon-alibi": ("falcon", dict(hidden_size=32, num_hidden_layers=2, num_attention_heads=4, ffn_hidden_size=64,
                                    alibi=True, hidden_dropout=0.0, attention_dropout=0.0)),
}
CONFIGS["falcon-alibi-sdpa"] = CONFIGS["falcon-alibi"]  # 5.17: alibi switches the rotary off, the bias is in the mask
IMPL = {"falcon-alibi-sdpa": "sdpa"}


def make(name: str, impl: str = "eager", **overrides):
    model_type, extra = CONFIGS[name]
    cfg = AutoConfig.for_model(model_type, **{**_COMMON, **extra, **overrides})
    cfg._attn_implementation = impl
    torch.manual_seed(0)
    return AutoModelForCausalLM.from_config(cfg).float().train()


def with_mpt_dropout(model, p: float):
    """MPT's config types attn_pdrop as an int in some transformers versions: set the modules' p instead."""
    for block in model.transformer.blocks:
        block.attn.attn_dropout_p = block.ffn.hidden_dropout = block.resid_attn_dropout.p = p
    return model


def batch(left: bool = True):
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(3, VOCAB, (2, 9), generator=g)
    mask = torch.ones_like(ids)
    # Left padding: the bias counts positions from the first real token (BLOOM), and the padded queries
    # see no key at all. Right padding where the float64 reference cannot take that (BLOOM's float32
    # softmax turns float64's minimum into -inf: NaN rows).
    mask[1, :2] = 0 if left else 1
    mask[1, -2:] = 1 if left else 0
    return ids, mask


def step(model, left: bool = True):
    ids, mask = batch(left)
    torch.manual_seed(0)
    loss = model(input_ids=ids, attention_mask=mask, labels=ids.masked_fill(mask == 0, -100)).loss
    loss.backward()
    return loss.detach()


def attentions(model):
    return [m for m in model.modules() if isinstance(m, FusedAttention)]


def assert_step_matches(ref, fused, rtol=1e-5, atol=1e-6):
    loss_ref, loss = step(ref), step(fused)
    torch.testing.assert_close(loss, loss_ref, rtol=rtol, atol=atol)
    for (n, a), (_, b) in zip(ref.named_parameters(), fused.named_parameters()):
        assert (a.grad is None) == (b.grad is None), n
        if a.grad is not None:
            torch.testing.assert_close(b.grad, a.grad, rtol=rtol, atol=atol, msg=n)


@pytest.mark.parametrize("name", list(CONFIGS))
def test_training_step_fused_matches_unfused(name):
    ref = make(name, IMPL.get(name, "eager"))
    fused = copy.deepcopy(ref)
    keys = list(ref.state_dict())
    torchfuser.optimize(fused, backend="reference")
    found = attentions(fused)
    assert len(found) == 2, str(torchfuser.report(fused))
    if not name.startswith("falcon") or found[0].spec.bias is not None:  # 5.25's Falcon passes its alibi in the mask
        assert found[0].spec.bias is not None, found[0].spec
        assert (found[0].spec.bias_mode == "ignore") == (name == "falcon-alibi-sdpa"), found[0].spec
    assert list(fused.state_dict()) == keys
    assert_step_matches(ref, fused)
    assert not fallbacks.counts(fused), fallbacks.counts(fused)  # every call ran fused
    torchfuser.restore(fused)
    assert not attentions(fused) and list(fused.state_dict()) == keys


def test_bloom_places_bias_and_residual_as_found():
    spec = attentions(torchfuser.optimize(make("bloom"), backend="reference"))[0].spec
    assert (spec.bias, spec.bias_batched, spec.bias_mode, spec.residual) == ("alibi", True, "add", "residual")
    assert (spec.dropout, spec.out_dropout) == ("attention_dropout", "hidden_dropout")
    spec = attentions(torchfuser.optimize(make("mpt"), backend="reference"))[0].spec
    assert (spec.bias, spec.bias_batched, spec.mask_fill) == ("position_bias", False, True)


@pytest.mark.parametrize("name", ["bloom", "mpt"])
def test_dropout_on_draws_as_the_original_on_the_cpu(name):
    """Attention-prob and output dropout in training: SDPA's math kernel draws its mask as the module's own
    dropout does, from the same seed (CPU); on GPUs the draws differ, the distribution does not."""
    ref = make("bloom", hidden_dropout=0.2, attention_dropout=0.3) if name == "bloom" else with_mpt_dropout(make("mpt"), 0.3)
    fused = copy.deepcopy(ref)
    torchfuser.optimize(fused, backend="reference")
    assert len(attentions(fused)) == 2, str(torchfuser.report(fused))
    assert_step_matches(ref, fused)


@pytest.mark.parametrize("name", ["bloom", "mpt"])
def test_bf16_within_the_rule(name):
    ref64 = make(name).double()
    plain = copy.deepcopy(ref64).to(torch.bfloat16)
    fused = copy.deepcopy(plain)
    torchfuser.optimize(fused, backend="reference")
    assert len(attentions(fused)) == 2
    losses = [step(m, left=False) for m in (fused, plain, ref64)]
    assert_within_rule(losses[0].reshape(1), losses[1].reshape(1), losses[2].reshape(1), 1e-2, "loss")
    for (n, f), (_, p), (_, r) in zip(fused.named_parameters(), plain.named_parameters(), ref64.named_parameters()):
        assert_within_rule(f.grad, p.grad, r.grad, 1e-2 * max(1.0, r.grad.abs().max().item()), n)


def test_calls_it_cannot_reproduce_run_the_original():
    model = make("bloom")
    torchfuser.optimize(model, backend="reference")
    attn = model.transformer.h[0].self_attention
    original = attn.__dict__["_original"]
    x, res, mask = torch.randn(1, 3, 32), torch.randn(1, 3, 32), torch.zeros(1, 1, 3, 3)
    alibi = torch.randn(4, 1, 3)
    # (three positions under no_grad: a decode step, which runs the original anyway; the fused path's own checks here)
    with torch.no_grad(), switches.switched(decode_to_original=False):
        got = attn(x, res, alibi=alibi, attention_mask=mask)[0]
        torch.testing.assert_close(got, original(x, res, alibi=alibi, attention_mask=mask)[0], rtol=1e-5, atol=1e-6)
        assert not fallbacks.counts(model)
        # a bias for another head count: not the layout it was fused with → the original (which fails too)
        with pytest.raises(RuntimeError):
            attn(x, res, alibi=torch.randn(3, 1, 3), attention_mask=mask)
        assert "position bias 'alibi' of shape (3, 1, 3)" in str(fallbacks.counts(model))
        # a bias as wide as no key count: a clear error, never a guess
        with pytest.raises(ValueError, match="5 keys wide for 3 keys"):
            attn(x, res, alibi=torch.randn(4, 1, 5), attention_mask=mask)


def test_clamped_qkv_is_left_unfused():
    model = make("mpt")
    model.config.attn_config.clip_qkv = 6.0
    for block in model.transformer.blocks:
        block.attn.clip_qkv = 6.0
    torchfuser.optimize(model, backend="reference")
    assert not attentions(model)
    reasons = [e.reason for e in torchfuser.report(model).skipped if e.pattern == "attention"]
    assert reasons and all("clip_qkv" in r for r in reasons), reasons


def test_falcon_517_alibi_runs_the_original_under_another_implementation():
    """transformers 5.17's Falcon adds its alibi by implementation (eager: scaled with the scores; sdpa: in the
    mask): fused under one, a call under the other runs the original, counted."""
    ref = make("falcon-alibi", "eager")
    fused = copy.deepcopy(ref)
    torchfuser.optimize(fused, backend="reference")
    if attentions(fused)[0].spec.bias is None:
        pytest.skip("this transformers' Falcon passes its alibi in the mask (5.25): no implementation-dependent path")
    for m in (ref, fused):
        m.config._attn_implementation = "sdpa"
    assert_step_matches(ref, fused)
    assert "not the 'eager' it was fused under" in str(fallbacks.counts(fused))
