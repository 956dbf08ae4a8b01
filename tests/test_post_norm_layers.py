"""Post-norm decoder layers (OPT-350m's do_layer_norm_before=False): h = norm(x + attention(x)), then
out = norm(h + mlp(h)), each residual add inside the norm after it (``ResidualNormSpec.post_norm``). One
training step fused vs unfused: loss and every gradient (fp32 tight, bf16 by the numerics rule against
float64); restore; active dropout between the blocks applied from the same draws; and a CUDA run."""
from __future__ import annotations

import copy

import pytest
import torch
from transformers import AutoConfig, AutoModelForCausalLM

import torchfuser
from tiny_lm import fused_layers as layers

from numerics import assert_bf16_within_rule, assert_cuda_steps_like, assert_trains_like

VOCAB = 96
# OPT-350m's form: post-norm layers, embeddings projected in and out (word_embed_proj_dim ≠ hidden_size)
_OPT350 = dict(vocab_size=VOCAB, bos_token_id=1, eos_token_id=2, pad_token_id=0, hidden_size=32, num_hidden_layers=2,
               num_attention_heads=4, ffn_dim=64, word_embed_proj_dim=16, do_layer_norm_before=False)


def make(impl: str = "sdpa", **overrides):
    cfg = AutoConfig.for_model("opt", **{**_OPT350, "dropout": 0.0, **overrides})
    cfg._attn_implementation = impl
    torch.manual_seed(0)
    return AutoModelForCausalLM.from_config(cfg).float().train()


def step(model, device="cpu"):
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(3, VOCAB, (2, 9), generator=g).to(device)
    mask = torch.ones_like(ids)
    mask[1, -2:] = 0
    torch.manual_seed(0)
    loss = model(input_ids=ids, attention_mask=mask, labels=ids.masked_fill(mask == 0, -100)).loss
    loss.backward()
    return loss.detach()


@pytest.mark.parametrize("impl", ["sdpa", "eager"])
def test_training_step_fused_matches_unfused(impl):
    ref = make(impl)
    fused = copy.deepcopy(ref)
    keys = list(ref.state_dict())
    torchfuser.optimize(fused, backend="reference")
    found = layers(fused)
    assert len(found) == 2, str(torchfuser.report(fused))
    spec = found[0].forward.spec
    assert spec.post_norm and not spec.parallel
    assert (spec.norm_in, spec.norm_mid) == ("self_attn_layer_norm", "final_layer_norm")
    assert_trains_like(ref, fused, step, keys, loss_rtol=1e-6)
    assert not layers(fused) and list(fused.state_dict()) == keys


def test_bf16_within_the_rule():
    ref64 = make().double()
    plain = copy.deepcopy(ref64).to(torch.bfloat16)
    fused = copy.deepcopy(plain)
    torchfuser.optimize(fused, backend="reference")
    assert len(layers(fused)) == 2
    assert_bf16_within_rule(fused, plain, ref64, step)


def test_active_dropout_is_fused_with_the_same_masks():
    """OPT's functional dropout on the attention's and the MLP's output (``self.dropout``), placed by the probe:
    the fused forward applies it before each norm's add, from the same draws (the loss and every gradient)."""
    ref = make(dropout=0.1)
    fused = copy.deepcopy(ref)
    torchfuser.optimize(fused, backend="reference")
    assert [(m.forward.spec.attention_dropout, m.forward.spec.mlp_dropout) for m in layers(fused)] == [("dropout",) * 2] * 2
    assert_trains_like(ref, fused, step, list(ref.state_dict()), loss_rtol=1e-6)


def test_switched_on_dropout_runs_fused_with_the_same_masks():
    ref = make()
    fused = copy.deepcopy(ref)
    torchfuser.optimize(fused, backend="reference")
    for m in (ref, fused):
        for layer in m.model.decoder.layers:
            layer.dropout = 0.2  # after fusion: read at each call, as the original reads it
    assert_trains_like(ref, fused, step, list(ref.state_dict()), loss_rtol=1e-6)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_on_cuda_with_the_defaults():
    ref = make().cuda()
    fused = copy.deepcopy(ref)
    torchfuser.optimize(fused)
    assert len(layers(fused)) == 2, str(torchfuser.report(fused))
    assert_cuda_steps_like(ref, fused, step)
