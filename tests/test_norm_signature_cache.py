"""FusedRMSNorm does its input checks and picks its backend once per call signature (modules/norms.py): a call
with anything the checks read changed (x's dtype, width, device, the weight object's dtype or shape, the module's
backend, GPU autocast) takes a fresh decision; nothing stale gives a wrong result or skips an error."""
from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

import torchfuser
from torchfuser.modules.norms import FusedRMSNorm


class _Block(nn.Module):
    def __init__(self, width=16):
        super().__init__()
        self.norm = nn.RMSNorm(width, eps=1e-6)

    def forward(self, x):
        return self.norm(x)


def _pair():
    torch.manual_seed(0)
    ref = _Block()
    nn.init.normal_(ref.norm.weight)
    fused = torchfuser.optimize(copy.deepcopy(ref), backend="reference")
    assert isinstance(fused.norm, FusedRMSNorm)
    return ref, fused


def test_each_signature_change_is_a_fresh_decision():
    ref, fused = _pair()
    for dtype in (torch.float32, torch.bfloat16, torch.float64, torch.float32):
        x = torch.randn(3, 16, dtype=dtype)
        torch.testing.assert_close(fused(x), ref(x), rtol=0, atol=0)
    assert len(fused.norm._signatures) == 3
    ref.to(torch.bfloat16), fused.to(torch.bfloat16)  # the same Parameter object, another dtype
    x = torch.randn(5, 16, dtype=torch.bfloat16)
    got, want = fused(x), ref(x)
    assert got.dtype == want.dtype == torch.bfloat16
    torch.testing.assert_close(got.float(), want.float(), rtol=1e-2, atol=1e-2)
    assert len(fused.norm._signatures) == 4


def test_errors_are_raised_on_every_call():
    _, fused = _pair()
    fused(torch.randn(2, 16))
    for _ in range(2):
        with pytest.raises(TypeError, match="int64"):
            fused(torch.ones(2, 16, dtype=torch.long))
        with pytest.raises(ValueError, match=r"shape \(8,\)"):
            fused(torch.randn(2, 8))
    fused.norm.weight = nn.Parameter(torch.ones(8))  # another weight: checked again against x's width
    with pytest.raises(ValueError, match=r"shape \(16,\)"):
        fused(torch.randn(2, 16))


def test_backend_change_is_a_fresh_decision(monkeypatch):
    _, fused = _pair()
    seen = []
    from torchfuser import ops

    real = ops.rms_norm
    monkeypatch.setattr(ops, "rms_norm", lambda *a: seen.append(a[-1]) or real(*a))
    x = torch.randn(2, 16)
    fused(x)
    fused.norm.backend = "reference"
    fused(x)
    assert seen == ["reference", "reference"]
    with pytest.raises(ValueError, match="valid backends"):
        fused.norm.backend = "cuda"
        fused(x)


def test_add_checks_each_signature():
    """``add`` (the residual add and the norm in one kernel, called by the fused decoder layers): the same."""
    _, fused = _pair()
    norm = fused.norm
    x, r = torch.randn(3, 16), torch.randn(3, 16)
    for _ in range(2):
        s, y = norm.add(x, r)
        torch.testing.assert_close(s, x + r, rtol=0, atol=0)
        torch.testing.assert_close(y, nn.functional.rms_norm(x + r, (16,), norm.weight, 1e-6))
    with pytest.raises(ValueError, match="same shape"):
        norm.add(x, torch.randn(2, 16))
    with pytest.raises(TypeError, match="out_dtype"):
        norm.add(x, r, out_dtype=torch.long)
    s, y = norm.add(x.bfloat16(), r.bfloat16())
    assert s.dtype == y.dtype == torch.bfloat16
