"""Llama 4's vision attention: rotary applied by complex multiplication (``freqs_ci``) and a forward that
ignores the mask it is given, fused by structure: the table's real and imaginary parts as rotate-every-two
rope tables, the mask dropped as the module drops it. Exact against the unfused module (output, input
gradient, every parameter's gradient) in fp32, within the numerics rule in bf16, and in a whole model."""
from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

from numerics import assert_within_rule
from torchfuser.modules import fallbacks, rotary_complex
from torchfuser.modules.attention import FusedAttention
from torchfuser.patterns.attention import AttentionPattern
from torchfuser.patterns.base import Skip

llama4 = pytest.importorskip("transformers.models.llama4.modeling_llama4")


def _config(impl: str):
    from transformers import Llama4VisionConfig

    cfg = Llama4VisionConfig(hidden_size=64, num_attention_heads=4, intermediate_size=256,  # = hidden / pixel_shuffle_ratio²
                             image_size=32, patch_size=8,
                             num_hidden_layers=1, vision_output_dim=64, projector_input_dim=64, projector_output_dim=64)
    cfg._attn_implementation = impl
    return cfg


def _attention(impl: str = "sdpa", cls=None):
    cfg = _config(impl)
    torch.manual_seed(0)
    attn = (cls or llama4.Llama4VisionAttention)(cfg)
    freqs = llama4.Llama4VisionRotaryEmbedding(cfg).freqs_ci  # S × 1 × D/2, complex64
    return attn, freqs


def _reference64(attn, x, freqs):
    """The module's math in float64 / complex128 throughout (the module itself computes its rotary in fp32)."""
    a, d = attn, attn.head_dim
    q, k, v = (getattr(a, n)(x.double()).unflatten(-1, (-1, d)) for n in ("q_proj", "k_proj", "v_proj"))
    f = freqs.to(torch.complex128).reshape(1, x.shape[1], 1, d // 2)
    q, k = (torch.view_as_real(torch.view_as_complex(t.unflatten(-1, (-1, 2))) * f).flatten(3) for t in (q, k))
    out = torch.nn.functional.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2))
    return a.o_proj(out.transpose(1, 2).flatten(2))


def _grads(module, x, freqs, g, **kwargs):
    x = x.detach().clone().requires_grad_(True)
    out = module(x, freqs_ci=freqs, **kwargs)[0]
    grads = torch.autograd.grad(out, [x, *module.parameters()], g)
    return out, grads


@pytest.mark.parametrize("impl", ["sdpa", "eager"])
def test_complex_rotary_recognised_and_mask_ignored(impl):
    attn, _ = _attention(impl)
    spec = AttentionPattern().match(attn)
    assert not isinstance(spec, Skip), spec.reason
    assert spec.rotary_complex == "freqs_ci" and spec.rotary_dim == attn.head_dim
    assert (spec.rotary_interleave, spec.rotary_pair_tables) == ("half", True)
    assert spec.uses_mask is False and spec.is_causal is False


@pytest.mark.parametrize("impl", ["sdpa", "eager"])
def test_fp32_output_and_every_gradient_exact(impl):
    attn, freqs = _attention(impl)
    fused = FusedAttention(copy.deepcopy(attn), AttentionPattern().match(attn), "reference")
    x = torch.randn(2, freqs.shape[0], 64)
    g = torch.randn(2, freqs.shape[0], 64)
    # A causal mask, which the original ignores: so must the fused module.
    mask = torch.full((x.shape[1],) * 2, float("-inf")).triu(1).expand(2, 1, -1, -1)
    want, want_g = _grads(attn, x, freqs, g, attention_mask=mask)
    got, got_g = _grads(fused, x, freqs, g, attention_mask=mask)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)
    names = ["input", *(n for n, _ in attn.named_parameters())]
    assert len(got_g) == len(want_g) == 9
    for n, a, b in zip(names, got_g, want_g):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-5, msg=n)
    assert not fallbacks.counts(fused)


def test_bf16_within_the_numerics_rule():
    attn, freqs = _attention("sdpa")
    x = torch.randn(2, freqs.shape[0], 64)
    g = torch.randn(2, freqs.shape[0], 64)
    x64 = x.double().requires_grad_(True)
    ref_ref = copy.deepcopy(attn).double()  # parameters of the float64 reference, for its gradients
    ref = _reference64(ref_ref, x64, freqs)
    ref_g = torch.autograd.grad(ref, [x64, *ref_ref.parameters()], g.double())
    spec = AttentionPattern().match(attn)
    plain = copy.deepcopy(attn).bfloat16()
    fused = FusedAttention(copy.deepcopy(attn).bfloat16(), spec, "reference")
    want, want_g = _grads(plain, x.bfloat16(), freqs, g.bfloat16())
    got, got_g = _grads(fused, x.bfloat16(), freqs, g.bfloat16())
    assert_within_rule(got, want, ref, 1e-2, "output")
    names = ["input", *(n for n, _ in attn.named_parameters())]
    for n, a, b, r in zip(names, got_g, want_g, ref_g):
        assert_within_rule(a, b, r, 1e-2 * r.abs().max().item(), n)


def test_tables_are_complex_multiplication_for_any_table():
    """The identity holds for tables of any modulus, so a probe with random tables tells conventions apart."""
    b, h, s, d = 2, 3, 5, 8
    q = torch.randn(b, h, s, d, dtype=torch.float64)
    f = torch.complex(torch.randn(s, 1, d // 2, dtype=torch.float64), torch.randn(s, 1, d // 2, dtype=torch.float64))
    cos, sin = rotary_complex.tables(f, s)
    assert cos.shape == (1, s, d // 2)
    want = torch.view_as_real(torch.view_as_complex(q.unflatten(-1, (-1, 2))) * f.reshape(1, 1, s, d // 2)).flatten(3)
    evens, odds = q[..., 0::2], q[..., 1::2]
    c, sn = cos.unsqueeze(1), sin.unsqueeze(1)
    got = torch.stack([evens * c - odds * sn, evens * sn + odds * c], dim=-1).flatten(3)
    torch.testing.assert_close(got, want)


class _ConjugateRotary(llama4.Llama4VisionAttention if hasattr(llama4, "Llama4VisionAttention") else nn.Module):
    """Rotates by the conjugate table: a convention the fused attention does not have."""

    def forward(self, hidden_states, freqs_ci, attention_mask=None, **kwargs):
        return super().forward(hidden_states, freqs_ci.conj(), attention_mask, **kwargs)


class _MaskedComplex(llama4.Llama4VisionAttention if hasattr(llama4, "Llama4VisionAttention") else nn.Module):
    """Complex rotary and a forward that does apply its mask (no causal default)."""

    def forward(self, hidden_states, freqs_ci, attention_mask=None, **kwargs):
        shape = (*hidden_states.shape[:-1], -1, self.head_dim)
        q, k, v = (getattr(self, n)(hidden_states).view(shape) for n in ("q_proj", "k_proj", "v_proj"))
        q, k = llama4.vision_apply_rotary_emb(q, k, freqs_ci=freqs_ci)
        out = torch.nn.functional.scaled_dot_product_attention(
            q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), attn_mask=attention_mask, scale=self.scaling)
        return self.o_proj(out.transpose(1, 2).reshape(*hidden_states.shape[:-1], -1)), None


def test_other_complex_convention_is_not_fused():
    attn, _ = _attention("sdpa", _ConjugateRotary)
    skip = AttentionPattern().match(attn)
    assert isinstance(skip, Skip) and "freqs_ci" in skip.reason, skip


def test_complex_rotary_that_applies_its_mask_keeps_the_mask():
    attn, freqs = _attention("sdpa", _MaskedComplex)
    spec = AttentionPattern().match(attn)
    assert not isinstance(spec, Skip), spec.reason
    assert spec.rotary_complex == "freqs_ci" and spec.uses_mask
    fused = FusedAttention(copy.deepcopy(attn), spec, "reference")
    x = torch.randn(2, freqs.shape[0], 64)
    mask = torch.zeros(2, 1, x.shape[1], x.shape[1])
    mask[1, :, :, :3] = float("-inf")  # padding in the second row
    with torch.no_grad():
        torch.testing.assert_close(fused(x, freqs_ci=freqs, attention_mask=mask)[0],
                                   attn(x, freqs_ci=freqs, attention_mask=mask)[0], rtol=1e-5, atol=1e-6)


def test_a_real_table_runs_the_original_and_is_counted():
    attn, freqs = _attention("sdpa")
    fused = FusedAttention(copy.deepcopy(attn), AttentionPattern().match(attn), "reference")
    x = torch.randn(1, freqs.shape[0], 64)
    with pytest.raises(Exception):  # the original cannot take it either: an error, never a finite wrong number
        fused(x, freqs_ci=torch.view_as_real(freqs))
    reasons = [why for per_module in fallbacks.counts(fused).values() for why in per_module]
    assert any("not a complex tensor" in why for why in reasons), reasons


def test_whole_llama4_model_both_towers_exact():
    """One fp32 training step of a tiny Llama 4 (vision tower included), unfused against fused: loss and every
    gradient (vlm_sweep's check); both vision attentions fused."""
    import vlm_sweep

    r = vlm_sweep.run_one("llama4")
    if r.kind == "unbuildable":  # the sweep's inputs for this transformers (5.17 asks get_image_features for more)
        pytest.skip(r.detail)
    assert r.kind == "fused", (r.kind, r.detail)
    assert r.towers["vision"].get("attention") == 2, (r.towers, r.skipped.get("attention"))


def test_vision_tower_exact_loss_and_every_gradient():
    """Llama 4's whole vision tower (patch embedding, rotary table, encoder, adapter), unfused against fused:
    output and every parameter's gradient, fp32."""
    import torchfuser

    cfg = _config("sdpa")
    torch.manual_seed(0)
    ref = llama4.Llama4VisionModel(cfg).float()
    fused = copy.deepcopy(ref)
    torchfuser.optimize(fused, backend="reference")
    assert sum(isinstance(m, FusedAttention) for m in fused.modules()) == cfg.num_hidden_layers, torchfuser.report(fused)
    pixels = torch.randn(2, 3, 32, 32, generator=torch.Generator().manual_seed(1))
    outs = [m(pixels).last_hidden_state for m in (ref, fused)]
    torch.testing.assert_close(outs[1], outs[0], rtol=1e-5, atol=1e-6)
    w = torch.randn_like(outs[0])
    for o in outs:
        (o * w).sum().backward()
    for (n, a), b in zip(ref.named_parameters(), fused.parameters()):
        assert a.grad is not None and b.grad is not None, n
        torch.testing.assert_close(b.grad, a.grad, rtol=1e-4, atol=1e-5, msg=n)
    torchfuser.restore(fused)
    assert not any(isinstance(m, FusedAttention) for m in fused.modules())


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA (the Triton rope kernel)")
def test_cuda_bf16_within_the_numerics_rule():
    """On a GPU (backend auto: Triton's rope, SDPA's kernels): output and every gradient in bf16 within the rule."""
    attn, freqs = _attention("sdpa")
    spec = AttentionPattern().match(attn)
    x, g = torch.randn(2, freqs.shape[0], 64), torch.randn(2, freqs.shape[0], 64)
    x64 = x.double().requires_grad_(True)
    ref_mod = copy.deepcopy(attn).double()
    ref = _reference64(ref_mod, x64, freqs)
    ref_g = torch.autograd.grad(ref, [x64, *ref_mod.parameters()], g.double())
    plain = copy.deepcopy(attn).cuda().bfloat16()
    fused = FusedAttention(copy.deepcopy(attn).cuda().bfloat16(), spec)
    xb, gb, fb = x.cuda().bfloat16(), g.cuda().bfloat16(), freqs.cuda()
    want, want_g = _grads(plain, xb, fb, gb)
    got, got_g = _grads(fused, xb, fb, gb)
    assert_within_rule(got.cpu(), want.cpu(), ref, 1e-2, "output")
    names = ["input", *(n for n, _ in attn.named_parameters())]
    for n, a, b, r in zip(names, got_g, want_g, ref_g):
        assert_within_rule(a.cpu(), b.cpu(), r, 1e-2 * r.abs().max().item(), n)
    assert not fallbacks.counts(fused)
