"""Vision attention over cu_seqlens whose rotary turns adjacent channel pairs (Inkling 2's rotate_pairwise, cos and
sin given per channel), fused by structure: output and every gradient exact in fp32 against the unfused module;
rotate-half modules keep the rotate-half spec, and the probe tells the two apart."""
from __future__ import annotations

import dataclasses
import types

import pytest
import torch
from torch import nn

import torchfuser
from torchfuser.modules.varlen_attention import FusedVarlenAttention
from torchfuser.patterns.varlen_attention import VarlenAttentionPattern, _probe_once


def _rotate_pairs(x):
    a, b = x.unflatten(-1, (-1, 2)).unbind(-1)
    return torch.stack([-b, a], dim=-1).flatten(-2)


class PairAttention(nn.Module):
    """Separate q/k/v, adjacent-pair rotary, one softmax per segment of cu_seqlens."""

    def __init__(self, dim=32, heads=4):
        super().__init__()
        self.num_heads, self.head_dim = heads, dim // heads
        self.q_proj, self.k_proj, self.v_proj, self.out_proj = (nn.Linear(dim, dim) for _ in range(4))
        self.config = types.SimpleNamespace(_attn_implementation="sdpa")

    def forward(self, hidden_states, cu_seqlens, position_embeddings):
        n = hidden_states.shape[0]
        q, k, v = (m(hidden_states).view(n, self.num_heads, -1) for m in (self.q_proj, self.k_proj, self.v_proj))
        cos, sin = (t.unsqueeze(-2) for t in position_embeddings)
        q, k = q * cos + _rotate_pairs(q) * sin, k * cos + _rotate_pairs(k) * sin
        outs = []
        for a, b in zip(cu_seqlens[:-1].tolist(), cu_seqlens[1:].tolist()):
            qs, ks, vs = (t[a:b].transpose(0, 1) for t in (q, k, v))
            outs.append(nn.functional.scaled_dot_product_attention(qs, ks, vs).transpose(0, 1))
        return self.out_proj(torch.cat(outs).reshape(n, -1))


class Tower(nn.Module):
    def __init__(self):
        super().__init__()
        self.attn = PairAttention()

    def forward(self, x, cu, pe):
        return self.attn(x, cu_seqlens=cu, position_embeddings=pe)


def _inputs(n=11, d=8):
    gen = torch.Generator().manual_seed(3)
    x = torch.randn(n, 32, generator=gen)
    angles = torch.randn(n, d // 2, generator=gen)  # one angle a pair, repeated over its two channels
    pe = (angles.cos().repeat_interleave(2, -1), angles.sin().repeat_interleave(2, -1))
    return x, torch.tensor([0, 4, 9, 11], dtype=torch.int32), pe


def test_pair_rotary_fused_and_exact():
    torch.manual_seed(0)
    model = Tower()
    x, cu, pe = _inputs()
    want = model(x, cu, pe)
    want_grads = torch.autograd.grad(want.square().sum(), [*model.parameters()])
    torchfuser.optimize(model, backend="reference")
    assert isinstance(model.attn, FusedVarlenAttention), torchfuser.report(model)
    assert model.attn.spec.rotary and model.attn.spec.rotary_pairs
    got = model(x, cu, pe)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)
    got_grads = torch.autograd.grad(got.square().sum(), [*model.parameters()])
    assert len(got_grads) == 8
    for g, w in zip(got_grads, want_grads):
        assert w.abs().max() > 0
        torch.testing.assert_close(g, w, rtol=1e-4, atol=1e-6)


def test_probe_tells_pairs_from_rotate_half():
    attn = PairAttention()
    spec = VarlenAttentionPattern().match(attn)
    projs = {n: (32, 32) for n in ("q_proj", "k_proj", "v_proj", "out_proj")}
    assert _probe_once(attn, spec, projs) is None
    assert _probe_once(attn, dataclasses.replace(spec, rotary_pairs=False), projs) is not None


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA (PyTorch's varlen attention kernel, Triton's rope)")
def test_cuda_bf16_pairs_within_the_numerics_rule():
    """On a GPU (backend auto): output and every gradient in bf16 within the rule against float64."""
    from numerics import assert_within_rule

    torch.manual_seed(0)
    model = Tower().cuda().bfloat16()
    ref = Tower().cuda().double()
    ref.load_state_dict(model.state_dict())
    x, cu, pe = _inputs()
    x, cu = x.cuda(), cu.cuda()
    g = torch.randn(x.shape[0], 32, generator=torch.Generator().manual_seed(5)).cuda()

    def run(m, dtype):
        out = m(x.to(dtype), cu, tuple(t.cuda().to(dtype) for t in pe))
        return out, torch.autograd.grad(out, [*m.parameters()], g.to(dtype))

    want64, want64_g = run(ref, torch.float64)
    plain, plain_g = run(model, torch.bfloat16)
    torchfuser.optimize(model)
    assert isinstance(model.attn, FusedVarlenAttention) and model.attn.spec.rotary_pairs
    got, got_g = run(model, torch.bfloat16)
    assert_within_rule(got.double(), plain.double(), want64, 1e-2, "output")
    for a, b, r in zip(got_g, plain_g, want64_g):
        assert_within_rule(a.double(), b.double(), r, 1e-2 * r.abs().max().item(), "grad")
