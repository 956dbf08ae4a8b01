"""Grouped k/v heads in the variable-length (cu_seqlens) vision attention (EXAONE 4.5's vision tower): fused by
structure from a fused [q | k | v] projection or separate ones, exact against the module's own per-segment
loop (output and every gradient); the CUDA varlen kernel's call with and without its ``enable_gqa`` switch
checked on the CPU through stand-in kernels, and on a GPU against SDPA."""
from __future__ import annotations

import types

import pytest
import torch
from torch import nn

import torchfuser
from torchfuser.modules import varlen_attention
from torchfuser.modules.varlen_attention import FusedVarlenAttention, segment_mask
from test_varlen_attention import _inputs  # the same packed rows and rotary tables


def _rotate_half(x):
    a, b = x.chunk(2, dim=-1)
    return torch.cat([-b, a], dim=-1)


class GroupedSegmentAttention(nn.Module):
    """4 query heads, 2 k/v heads (each serving two query heads in order), rotate-half rotary, one softmax
    per cu_seqlens segment; ``fused``: one [q | k | v] projection, else three."""

    def __init__(self, dim=32, heads=4, kv_heads=2, fused=True):
        super().__init__()
        self.num_heads, self.num_key_value_heads, self.head_dim = heads, kv_heads, dim // heads
        self.q_dim, self.kv_dim = dim, kv_heads * dim // heads
        if fused:
            self.qkv = nn.Linear(dim, self.q_dim + 2 * self.kv_dim)
        else:
            self.q, self.k, self.v = nn.Linear(dim, self.q_dim), nn.Linear(dim, self.kv_dim), nn.Linear(dim, self.kv_dim)
        self.proj = nn.Linear(dim, dim)
        self.config = types.SimpleNamespace(_attn_implementation="sdpa")

    def forward(self, hidden_states, cu_seqlens, position_embeddings=None):
        n, d = hidden_states.shape[0], self.head_dim
        if hasattr(self, "qkv"):
            q, k, v = self.qkv(hidden_states).split([self.q_dim, self.kv_dim, self.kv_dim], dim=-1)
        else:
            q, k, v = self.q(hidden_states), self.k(hidden_states), self.v(hidden_states)
        q, k, v = q.view(n, -1, d), k.view(n, -1, d), v.view(n, -1, d)
        cos, sin = (t.unsqueeze(1) for t in position_embeddings)
        q, k = q * cos + _rotate_half(q) * sin, k * cos + _rotate_half(k) * sin
        g = self.num_heads // self.num_key_value_heads
        k, v = k.repeat_interleave(g, dim=1), v.repeat_interleave(g, dim=1)
        outs = []
        for a, b in zip(cu_seqlens[:-1].tolist(), cu_seqlens[1:].tolist()):
            qs, ks, vs = (t[a:b].transpose(0, 1) for t in (q, k, v))
            outs.append(nn.functional.scaled_dot_product_attention(qs, ks, vs).transpose(0, 1))
        return self.proj(torch.cat(outs).reshape(n, -1))


class Tower(nn.Module):
    def __init__(self, **kw):
        super().__init__()
        self.attn = GroupedSegmentAttention(**kw)

    def forward(self, x, cu, pe):
        return self.attn(x, cu_seqlens=cu, position_embeddings=pe)


@pytest.mark.parametrize("fused", [True, False])
def test_grouped_kv_fused_and_exact(fused):
    torch.manual_seed(0)
    model = Tower(fused=fused)
    x, cu, pe = _inputs()
    x = x.requires_grad_()
    want = model(x, cu, pe)
    want_grads = torch.autograd.grad(want.square().sum(), [x, *model.parameters()])
    torchfuser.optimize(model, backend="reference")
    assert isinstance(model.attn, FusedVarlenAttention), torchfuser.report(model)
    assert model.attn.spec.num_kv_heads == 2 and model.attn.spec.layout == ("concat" if fused else "separate")
    got = model(x, cu, pe)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)
    got_grads = torch.autograd.grad(got.square().sum(), [x, *model.parameters()])
    assert len(got_grads) == len(want_grads) == (4 if fused else 8) + 1
    for g, w in zip(got_grads, want_grads):
        torch.testing.assert_close(g, w, rtol=1e-4, atol=1e-6)


def test_grouped_heads_in_another_order_are_not_fused():
    """k/v head j serving query heads j, j + kv, … (a tiled repeat, not transformers' repeat_kv): another
    model's math, left alone."""

    class Tiled(GroupedSegmentAttention):
        def forward(self, hidden_states, cu_seqlens, position_embeddings=None):
            n, d = hidden_states.shape[0], self.head_dim
            q, k, v = self.qkv(hidden_states).split([self.q_dim, self.kv_dim, self.kv_dim], dim=-1)
            q, k, v = q.view(n, -1, d), k.view(n, -1, d).repeat(1, 2, 1), v.view(n, -1, d).repeat(1, 2, 1)
            cos, sin = (t.unsqueeze(1) for t in position_embeddings)
            q, k = q * cos + _rotate_half(q) * sin, k * cos + _rotate_half(k) * sin
            mask = segment_mask(cu_seqlens, n)
            out = nn.functional.scaled_dot_product_attention(q.transpose(0, 1), k.transpose(0, 1), v.transpose(0, 1),
                                                             attn_mask=mask)
            return self.proj(out.transpose(0, 1).reshape(n, -1))

    model = Tower()
    model.attn = Tiled()
    torchfuser.optimize(model, backend="reference")
    assert isinstance(model.attn, Tiled)
    (entry,) = [e for e in torchfuser.report(model).skipped if e.pattern == "varlen_attention"]
    assert "could not be reproduced" in entry.reason


def _segments_sdpa(q, k, v, cu, scale):
    """S × H × D reference: softmax within each segment, k/v heads repeated in order."""
    g = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(g, dim=1), v.repeat_interleave(g, dim=1)
    mask = segment_mask(cu, q.shape[0])
    out = nn.functional.scaled_dot_product_attention(*(t.transpose(0, 1) for t in (q, k, v)), attn_mask=mask, scale=scale)
    return out.transpose(0, 1)


def _with_switch(q, k, v, cu_q, cu_k, max_q, max_k, *, scale=None, window_size=(-1, -1), enable_gqa=False):
    assert enable_gqa and window_size == (-1, -1)
    return _segments_sdpa(q, k, v, cu_q, scale)


def _without_switch(q, k, v, cu_q, cu_k, max_q, max_k, *, scale=None, is_causal=False):
    assert k.shape[1] == q.shape[1] and not is_causal  # heads repeated before the call
    return _segments_sdpa(q, k, v, cu_q, scale)


@pytest.mark.parametrize("kernel", [_with_switch, _without_switch])
def test_varlen_kernel_called_with_grouped_heads(kernel):
    gen = torch.Generator().manual_seed(1)
    q, k, v = (torch.randn(1, h, 11, 8, generator=gen, dtype=torch.float64) for h in (4, 2, 2))
    cu = torch.tensor([0, 4, 9, 11], dtype=torch.int32)
    got = varlen_attention._varlen(kernel, q, k, v, cu, None, 0.3)
    want = _segments_sdpa(*(t[0].transpose(0, 1) for t in (q, k, v)), cu, 0.3)
    torch.testing.assert_close(got, want)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA (PyTorch's varlen attention kernel)")
def test_cuda_varlen_kernel_with_grouped_heads_matches_sdpa():
    torch.manual_seed(0)
    model = Tower().cuda().bfloat16()
    x, cu, pe = _inputs()
    x, cu, pe = x.cuda().bfloat16(), cu.cuda(), tuple(t.cuda().bfloat16() for t in pe)
    ref = Tower().cuda().double()
    ref.load_state_dict(model.state_dict())
    want64 = ref(x.double(), cu, tuple(t.double() for t in pe))
    plain = model(x, cu, pe)
    torchfuser.optimize(model)
    got = model(x, cu, pe)
    err, base = (got.double() - want64).abs().max().item(), (plain.double() - want64).abs().max().item()
    assert err <= 2 * base + 1e-2, (err, base)


def test_a_mask_besides_cu_seqlens_runs_the_original():
    """A forward that also takes a mask (LFM3-VL's vision attention applies it within each segment): a call that
    gives one runs the original, counted."""

    class Masked(GroupedSegmentAttention):
        def forward(self, hidden_states, cu_seqlens, position_embeddings=None, attention_mask=None):
            out = super().forward(hidden_states, cu_seqlens, position_embeddings)
            return out if attention_mask is None else out + attention_mask.sum()

    torch.manual_seed(0)
    attn = Masked()
    x, cu, pe = _inputs()
    want = attn(x, cu, pe, torch.ones(3))
    from torchfuser.patterns.varlen_attention import VarlenAttentionPattern
    fused = FusedVarlenAttention(attn, VarlenAttentionPattern().match(attn), "reference")
    torch.testing.assert_close(fused(x, cu, pe, torch.ones(3)), want)
    from torchfuser.modules import fallbacks
    assert fallbacks.counts(fused)


def test_a_forward_returning_output_and_weights_gets_both_back():
    """LFM3-VL's vision attention returns (output, attention weights), and its layer unpacks them: so does the
    fused module's caller."""

    class Pair(GroupedSegmentAttention):
        def forward(self, hidden_states, cu_seqlens, position_embeddings=None):
            return super().forward(hidden_states, cu_seqlens, position_embeddings), None

    torch.manual_seed(0)
    model = Tower()
    model.attn = Pair()
    x, cu, pe = _inputs()
    want, _ = model.attn(x, cu, pe)
    torchfuser.optimize(model, backend="reference")
    assert isinstance(model.attn, FusedVarlenAttention) and model.attn.spec.returns_tuple
    got, weights = model.attn(x, cu, pe)
    assert weights is None
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)


class OneRow(GroupedSegmentAttention):
    """The patches as one row, 1 × S × hidden, and (output, weights) returned (HunYuan-VL's vision attention)."""

    def forward(self, hidden_states, cu_seqlens, attention_mask=None, position_embeddings=None, **kwargs):
        assert attention_mask is None
        return super().forward(hidden_states[0], cu_seqlens, position_embeddings).unsqueeze(0), None


def test_patches_as_one_row_fused_and_exact():
    torch.manual_seed(0)
    attn = OneRow(fused=False)
    x, cu, pe = _inputs()
    x = x.unsqueeze(0).requires_grad_()
    want = attn(x, cu, attention_mask=None, position_embeddings=pe)[0]
    want_grads = torch.autograd.grad(want.square().sum(), [x, *attn.parameters()])
    from torchfuser.patterns.varlen_attention import VarlenAttentionPattern
    spec = VarlenAttentionPattern().match(attn)
    assert spec.batched and spec.returns_tuple and spec.num_kv_heads == 2, spec
    fused = FusedVarlenAttention(attn, spec, "reference")
    got = fused(x, cu, attention_mask=None, position_embeddings=pe)[0]
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)
    for g, w in zip(torch.autograd.grad(got.square().sum(), [x, *fused.parameters()]), want_grads):
        torch.testing.assert_close(g, w, rtol=1e-4, atol=1e-6)
    from torchfuser.modules import fallbacks
    assert not fallbacks.counts(fused)
    two = torch.cat([x, 2 * x]).detach()  # two rows: whatever the original makes of them, never a fused guess
    with torch.no_grad():
        torch.testing.assert_close(fused(two, cu, attention_mask=None, position_embeddings=pe)[0],
                                   attn(two, cu, attention_mask=None, position_embeddings=pe)[0])
    assert "1 × patches × hidden" in next(iter(fallbacks.counts(fused)[""]))
