"""Vision attention with decomposed relative positions (GOT-OCR2's SAM-style ViT), fused by structure as SDPA
with the position terms as its additive mask: output, input gradient and every parameter's gradient (the
position tables' included) exact against the unfused module in fp32, within the numerics rule in bf16
against float64; the tables' axes and q/k/v order found by the probe; a module whose position terms are
not the decomposed ones is not fused; a request for the attention weights runs the original."""
from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

from numerics import assert_within_rule
from torchfuser.modules import fallbacks
from torchfuser.modules.rel_pos_attention import FusedRelPosAttention, rel_table
from torchfuser.patterns import PATTERNS
from torchfuser.patterns.base import Skip
from torchfuser.patterns.rel_pos_attention import RelPosAttentionPattern

got = pytest.importorskip("transformers.models.got_ocr2.modeling_got_ocr2")
C = 32


def _attention(window: int = 4, seed: int = 0):
    from transformers.models.got_ocr2.configuration_got_ocr2 import GotOcr2VisionConfig

    cfg = GotOcr2VisionConfig(hidden_size=C, num_attention_heads=4, image_size=48, patch_size=8, window_size=window)
    torch.manual_seed(seed)
    attn = got.GotOcr2VisionAttention(cfg, window)
    for table in (attn.rel_pos_h, attn.rel_pos_w):  # the model starts them at zero: random, so that they show
        nn.init.normal_(table, std=0.5)
    return attn


def _grads(module, x, g, **kwargs):
    x = x.detach().clone().requires_grad_(True)
    out = module(x, **kwargs)[0]
    return out, torch.autograd.grad(out, [x, *module.parameters()], g)


def test_recognised_with_its_axes_and_order():
    attn = _attention()
    spec = RelPosAttentionPattern().match(attn)
    assert not isinstance(spec, Skip), spec.reason
    assert (spec.qkv, spec.out, spec.table_h, spec.table_w) == ("qkv", "proj", "rel_pos_h", "rel_pos_w")
    assert (spec.num_heads, spec.head_dim, spec.qkv_order) == (4, 8, ("q", "k", "v"))
    assert list(PATTERNS).index("rel_pos_attention") < list(PATTERNS).index("attention")


# A window at the tables' own size (4 × 4) and maps the tables are resized for (global layers, other sizes).
@pytest.mark.parametrize("shape", [(2, 4, 4), (2, 3, 5), (1, 6, 6)])
def test_fp32_output_and_every_gradient_exact(shape):
    attn = _attention()
    fused = FusedRelPosAttention(copy.deepcopy(attn), RelPosAttentionPattern().match(attn), "reference")
    gen = torch.Generator().manual_seed(1)
    x, g = torch.randn(*shape, C, generator=gen), torch.randn(*shape, C, generator=gen)
    want, want_g = _grads(attn, x, g)
    got_, got_g = _grads(fused, x, g)
    torch.testing.assert_close(got_, want, rtol=1e-5, atol=1e-6)
    names = ["input", *(n for n, _ in attn.named_parameters())]
    assert {"rel_pos_h", "rel_pos_w"} <= set(names) and len(got_g) == len(want_g) == len(names)
    for n, a, b in zip(names, got_g, want_g):
        assert b.abs().max() > 0, n
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-5, msg=n)
    assert not fallbacks.counts(fused)
    assert list(fused.state_dict()) == list(attn.state_dict())


def test_bf16_within_the_numerics_rule():
    attn = _attention()
    spec = RelPosAttentionPattern().match(attn)
    gen = torch.Generator().manual_seed(2)
    x, g = torch.randn(2, 4, 5, C, generator=gen), torch.randn(2, 4, 5, C, generator=gen)
    ref_mod = copy.deepcopy(attn).double()
    ref, ref_g = _grads(ref_mod, x.double(), g.double())
    want, want_g = _grads(copy.deepcopy(attn).bfloat16(), x.bfloat16(), g.bfloat16())
    got_, got_g = _grads(FusedRelPosAttention(copy.deepcopy(attn).bfloat16(), spec, "reference"), x.bfloat16(), g.bfloat16())
    assert_within_rule(got_, want, ref, 1e-2, "output")
    for n, a, b, r in zip(["input", *(n for n, _ in attn.named_parameters())], got_g, want_g, ref_g):
        assert_within_rule(a, b, r, 1e-2 * r.abs().max().item(), n)


def test_table_at_its_own_size_is_used_as_it_is():
    t = torch.randn(7, 3, dtype=torch.float64)
    rows = rel_table(t, 4)
    assert rows.shape == (4, 4, 3)
    assert torch.equal(rows[0, 0], t[3]) and torch.equal(rows[3, 0], t[6]) and torch.equal(rows[0, 3], t[0])


class _HeightOnly(got.GotOcr2VisionAttention):
    """Adds the height term alone: not the decomposed relative positions the fused module adds."""

    def get_decomposed_rel_pos(self, query, rel_pos_h, rel_pos_w, q_size, k_size):
        return super().get_decomposed_rel_pos(query, rel_pos_h, rel_pos_w * 0, q_size, k_size)


def test_other_position_terms_not_fused():
    attn = _attention()
    attn.__class__ = _HeightOnly
    result = RelPosAttentionPattern().match(attn)
    assert isinstance(result, Skip) and "not softmax" in result.reason, result


def test_attention_weights_asked_for_run_the_original():
    attn = _attention()
    fused = FusedRelPosAttention(copy.deepcopy(attn), RelPosAttentionPattern().match(attn), "reference")
    x = torch.randn(1, 4, 4, C)
    out, weights = fused(x, output_attentions=True)
    assert weights is not None and fallbacks.counts(fused)
    torch.testing.assert_close(out, attn(x)[0])


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA (SDPA's kernels with a mask that requires grad)")
def test_cuda_bf16_within_the_numerics_rule():
    """On a GPU: SDPA's own kernel with the position terms as a differentiable mask; every gradient in bf16
    within the rule against float64."""
    attn = _attention()
    spec = RelPosAttentionPattern().match(attn)
    gen = torch.Generator().manual_seed(4)
    x, g = torch.randn(2, 4, 4, C, generator=gen), torch.randn(2, 4, 4, C, generator=gen)
    ref_mod = copy.deepcopy(attn).double()
    ref, ref_g = _grads(ref_mod, x.double(), g.double())
    xb, gb = x.cuda().bfloat16(), g.cuda().bfloat16()
    want, want_g = _grads(copy.deepcopy(attn).cuda().bfloat16(), xb, gb)
    fused = FusedRelPosAttention(copy.deepcopy(attn).cuda().bfloat16(), spec)
    got_, got_g = _grads(fused, xb, gb)
    assert_within_rule(got_.cpu(), want.cpu(), ref, 1e-2, "output")
    for n, a, b, r in zip(["input", *(n for n, _ in attn.named_parameters())], got_g, want_g, ref_g):
        assert_within_rule(a.cpu(), b.cpu(), r, 1e-2 * r.abs().max().item(), n)
    assert not fallbacks.counts(fused)
