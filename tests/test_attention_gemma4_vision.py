"""Gemma 4's vision attention fused by structure: projections wrapped in a module that clamps their input and output
to bounds from the checkpoint (``Gemma4ClippableLinear``, ``use_clipped_linears``; the plain Linear inside where
off), found as wrapped projections (``patterns/_attention_projections.py``) and called as they are; and its 2-D
rotary, the head split in one rotate-half part per axis of the B × S × 2 ``position_ids`` (``AttentionSpec.
rotary_axes``). Output, input gradient and every parameter's gradient exact against the unfused module in fp32,
with bounds that clip (and a check that they do), and against float64 within the numerics rule; a call whose
position_ids have another number of axes runs the original module."""
from __future__ import annotations

import copy
import dataclasses

import pytest
import torch
from torch import nn

from numerics import needs_mlir
from torchfuser import functional as F
from torchfuser.modules import fallbacks
from torchfuser.modules.attention import FusedAttention, _axes_to_half, _half_to_axes
from torchfuser.patterns._attention_probe import check
from torchfuser.patterns._attention_projections import projection_dims, wrapped_linear
from torchfuser.patterns.attention import AttentionPattern
from torchfuser.patterns.base import Skip

gemma4 = pytest.importorskip("transformers.models.gemma4.modeling_gemma4")
B, S, H, HEADS, D = 2, 6, 32, 4, 8


def _config(clipped: bool, impl: str = "sdpa", kv_heads: int = 2):
    from transformers.models.gemma4.configuration_gemma4 import Gemma4VisionConfig

    cfg = Gemma4VisionConfig(hidden_size=H, intermediate_size=64, num_hidden_layers=1, num_attention_heads=HEADS,
                             num_key_value_heads=kv_heads, head_dim=D, use_clipped_linears=clipped)
    cfg._attn_implementation = impl
    return cfg


def _positions():
    """(x, y) patch coordinates of a 3 × 2 grid, per row: B × S × 2."""
    grid = torch.stack(torch.meshgrid(torch.arange(3), torch.arange(2), indexing="ij"), -1).view(S, 2)
    return grid.expand(B, S, 2).clone()


def _attention(clipped: bool = True, impl: str = "sdpa", kv_heads: int = 2):
    """The attention, its call's keyword arguments, and (clipped) bounds that clip some inputs and outputs."""
    cfg = _config(clipped, impl, kv_heads)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        attn = gemma4.Gemma4VisionAttention(cfg, 0)
        for norm in (attn.q_norm, attn.k_norm):  # random weights: which norm sits where shows
            nn.init.normal_(norm.weight, 1.0, 0.3)
    if clipped:
        for proj, width in ((attn.q_proj, 1.5), (attn.k_proj, 1.2), (attn.v_proj, 1.0), (attn.o_proj, 0.3)):
            proj.input_min.fill_(-width)
            proj.input_max.fill_(width * 0.8)
            proj.output_min.fill_(-0.3)
            proj.output_max.fill_(0.25)
    ids = _positions()
    cos, sin = gemma4.Gemma4VisionRotaryEmbedding(cfg)(torch.zeros(B, S, H), ids)
    return attn, {"position_embeddings": (cos, sin), "position_ids": ids}


def _mask():
    mask = torch.zeros(B, 1, S, S)
    mask[1, :, :, 4:] = float("-inf")  # the second row's image has two padded patches
    return mask


def _run(module, x, g, kwargs):
    x = x.detach().clone().requires_grad_(True)
    out = module(x, attention_mask=_mask(), **kwargs)[0]
    return out, torch.autograd.grad((out * g).sum(), [x, *module.parameters()])


def _inputs(seed=3):
    gen = torch.Generator().manual_seed(seed)
    return 2 * torch.randn(B, S, H, generator=gen), torch.randn(B, S, H, generator=gen)


@pytest.mark.parametrize("clipped", [True, False])
def test_recognised_with_wrapped_projections_and_2d_rotary(clipped):
    attn, _ = _attention(clipped)
    spec = AttentionPattern().match(attn)
    assert not isinstance(spec, Skip), spec.reason
    assert spec.qkv == ("q_proj", "k_proj", "v_proj") and spec.out == "o_proj" and spec.layout == "separate"
    assert spec.rotary_axes == 2 and spec.rotary_dim == D and spec.rotary_interleave is None
    assert (spec.q_norm, spec.k_norm, spec.v_norm) == ("q_norm", "k_norm", "v_norm") and spec.scaling == 1.0
    # The probe tells the 2-D rotary from rotate-half over the whole head
    assert check(attn, dataclasses.replace(spec, rotary_axes=1), training=False) is not None
    assert projection_dims(attn.q_proj) == (H, HEADS * D) and wrapped_linear(attn.q_proj) is attn.q_proj.linear


@pytest.mark.parametrize("backend", ["reference", pytest.param("mlir", marks=needs_mlir)])
@pytest.mark.parametrize("clipped", [True, False])
@pytest.mark.parametrize("kv_heads", [2, 4])
def test_fp32_output_and_every_gradient_exact(clipped, kv_heads, backend):
    attn, kwargs = _attention(clipped, kv_heads=kv_heads)
    fused = FusedAttention(copy.deepcopy(attn), AttentionPattern().match(attn), backend)
    x, g = _inputs()
    want, want_g = _run(attn, x, g, kwargs)
    got, got_g = _run(fused, x, g, kwargs)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)
    names = ["input", *(n for n, _ in attn.named_parameters())]
    assert len(got_g) == len(want_g) == len(names) == 7
    for n, a, b in zip(names, got_g, want_g):
        assert b.abs().max() > 0, n
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-5, msg=n)
    assert not fallbacks.counts(fused)
    assert list(fused.state_dict()) == list(attn.state_dict())
    # against float64: within twice PyTorch's own fp32 error
    from numerics import assert_within_rule

    ref, ref_g = _run(copy.deepcopy(attn).double(), x.double(), g.double(),
                      {**kwargs, "position_embeddings": tuple(t.double() for t in kwargs["position_embeddings"])})
    assert_within_rule(got, want, ref, 1e-6, "output")
    for n, a, b, r in zip(names, got_g, want_g, ref_g):
        assert_within_rule(a, b, r, 1e-6 * r.abs().max().item(), n)


def test_the_bounds_clip_and_are_respected():
    """The bounds set above clip both sides of every projection, and the fused output is the clipped one: with
    the bounds opened (±inf) it differs, and its o_proj output stays within o_proj's output bounds."""
    attn, kwargs = _attention(True)
    seen = {}
    for name in ("q_proj", "k_proj", "v_proj", "o_proj"):
        proj = getattr(attn, name)
        proj.register_forward_hook(lambda m, a, out, name=name: seen.__setitem__(name, (a[0], m.linear(a[0]))))
    x, g = _inputs()
    attn(x, attention_mask=_mask(), **kwargs)
    for name, (inp, lin) in seen.items():
        proj = getattr(attn, name)
        assert ((inp < proj.input_min) | (inp > proj.input_max)).any(), name
        clamped = inp.clamp(proj.input_min, proj.input_max)
        assert ((proj.linear(clamped) < proj.output_min) | (proj.linear(clamped) > proj.output_max)).any(), name
    attn._forward_hooks.clear()
    for name in seen:
        getattr(attn, name)._forward_hooks.clear()
    fused = FusedAttention(copy.deepcopy(attn), AttentionPattern().match(attn), "reference")
    got, _ = _run(fused, x, g, kwargs)
    assert got.min() >= -0.3 and got.max() <= 0.25
    opened = copy.deepcopy(fused)
    for name in ("q_proj", "k_proj", "v_proj", "o_proj"):
        for b in ("input_min", "output_min"):
            getattr(opened, name).get_buffer(b).fill_(-float("inf"))
        for b in ("input_max", "output_max"):
            getattr(opened, name).get_buffer(b).fill_(float("inf"))
    assert (opened(x, attention_mask=_mask(), **kwargs)[0] - got).abs().max() > 1e-2


def test_position_ids_of_other_axes_run_the_original():
    """Patches with four position axes: the model splits each head in four rotate-half parts, not the two found."""
    attn, kwargs = _attention(True)
    fused = FusedAttention(copy.deepcopy(attn), AttentionPattern().match(attn), "reference")
    x, g = _inputs()
    gen = torch.Generator().manual_seed(0)
    call = {"position_embeddings": tuple(torch.randn(B, S, D, generator=gen) for _ in range(2)),
            "position_ids": torch.randint(0, 3, (B, S, 4), generator=gen)}
    want, want_g = _run(attn, x, g, call)
    got, got_g = _run(fused, x, g, call)
    assert torch.equal(got, want) and all(torch.equal(a, b) for a, b in zip(got_g, want_g))
    (reasons,) = fallbacks.counts(fused).values()
    assert any("position_ids of shape (2, 6, 4)" in why for why in reasons), reasons
    fallbacks.clear(fused)
    _run(fused, x, g, kwargs)  # two axes again: fused
    assert not fallbacks.counts(fused)


@pytest.mark.parametrize("axes", [1, 2, 4])
def test_reordered_rope_is_rotate_half_per_part(axes):
    """rope over [a₀ a₁ … | b₀ b₁ …] = rotate-half within each part [aᵢ | bᵢ], channels reordered back."""
    gen = torch.Generator().manual_seed(0)
    q, k = torch.randn(B, 3, S, 16, generator=gen), torch.randn(B, 2, S, 16, generator=gen)
    cos, sin = torch.randn(B, S, 16, generator=gen), torch.randn(B, S, 16, generator=gen)

    def per_part(x):
        parts = []
        for xi, ci, si in zip(x.chunk(axes, -1), cos.chunk(axes, -1), sin.chunk(axes, -1)):
            a, b = xi.chunk(2, -1)
            parts.append(xi * ci[:, None] + torch.cat([-b, a], -1) * si[:, None])
        return torch.cat(parts, -1)

    qr, kr = F.rope(*(_axes_to_half(t, axes) for t in (q, k, cos, sin)), backend="reference")
    torch.testing.assert_close(_half_to_axes(qr, axes), per_part(q))
    torch.testing.assert_close(_half_to_axes(kr, axes), per_part(k))
    assert torch.equal(_half_to_axes(_axes_to_half(q, axes), axes), q)


class _TwoLinears(nn.Module):
    def __init__(self):
        super().__init__()
        self.a, self.b = nn.Linear(4, 4), nn.Linear(4, 4)

    def forward(self, x):
        return self.b(self.a(x))


class _MixesRows(nn.Module):
    def __init__(self):
        super().__init__()
        self.linear = nn.Linear(4, 4)

    def forward(self, x):
        return self.linear(x) + self.linear(x).mean(-2, keepdim=True)


def test_wrapped_projection_only_one_linear_row_by_row():
    assert wrapped_linear(_TwoLinears()) is None
    assert wrapped_linear(_MixesRows()) is None
    assert wrapped_linear(nn.Linear(4, 4)) is None and projection_dims(nn.Linear(4, 5)) == (4, 5)
    attn, _ = _attention(False)
    assert wrapped_linear(attn.o_proj) is attn.o_proj.linear and projection_dims(attn.o_proj) == (HEADS * D, H)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA (the Triton rope kernel)")
@pytest.mark.parametrize("clipped", [True, False])
def test_cuda_bf16_within_the_numerics_rule(clipped):
    """On a GPU (backend auto: Triton's rope, SDPA): output and every gradient in bf16 within the rule."""
    from numerics import assert_within_rule

    attn, kwargs = _attention(clipped)
    spec = AttentionPattern().match(attn)
    x, g = _inputs(5)
    pe = kwargs["position_embeddings"]
    ref, ref_g = _run(copy.deepcopy(attn).double(), x.double(), g.double(),
                      {**kwargs, "position_embeddings": tuple(t.double() for t in pe)})
    cuda_kwargs = {"position_embeddings": tuple(t.cuda().bfloat16() for t in pe), "position_ids": kwargs["position_ids"].cuda()}
    xb, gb = x.cuda().bfloat16(), g.cuda().bfloat16()

    def run(module):
        xb_ = xb.detach().clone().requires_grad_(True)
        out = module(xb_, attention_mask=_mask().cuda().bfloat16(), **cuda_kwargs)[0]
        return out, torch.autograd.grad((out * gb).sum(), [xb_, *module.parameters()])

    want, want_g = run(copy.deepcopy(attn).cuda().bfloat16())
    fused = FusedAttention(copy.deepcopy(attn).cuda().bfloat16(), spec)
    got, got_g = run(fused)
    assert_within_rule(got.float().cpu(), want.float().cpu(), ref, 1e-2, "output")
    for n, a, b, r in zip(["input", *(n for n, _ in attn.named_parameters())], got_g, want_g, ref_g):
        assert_within_rule(a.float().cpu(), b.float().cpu(), r, 1e-2 * r.abs().max().item(), n)
    assert not fallbacks.counts(fused)
