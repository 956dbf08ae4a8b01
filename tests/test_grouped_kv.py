"""The compiler's grouped k/v rewrite: a maskless SDPA call whose keys and values are transformers'
``repeat_kv`` of fewer heads takes them unrepeated with ``enable_gqa=True``; other repeats (tiled
heads, not grouped) and masked calls are kept. Forward and every gradient against float64."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

import torchfuser
from test_compiler import check_parity

OPTIONS = {"backend": "inductor", "kernels": "reference"}  # the rewrites run before Inductor


@pytest.fixture(autouse=True)
def _fresh_dynamo():
    torch._dynamo.reset()
    yield


def _causal(q):
    i = torch.arange(q.shape[-2], device=q.device)
    return i[None, :] <= i[:, None]


def repeat_kv(x, n):  # transformers' form
    b, h, s, d = x.shape
    return x[:, :, None, :, :].expand(b, h, n, s, d).reshape(b, h * n, s, d)


def grouped(q, k, v):
    return F.scaled_dot_product_attention(q, repeat_kv(k, 2), repeat_kv(v, 2), attn_mask=_causal(q))


def grouped_unsqueeze(q, k, v):
    rep = lambda x: x.unsqueeze(2).expand(2, 2, 2, 12, 8).reshape(2, 4, 12, 8)  # noqa: E731
    return F.scaled_dot_product_attention(q, rep(k), rep(v), attn_mask=_causal(q), scale=0.3)


def tiled(q, k, v):  # heads in the order k0 k1 k0 k1: not what enable_gqa means
    return F.scaled_dot_product_attention(q, k.repeat(1, 2, 1, 1), v.repeat(1, 2, 1, 1), attn_mask=_causal(q))


def tiled_expand(q, k, v):
    rep = lambda x: x[:, None].expand(2, 2, 2, 12, 8).reshape(2, 4, 12, 8)  # noqa: E731
    return F.scaled_dot_product_attention(q, rep(k), rep(v), attn_mask=_causal(q))


def grouped_window(q, k, v):
    i = torch.arange(q.shape[-2])
    window = (i[None, :] <= i[:, None]) & (i[:, None] - i[None, :] < 4)
    return F.scaled_dot_product_attention(q, repeat_kv(k, 2), repeat_kv(v, 2), attn_mask=window)


def _qkv():
    return [torch.randn(2, heads, 12, 8, requires_grad=True) for heads in (4, 2, 2)]


def _grouped_lines():
    return [line for line in torchfuser.compiler.last_record().rewrites if line.startswith("grouped k/v")]


@pytest.mark.parametrize("fn", [grouped, grouped_unsqueeze])
def test_repeated_kv_goes_to_sdpa_grouped(fn):
    check_parity(torch.compile(fn, backend="torchfuser", options=OPTIONS), fn, _qkv())
    assert _grouped_lines() == ["grouped k/v: 1 scaled_dot_product_attention call(s) take enable_gqa=True instead "
                                "of keys and values repeated per query head"]
    code = torchfuser.compiler.last_record().graphs["dynamo"]
    assert "enable_gqa = True" in code and "expand" not in code


@pytest.mark.parametrize("fn", [tiled, tiled_expand, grouped_window])
def test_other_repeats_and_masked_calls_are_kept(fn):
    check_parity(torch.compile(fn, backend="torchfuser", options=OPTIONS), fn, _qkv())
    assert _grouped_lines() == []
    assert "enable_gqa" not in torchfuser.compiler.last_record().graphs["dynamo"]
