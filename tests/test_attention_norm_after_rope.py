"""q/k norms applied after the rotary, fused by structure: HunYuan's per-head RMS norms (weighted, one for q and
one for k) and Llama 4's text ``qk_norm`` (one weightless RMS norm for both, after a complex rotary passed as
``position_embeddings``). Output, input gradient and every parameter's gradient exact against the unfused
module in fp32, on the reference backend and on the MLIR one (which runs the rope there); a norm placed
elsewhere, or a parameter-free child that is not a norm, is not fused."""
from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

from numerics import needs_mlir
from torchfuser.modules import fallbacks
from torchfuser.modules.attention import FusedAttention
from torchfuser.patterns._attention_probe import check, is_weightless_norm
from torchfuser.patterns.attention import AttentionPattern
from torchfuser.patterns.base import Skip

llama4 = pytest.importorskip("transformers.models.llama4.modeling_llama4")
hunyuan = pytest.importorskip("transformers.models.hunyuan_v1_dense.modeling_hunyuan_v1_dense")
B, S, H = 2, 7, 64


def _llama4(impl="sdpa"):
    from transformers import Llama4TextConfig

    cfg = Llama4TextConfig(hidden_size=H, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                           intermediate_size=128, intermediate_size_mlp=128, num_hidden_layers=2, vocab_size=64,
                           use_qk_norm=True, no_rope_layers=[1, 1], rms_norm_eps=1e-5)
    cfg._attn_implementation = impl
    torch.manual_seed(0)
    attn = llama4.Llama4TextAttention(cfg, 0)
    rotary = llama4.Llama4TextRotaryEmbedding(cfg)
    freqs = rotary(torch.zeros(B, S, H), torch.arange(S).expand(B, S))  # B × S × D/2, complex
    return attn, {"position_embeddings": freqs}


def _hunyuan(impl="sdpa"):
    from transformers import HunYuanDenseV1Config

    cfg = HunYuanDenseV1Config(hidden_size=H, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                               intermediate_size=128, num_hidden_layers=1, vocab_size=64)
    cfg._attn_implementation = impl
    torch.manual_seed(0)
    attn = hunyuan.HunYuanDenseV1Attention(cfg, 0)
    for norm in (attn.query_layernorm, attn.key_layernorm):  # random weights: which norm sits where shows
        nn.init.normal_(norm.weight, 1.0, 0.3)
    rotary = hunyuan.HunYuanDenseV1RotaryEmbedding(cfg)
    x = torch.zeros(B, S, H)
    return attn, {"position_embeddings": rotary(x, torch.arange(S).expand(B, S))}


MODELS = {"llama4_text": _llama4, "hunyuan": _hunyuan}


def _run(module, x, g, kwargs):
    x = x.detach().clone().requires_grad_(True)
    mask = torch.full((S, S), float("-inf"), dtype=x.dtype, device=x.device).triu(1).expand(B, 1, S, S).clone()
    mask[1, :, :, 2] = float("-inf")  # a padded key in the second row
    out = module(x, attention_mask=mask, **kwargs)[0]
    return out, torch.autograd.grad(out, [x, *module.parameters()], g)


@pytest.mark.parametrize("impl", ["sdpa", "eager"])
@pytest.mark.parametrize("name", MODELS)
def test_norm_after_rope_recognised(name, impl):
    attn, _ = MODELS[name](impl)
    spec = AttentionPattern().match(attn)
    assert not isinstance(spec, Skip), spec.reason
    assert spec.norm_after_rope and spec.norm_per_head and spec.rotary_dim == 16
    if name == "llama4_text":
        assert spec.q_norm == spec.k_norm == "qk_norm" and spec.rotary_complex == "position_embeddings"
    else:
        assert (spec.q_norm, spec.k_norm) == ("query_layernorm", "key_layernorm")
    # The probe tells the placement apart: the same spec with the norms before the rotary fails it.
    import dataclasses
    assert check(attn, dataclasses.replace(spec, norm_after_rope=False), training=False) is not None


@pytest.mark.parametrize("backend", ["reference", pytest.param("mlir", marks=needs_mlir)])
@pytest.mark.parametrize("name", MODELS)
def test_fp32_output_and_every_gradient_exact(name, backend):
    attn, kwargs = MODELS[name]()
    fused = FusedAttention(copy.deepcopy(attn), AttentionPattern().match(attn), backend)
    gen = torch.Generator().manual_seed(3)
    x, g = torch.randn(B, S, H, generator=gen), torch.randn(B, S, H, generator=gen)
    want, want_g = _run(attn, x, g, kwargs)
    got, got_g = _run(fused, x, g, kwargs)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)
    names = ["input", *(n for n, _ in attn.named_parameters())]
    assert len(got_g) == len(want_g) == len(names) >= 5
    for n, a, b in zip(names, got_g, want_g):
        assert b.abs().max() > 0, n
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-5, msg=n)
    assert not fallbacks.counts(fused)
    assert list(fused.state_dict()) == list(attn.state_dict())


class _Doubling(nn.Module):
    """Parameter-free, with an eps, but not a norm."""

    def __init__(self):
        super().__init__()
        self.variance_epsilon = 1e-6

    def forward(self, x):
        return 2 * x


def test_weightless_norm_is_checked_by_its_math():
    attn, _ = _llama4()
    assert is_weightless_norm(attn.qk_norm)
    assert not is_weightless_norm(_Doubling()) and not is_weightless_norm(nn.GELU())
    attn.qk_norm = _Doubling()
    result = AttentionPattern().match(attn)
    assert isinstance(result, Skip) and "qk_norm" in result.reason


def _mixed_forward(self, hidden_states, position_embeddings, attention_mask, **kwargs):
    """q normalised after the rotary, k before it: no single placement of both norms."""
    shape = (*hidden_states.shape[:-1], -1, self.head_dim)
    q, k, v = (getattr(self, n)(hidden_states).view(shape).transpose(1, 2) for n in ("q_proj", "k_proj", "v_proj"))
    k = self.key_layernorm(k)
    q, k = hunyuan.apply_rotary_pos_emb(q, k, *position_embeddings)
    q = self.query_layernorm(q)
    out = hunyuan.eager_attention_forward(self, q, k, v, attention_mask, scaling=self.scaling)[0]
    return self.o_proj(out.reshape(*hidden_states.shape[:-1], -1)), None


def test_mixed_placement_not_fused():
    attn, _ = _hunyuan()
    attn.__class__ = type("MixedNormAttention", (type(attn),), {"forward": _mixed_forward})
    result = AttentionPattern().match(attn)
    assert isinstance(result, Skip) and "not softmax" in result.reason, result


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA (the Triton rope kernel)")
@pytest.mark.parametrize("name", MODELS)
def test_cuda_bf16_within_the_numerics_rule(name):
    """On a GPU (backend auto: Triton's rope, SDPA): output and every gradient in bf16 within the rule."""
    from numerics import assert_within_rule

    attn, kwargs = MODELS[name]()
    spec = AttentionPattern().match(attn)
    gen = torch.Generator().manual_seed(5)
    x, g = torch.randn(B, S, H, generator=gen), torch.randn(B, S, H, generator=gen)
    ref_mod = copy.deepcopy(attn).double()
    pe = kwargs["position_embeddings"]
    complex_ = isinstance(pe, torch.Tensor)  # Llama 4's complex table, else (cos, sin)
    pe64 = pe.to(torch.complex128) if complex_ else tuple(t.double() for t in pe)
    ref, ref_g = _run(ref_mod, x.double(), g.double(), {"position_embeddings": pe64})
    pe = pe.cuda() if complex_ else tuple(t.cuda().bfloat16() for t in pe)
    cuda_kwargs = {"position_embeddings": pe}
    xb, gb = x.cuda().bfloat16(), g.cuda().bfloat16()
    want, want_g = _run(copy.deepcopy(attn).cuda().bfloat16(), xb, gb, cuda_kwargs)
    fused = FusedAttention(copy.deepcopy(attn).cuda().bfloat16(), spec)
    got, got_g = _run(fused, xb, gb, cuda_kwargs)
    assert_within_rule(got.cpu(), want.cpu(), ref, 1e-2, "output")
    for n, a, b, r in zip(["input", *(n for n, _ in attn.named_parameters())], got_g, want_g, ref_g):
        assert_within_rule(a.cpu(), b.cpu(), r, 1e-2 * r.abs().max().item(), n)
    assert not fallbacks.counts(fused)
