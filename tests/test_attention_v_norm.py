"""Attention with a norm of v (Gemma 4's weightless RMS ``v_norm`` beside weighted q/k norms), with k and v handed
on to later layers through a dict argument (Gemma 4's ``shared_kv_states``), and with weightless q/k norms after
a sign-flipped rotate-half rotary (NanoChat's), fused by structure. Output, input gradient, every parameter's
gradient and what is written into the dict exact against the unfused module in fp32; a v norm in another place,
a layer that reads its k and v from the dict, or a rotary of the usual sign are told apart by the probe."""
from __future__ import annotations

import copy
import dataclasses

import pytest
import torch
from torch import nn

from numerics import needs_mlir
from torchfuser.modules import fallbacks
from torchfuser.modules.attention import FusedAttention
from torchfuser.patterns._attention_probe import check
from torchfuser.patterns.attention import AttentionPattern
from torchfuser.patterns.base import Skip

gemma4 = pytest.importorskip("transformers.models.gemma4.modeling_gemma4")
nanochat = pytest.importorskip("transformers.models.nanochat.modeling_nanochat")
B, S, H = 2, 7, 64


def _gemma4_config(impl="sdpa", **kw):
    from transformers import Gemma4TextConfig

    cfg = Gemma4TextConfig(hidden_size=H, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                           global_head_dim=32, num_hidden_layers=4, vocab_size=64, intermediate_size=128,
                           layer_types=["sliding_attention", "full_attention"] * 2, **kw)
    cfg._attn_implementation = impl
    return cfg


def _rotary(module, cfg, layer_type):
    """(cos, sin) for ``module``'s head width, from the model's own rotary embedding."""
    rotary = gemma4.Gemma4TextRotaryEmbedding(cfg)
    return rotary(torch.zeros(B, S, H), torch.arange(S).expand(B, S), layer_type)


def _gemma4(layer=0, impl="sdpa", **kw):
    cfg = _gemma4_config(impl, **kw)
    torch.manual_seed(0)
    attn = gemma4.Gemma4TextAttention(cfg, layer)
    for norm in (attn.q_norm, getattr(attn, "k_norm", attn.q_norm)):  # random weights: which norm sits where shows
        nn.init.normal_(norm.weight, 1.0, 0.3)
    return attn, {"position_embeddings": _rotary(attn, cfg, attn.layer_type), "shared_kv_states": {}}


def _nanochat(impl="sdpa"):
    from transformers import NanoChatConfig

    cfg = NanoChatConfig(hidden_size=H, num_attention_heads=4, num_key_value_heads=2, num_hidden_layers=1,
                         vocab_size=64, intermediate_size=128)
    cfg._attn_implementation = impl
    torch.manual_seed(0)
    attn = nanochat.NanoChatAttention(cfg, 0)
    rotary = nanochat.NanoChatRotaryEmbedding(cfg)
    return attn, {"position_embeddings": rotary(torch.zeros(B, S, H), torch.arange(S).expand(B, S))}


# Gemma 4's layers 0 and 1 hand nothing on; 2 and 3, the last of each type, store their k and v.
MODELS = {"gemma4_sliding": lambda impl="sdpa": _gemma4(0, impl), "gemma4_full": lambda impl="sdpa": _gemma4(1, impl),
          "gemma4_sliding_stores": lambda impl="sdpa": _gemma4(2, impl),
          "gemma4_full_stores": lambda impl="sdpa": _gemma4(3, impl), "nanochat": _nanochat}


def _run(module, x, g, kwargs):
    x = x.detach().clone().requires_grad_(True)
    mask = torch.full((S, S), float("-inf"), device=x.device, dtype=x.dtype).triu(1).expand(B, 1, S, S).clone()
    mask[1, :, :, 2] = float("-inf")  # a padded key in the second row
    kwargs = {k: {} if isinstance(v, dict) else v for k, v in kwargs.items()}
    out = module(x, attention_mask=mask, **kwargs)[0]
    written = kwargs.get("shared_kv_states", {})
    stored = [t for key in sorted(written) for t in written[key]]
    # k and v handed on count in the backward too: a later layer attends over them
    loss = (out * g).sum() + sum((t * t.detach().cos()).sum() for t in stored)
    return out, written, torch.autograd.grad(loss, [x, *module.parameters()])


@pytest.mark.parametrize("impl", ["sdpa", "eager"])
@pytest.mark.parametrize("name", MODELS)
def test_recognised(name, impl):
    attn, _ = MODELS[name](impl)
    spec = AttentionPattern().match(attn)
    assert not isinstance(spec, Skip), spec.reason
    if name.startswith("gemma4"):
        assert (spec.q_norm, spec.k_norm, spec.v_norm) == ("q_norm", "k_norm", "v_norm") and spec.v_norm_per_head
        stores = name.endswith("stores")
        assert attn.store_full_length_kv is stores
        assert spec.kv_out == (("shared_kv_states", attn.layer_type) if stores else None) and not spec.norm_after_rope
        # The probe sees the v norm: the same spec without it fails
        assert check(attn, dataclasses.replace(spec, v_norm=None), training=False) is not None
    else:
        assert spec.norm_after_rope and spec.rotary_sin_negated and spec.q_norm == "q_norm" and spec.v_norm is None
        assert check(attn, dataclasses.replace(spec, rotary_sin_negated=False), training=False) is not None


@pytest.mark.parametrize("backend", ["reference", pytest.param("mlir", marks=needs_mlir)])
@pytest.mark.parametrize("name", MODELS)
def test_fp32_output_every_gradient_and_handed_on_kv_exact(name, backend):
    attn, kwargs = MODELS[name]()
    fused = FusedAttention(copy.deepcopy(attn), AttentionPattern().match(attn), backend)
    gen = torch.Generator().manual_seed(3)
    x, g = torch.randn(B, S, H, generator=gen), torch.randn(B, S, H, generator=gen)
    want, want_kv, want_g = _run(attn, x, g, kwargs)
    got, got_kv, got_g = _run(fused, x, g, kwargs)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)
    assert got_kv.keys() == want_kv.keys() and (bool(want_kv) is name.endswith("stores"))
    for key in want_kv:
        for a, b in zip(got_kv[key], want_kv[key]):
            torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)
    names = ["input", *(n for n, _ in attn.named_parameters())]
    assert len(got_g) == len(want_g) == len(names) >= 5
    for n, a, b in zip(names, got_g, want_g):
        assert b.abs().max() > 0, n
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-5, msg=n)
    assert not fallbacks.counts(fused)
    assert list(fused.state_dict()) == list(attn.state_dict())


def test_layer_that_reads_handed_on_kv_not_fused():
    """A layer sharing an earlier layer's k and v (kv sharing's "reuse") has no k/v projections of its own."""
    attn, _ = _gemma4(3, num_kv_shared_layers=2)
    assert attn.is_kv_shared_layer
    assert isinstance(AttentionPattern().match(attn), Skip)


def _v_norm_after(self, hidden_states, position_embeddings, attention_mask, shared_kv_states, **kwargs):
    """The v norm on the attention's output instead of on v: not the fused attention's math."""
    shape = (*hidden_states.shape[:-1], -1, self.head_dim)
    q, k, v = (getattr(self, n)(hidden_states).view(shape) for n in ("q_proj", "k_proj", "v_proj"))
    q, k = self.q_norm(q), self.k_norm(k)
    q, k = (gemma4.apply_rotary_pos_emb(t, *position_embeddings, unsqueeze_dim=2).transpose(1, 2) for t in (q, k))
    out = gemma4.eager_attention_forward(self, q, k, v.transpose(1, 2), attention_mask, scaling=self.scaling)[0]
    out = self.v_norm(out)
    return self.o_proj(out.reshape(*hidden_states.shape[:-1], -1)), None


def test_v_norm_elsewhere_not_fused():
    attn, _ = _gemma4(0)
    attn.__class__ = type("VNormAfterAttention", (type(attn),), {"forward": _v_norm_after})
    result = AttentionPattern().match(attn)
    assert isinstance(result, Skip), result


def test_model_step_exact():
    """Gemma 4's text model (sliding and full layers, weighted q/k norms, a weightless v norm, k and v handed
    on): one training step fused against unfused, loss and every gradient."""
    import arch_sweep

    r = arch_sweep.run_one("gemma4_text")
    assert r.kind == "fused", (r.kind, r.detail)
    assert r.fused.get("attention") == 2, (r.fused, r.skipped.get("attention"))


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA (the Triton rope kernel)")
@pytest.mark.parametrize("name", MODELS)
def test_cuda_bf16_within_the_numerics_rule(name):
    """On a GPU (backend auto: Triton's rope, SDPA): output and every gradient in bf16 within the rule."""
    from numerics import assert_within_rule

    attn, kwargs = MODELS[name]()
    spec = AttentionPattern().match(attn)
    gen = torch.Generator().manual_seed(5)
    x, g = torch.randn(B, S, H, generator=gen), torch.randn(B, S, H, generator=gen)
    pe = kwargs["position_embeddings"]
    ref, _, ref_g = _run(copy.deepcopy(attn).double(), x.double(), g.double(),
                         {**kwargs, "position_embeddings": tuple(t.double() for t in pe)})
    cuda_kwargs = {**kwargs, "position_embeddings": tuple(t.cuda().bfloat16() for t in pe)}
    xb, gb = x.cuda().bfloat16(), g.cuda().bfloat16()
    want, _, want_g = _run(copy.deepcopy(attn).cuda().bfloat16(), xb, gb, cuda_kwargs)
    fused = FusedAttention(copy.deepcopy(attn).cuda().bfloat16(), spec)
    got, _, got_g = _run(fused, xb, gb, cuda_kwargs)
    assert_within_rule(got.float().cpu(), want.float().cpu(), ref, 1e-2, "output")
    for n, a, b, r in zip(["input", *(n for n, _ in attn.named_parameters())], got_g, want_g, ref_g):
        assert_within_rule(a.float().cpu(), b.float().cpu(), r, 1e-2 * r.abs().max().item(), n)
    assert not fallbacks.counts(fused)
