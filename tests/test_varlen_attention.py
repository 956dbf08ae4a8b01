"""Vision attention over cu_seqlens (Qwen-VL / GLM-4V style), recognised by structure: a user's own module
fused and exact (output and every gradient), one whose math differs left alone with the reason, and the
block mask of the segments."""
from __future__ import annotations

import types

import pytest
import torch
from torch import nn

import torchfuser
from torchfuser.modules.varlen_attention import FusedVarlenAttention, segment_mask


def _rotate_half(x):
    a, b = x.chunk(2, dim=-1)
    return torch.cat([-b, a], dim=-1)


class SegmentAttention(nn.Module):
    """Separate q/k/v, rotate-half rotary, one softmax per segment of cu_seqlens (a loop, as the originals)."""

    def __init__(self, dim=32, heads=4, causal=False, norms=False):
        super().__init__()
        self.num_heads, self.head_dim, self.causal = heads, dim // heads, causal
        self.query, self.key, self.value, self.proj = (nn.Linear(dim, dim) for _ in range(4))
        if norms:  # per-head q/k norms before the rotary (GLM-OCR)
            self.q_norm, self.k_norm = nn.RMSNorm(dim // heads, eps=1e-6), nn.RMSNorm(dim // heads, eps=1e-6)
            with torch.no_grad():
                self.q_norm.weight.uniform_(0.5, 1.5)
                self.k_norm.weight.uniform_(0.5, 1.5)
        self.config = types.SimpleNamespace(_attn_implementation="sdpa")

    def forward(self, hidden_states, cu_seqlens, position_embeddings=None):
        n = hidden_states.shape[0]
        q, k, v = (m(hidden_states).view(n, self.num_heads, -1) for m in (self.query, self.key, self.value))
        if hasattr(self, "q_norm"):
            q, k = self.q_norm(q), self.k_norm(k)
        cos, sin = (t.unsqueeze(1) for t in position_embeddings)
        q, k = q * cos + _rotate_half(q) * sin, k * cos + _rotate_half(k) * sin
        outs = []
        for a, b in zip(cu_seqlens[:-1].tolist(), cu_seqlens[1:].tolist()):
            qs, ks, vs = (t[a:b].transpose(0, 1) for t in (q, k, v))
            outs.append(nn.functional.scaled_dot_product_attention(qs, ks, vs, is_causal=self.causal).transpose(0, 1))
        return self.proj(torch.cat(outs).reshape(n, -1))


class Tower(nn.Module):
    def __init__(self, **kw):
        super().__init__()
        self.attn = SegmentAttention(**kw)

    def forward(self, x, cu, pe):
        return self.attn(x, cu_seqlens=cu, position_embeddings=pe)


def _inputs(n=11, d=8):
    gen = torch.Generator().manual_seed(3)
    x = torch.randn(n, 32, generator=gen)
    angles = torch.randn(n, d // 2, generator=gen)
    pe = (torch.cat([angles.cos()] * 2, -1), torch.cat([angles.sin()] * 2, -1))
    return x, torch.tensor([0, 4, 9, 11], dtype=torch.int32), pe


@pytest.mark.parametrize("norms", [False, True])
def test_segment_attention_fused_and_exact(norms):
    torch.manual_seed(0)
    model = Tower(norms=norms)
    x, cu, pe = _inputs()
    want = model(x, cu, pe)
    want_grads = torch.autograd.grad(want.square().sum(), list(model.parameters()))
    torchfuser.optimize(model, backend="reference")
    assert isinstance(model.attn, FusedVarlenAttention), torchfuser.report(model)
    assert model.attn.spec.layout == "separate" and model.attn.spec.rotary
    assert (model.attn.spec.q_norm, model.attn.spec.k_norm) == (("q_norm", "k_norm") if norms else (None, None))
    got = model(x, cu, pe)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)
    for g, w in zip(torch.autograd.grad(got.square().sum(), list(model.parameters())), want_grads):
        torch.testing.assert_close(g, w, rtol=1e-4, atol=1e-6)
    torchfuser.restore(model)
    assert isinstance(model.attn, SegmentAttention)


def test_causal_segments_are_left_alone_with_the_reason():
    model = Tower(causal=True)
    torchfuser.optimize(model, backend="reference")
    assert isinstance(model.attn, SegmentAttention)
    (entry,) = [e for e in torchfuser.report(model).skipped if e.pattern == "varlen_attention"]
    assert "could not be reproduced" in entry.reason


def test_other_attention_implementation_runs_the_original():
    torch.manual_seed(0)
    model = Tower()
    x, cu, pe = _inputs()
    want = model(x, cu, pe)
    torchfuser.optimize(model, backend="reference")
    model.attn.config._attn_implementation = "flash_attention_2"  # the original's own path (here: its loop)
    torch.testing.assert_close(model(x, cu, pe), want)


@pytest.mark.parametrize("cu,n", [([0, 3, 7], 7), ([0, 7], 7), ([0, 1, 2, 5], 5)])
def test_segment_mask(cu, n):
    mask = segment_mask(torch.tensor(cu, dtype=torch.int32), n)
    seg = torch.repeat_interleave(torch.arange(len(cu) - 1), torch.diff(torch.tensor(cu)))
    assert torch.equal(mask, seg[:, None] == seg[None, :])


def test_rotary_tables_that_require_grad_run_the_original():
    """Tables made from trained parameters (LLaVA-OneVision-1.5's vision tower): the original differentiates
    through them, so the call runs it."""
    torch.manual_seed(0)
    model = Tower()
    x, cu, (cos, sin) = _inputs()
    torchfuser.optimize(model, backend="reference")
    cos = cos.clone().requires_grad_()
    model(x, cu, (cos, sin)).sum().backward()
    assert cos.grad is not None and cos.grad.abs().sum() > 0
