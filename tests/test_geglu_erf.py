"""geglu with exact (erf) GELU, gelu(gate) · up: the reference backend against float64, fp32 / bf16 / fp16,
halves and packed [gate | up] alike. (The Triton kernel: tests/backends/test_triton_ops.py; MLIR:
tests/backends/test_mlir_ops.py.)"""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as TF

import torchfuser.functional as F
from numerics import ATOL, assert_within_rule


def _grads(fn, inputs):
    out = fn(*inputs)
    cot = torch.randn(out.shape, generator=torch.Generator().manual_seed(1)).to(out.dtype)
    return [out, *torch.autograd.grad(out, inputs, cot)]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("shape", [(1, 64), (37, 123), (2, 3, 96)])
def test_geglu_erf_against_float64(shape, dtype):
    gen = torch.Generator().manual_seed(0)
    gate, up = torch.randn(shape, generator=gen) * 2, torch.randn(shape, generator=gen)
    plain = lambda g, u: TF.gelu(g) * u  # noqa: E731
    fused = lambda g, u: F.geglu(g, u, approximate="none", backend="reference")  # noqa: E731
    leaves = lambda dt: [t.to(dt).requires_grad_() for t in (gate, up)]  # noqa: E731
    ref, same, got = _grads(plain, leaves(torch.float64)), _grads(plain, leaves(dtype)), _grads(fused, leaves(dtype))
    for i, (g, s, r) in enumerate(zip(got, same, ref)):
        assert g.dtype == dtype
        assert_within_rule(g, s, r, ATOL[dtype] * max(1.0, r.abs().max().item()), f"geglu_erf output {i}")


def test_geglu_erf_is_not_the_tanh_form():
    g, u = torch.linspace(-4, 4, 64).reshape(1, 64), torch.ones(1, 64)
    exact, tanh = F.geglu(g, u, approximate="none", backend="reference"), F.geglu(g, u, backend="reference")
    torch.testing.assert_close(exact, TF.gelu(g) * u)
    assert (exact - tanh).abs().max() > 1e-4


def test_geglu_erf_packed_is_the_halves():
    gu = (torch.randn(3, 5, 64) * 2).requires_grad_()
    gu2 = gu.detach().clone().requires_grad_()
    packed = F.geglu(gu, approximate="none", backend="reference")
    halves = F.geglu(*gu2.chunk(2, dim=-1), approximate="none", backend="reference")
    torch.testing.assert_close(packed, halves)
    cot = torch.randn_like(packed)
    packed.backward(cot)
    halves.backward(cot)
    torch.testing.assert_close(gu.grad, gu2.grad)


def test_geglu_rejects_unknown_approximation():
    with pytest.raises(ValueError, match="approximate"):
        F.geglu(torch.randn(2, 4), torch.randn(2, 4), approximate="erf")
