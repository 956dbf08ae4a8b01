"""Vision attention that reads its head width from its input's width and computes its attention itself (BLIP's:
a Dropout child called on the probabilities whatever the attention implementation) or passes a mask of its own
on (BLIP-2's, InstructBLIP's: ``attention_mask=None``), fused by structure. Output, input gradient and every
parameter's gradient exact against the unfused module in fp32; a Dropout child of p = 0 left out of the fused
forward runs the original once its p is raised."""
from __future__ import annotations

import copy

import pytest
import torch

from torchfuser.modules import fallbacks
from torchfuser.modules.attention import FusedAttention
from torchfuser.patterns.attention import AttentionPattern
from torchfuser.patterns.base import Skip

blip = pytest.importorskip("transformers.models.blip.modeling_blip")
blip2 = pytest.importorskip("transformers.models.blip_2.modeling_blip_2")
B, S, H = 2, 9, 64


def _blip(impl="sdpa"):
    from transformers import BlipVisionConfig

    cfg = BlipVisionConfig(hidden_size=H, num_attention_heads=4, intermediate_size=128, num_hidden_layers=1)
    cfg._attn_implementation = impl
    torch.manual_seed(0)
    return blip.BlipAttention(cfg)


def _blip2(impl="sdpa"):
    from transformers import Blip2VisionConfig

    cfg = Blip2VisionConfig(hidden_size=H, num_attention_heads=4, intermediate_size=128, num_hidden_layers=1,
                            qkv_bias=True)
    cfg._attn_implementation = impl
    torch.manual_seed(0)
    attn = blip2.Blip2Attention(cfg)
    with torch.no_grad():  # q and v biases of their own (zeros at init): a wrong split shows
        attn.qkv.bias.normal_()
    return attn


MODELS = {"blip": _blip, "blip2": _blip2}


def _run(module, x, g, **kwargs):
    x = x.detach().clone().requires_grad_(True)
    out = module(x, **kwargs)[0]
    return out, torch.autograd.grad(out, [x, *module.parameters()], g)


@pytest.mark.parametrize("impl", ["sdpa", "eager"])
@pytest.mark.parametrize("name", MODELS)
def test_recognised(name, impl):
    attn = MODELS[name](impl)
    spec = AttentionPattern().match(attn)
    assert not isinstance(spec, Skip), spec.reason
    assert spec.layout == "concat" and spec.qkv == ("qkv",) and spec.out == "projection"
    assert not spec.uses_mask and not spec.is_causal and spec.head_dim == 16
    assert spec.idle_dropouts == (("dropout",) if name == "blip" else ())


@pytest.mark.parametrize("name", MODELS)
def test_fp32_output_and_every_gradient_exact(name):
    attn = MODELS[name]()
    fused = FusedAttention(copy.deepcopy(attn), AttentionPattern().match(attn), "reference").train()
    attn.train()
    gen = torch.Generator().manual_seed(3)
    x, g = torch.randn(B, S, H, generator=gen), torch.randn(B, S, H, generator=gen)
    want, want_g = _run(attn, x, g)
    got, got_g = _run(fused, x, g)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)
    names = ["input", *(n for n, _ in attn.named_parameters())]
    assert len(got_g) == len(want_g) == len(names) == 5
    for n, a, b in zip(names, got_g, want_g):
        assert b.abs().max() > 0, n
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-5, msg=n)
    assert not fallbacks.counts(fused)
    assert list(fused.state_dict()) == list(attn.state_dict())


def test_mask_given_is_ignored_as_the_module_ignores_it():
    """The encoder layer may pass a mask on; neither module applies it, so neither does the fused one."""
    attn = _blip()
    fused = FusedAttention(copy.deepcopy(attn), AttentionPattern().match(attn), "reference")
    x = torch.randn(B, S, H, generator=torch.Generator().manual_seed(4))
    mask = torch.zeros(B, 1, S, S)
    mask[..., 0] = float("-inf")
    torch.testing.assert_close(fused(x, attention_mask=mask)[0], attn(x, attention_mask=mask)[0], rtol=1e-5, atol=1e-6)


def test_raised_dropout_runs_the_original():
    """A Dropout child of p = 0 is left out of the fused forward; raised later, the original runs (counted)."""
    attn = _blip()
    fused = FusedAttention(attn, AttentionPattern().match(attn), "reference").train()
    x = torch.randn(B, S, H, generator=torch.Generator().manual_seed(4))
    fused(x)
    assert not fallbacks.counts(fused)
    attn.dropout.p = 0.5
    torch.manual_seed(0)
    got = fused(x)[0]
    torch.manual_seed(0)
    want = type(attn).forward(attn, x)[0]
    torch.testing.assert_close(got, want)
    assert any("dropout p > 0" in why for why in fallbacks.counts(fused)[""]), fallbacks.counts(fused)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("name", MODELS)
def test_cuda_bf16_within_the_numerics_rule(name):
    """On a GPU (backend auto, SDPA): output and every gradient in bf16 within the rule against float64."""
    from numerics import assert_within_rule

    attn = MODELS[name]().train()
    spec = AttentionPattern().match(attn)
    gen = torch.Generator().manual_seed(5)
    x, g = torch.randn(B, S, H, generator=gen), torch.randn(B, S, H, generator=gen)
    ref, ref_g = _run(copy.deepcopy(attn).cuda().double(), x.cuda().double(), g.cuda().double())
    xb, gb = x.cuda().bfloat16(), g.cuda().bfloat16()
    want, want_g = _run(copy.deepcopy(attn).cuda().bfloat16(), xb, gb)
    fused = FusedAttention(copy.deepcopy(attn).cuda().bfloat16(), spec).train()
    got, got_g = _run(fused, xb, gb)
    assert_within_rule(got.double(), want.double(), ref, 1e-2, "output")
    for n, a, b, r in zip(["input", *(n for n, _ in attn.named_parameters())], got_g, want_g, ref_g):
        assert_within_rule(a.double(), b.double(), r, 1e-2 * r.abs().max().item(), n)
    assert not fallbacks.counts(fused)
