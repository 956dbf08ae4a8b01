"""Kernels that read one dtype and write another, each result rounded once (issue 38: Qwen3's q/k norms under
autocast). rms_norm_fwd(x, w, …, out_dtype) with a bf16 x and an fp32 output is the norm of x widened, bit for bit,
and rms_norm_bwd's dx from an fp32 dy is that norm's fp32 dx rounded to x's dtype; rope_fwd(q, k, …, out_dtype)
with fp32 q, k and a bf16 output is the fp32 rotation rounded to bf16, and rope_bwd from bf16 gradients with an
fp32 output is the fp32 rotation of those gradients widened. Every backend (Triton interpreted), called directly.
"""
from __future__ import annotations

import pytest
import torch

from norm_kernel_helpers import backend_module

import test_triton_ops
from numerics import needs_mlir

interpreter, DEVICE = test_triton_ops.interpreter, test_triton_ops.DEVICE

F32, BF16 = torch.float32, torch.bfloat16
BACKENDS = ["triton", "reference", pytest.param("mlir", marks=needs_mlir)]


def _randn(*shape, seed, dtype=F32):
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed)).to(DEVICE, dtype)


@pytest.mark.parametrize("offset", [0.0, 1.0])
@pytest.mark.parametrize("backend", BACKENDS)
def test_rms_norm_bf16_in_fp32_out(backend, offset, request):
    k = backend_module(backend, request)
    x, w = _randn(2, 5, 3, 16, seed=1, dtype=BF16), _randn(16, seed=2) * 0.3 + 1.0
    y, rstd = k.rms_norm_fwd(x, w, 1e-6, offset, F32)
    y_wide, rstd_wide = k.rms_norm_fwd(x.float(), w, 1e-6, offset)
    assert y.dtype == F32 and y.shape == x.shape
    assert torch.equal(y, y_wide) and torch.equal(rstd, rstd_wide)
    dy = _randn(*x.shape, seed=3)
    dx, dw = k.rms_norm_bwd(dy, x, w, rstd, 1e-6, offset)
    dx_wide, dw_wide = k.rms_norm_bwd(dy, x.float(), w, rstd, 1e-6, offset)
    assert dx.dtype == BF16
    assert torch.equal(dx, dx_wide.to(BF16)) and torch.equal(dw, dw_wide)


@pytest.mark.parametrize("rotary", [16, 8], ids=["full", "partial"])
@pytest.mark.parametrize("backend", BACKENDS)
def test_rope_fp32_in_bf16_out_and_back(backend, rotary, request):
    k = backend_module(backend, request)
    q, kk = _randn(2, 4, 6, 16, seed=4), _randn(2, 2, 6, 16, seed=5)
    cos, sin = _randn(1, 6, rotary, seed=6), _randn(1, 6, rotary, seed=7)
    qo, ko = k.rope_fwd(q, kk, cos, sin, BF16)
    q32, k32 = k.rope_fwd(q, kk, cos, sin)
    assert qo.dtype == ko.dtype == BF16
    assert torch.equal(qo, q32.to(BF16)) and torch.equal(ko, k32.to(BF16))
    assert qo.stride() == q32.stride() and ko.stride() == k32.stride()  # the B×S×H×D memory of every rope output
    dq, dk = _randn(*q.shape, seed=8, dtype=BF16), _randn(*kk.shape, seed=9, dtype=BF16)
    gq, gk = k.rope_bwd(dq, dk, cos, sin, F32)
    gq_wide, gk_wide = k.rope_bwd(dq.float(), dk.float(), cos, sin)
    assert gq.dtype == gk.dtype == F32
    assert torch.equal(gq, gq_wide) and torch.equal(gk, gk_wide)
