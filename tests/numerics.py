"""The numerics rule (docs/numerics.md), shared by the op tests of every backend."""
from __future__ import annotations

import pytest
import torch

from torchfuser.backends import unavailable_reason

_NO_MLIR = unavailable_reason("mlir", "cpu")
# Tests of what the MLIR backend compiles: skipped where torch-mlir is not installed (the GPU machine).
needs_mlir = pytest.mark.skipif(_NO_MLIR is not None, reason=_NO_MLIR or "")


def max_err(a: torch.Tensor, ref: torch.Tensor) -> float:
    return (a.double() - ref.double()).abs().max().item()


def assert_within_rule(fused: torch.Tensor, same_dtype: torch.Tensor, ref64: torch.Tensor, atol: float, what: str = "") -> None:
    """max|fused − ref64| ≤ 2 · max|torch_same_dtype − ref64| + atol."""
    assert fused.shape == ref64.shape, f"{what}: shape {tuple(fused.shape)} != {tuple(ref64.shape)}"
    assert torch.isfinite(fused).all(), f"{what}: non-finite values"
    err, base = max_err(fused, ref64), max_err(same_dtype, ref64)
    assert err <= 2 * base + atol, f"{what}: fused error {err:.3e} > 2 × torch error {base:.3e} + {atol:.1e}"


ATOL = {torch.float32: 1e-5, torch.bfloat16: 1e-2, torch.float16: 1e-3}


def assert_trains_like(ref, fused, step, keys, loss_rtol: float = 1e-6) -> None:
    """One fp32 training step of ``fused`` (fused in place, ``state_dict`` keys ``keys``) against ``ref``: the loss,
    every gradient (none where none), no call-time fallback; then ``restore`` gives the keys back."""
    import torchfuser
    from torchfuser.modules import fallbacks

    assert list(fused.state_dict()) == keys
    loss_ref, loss = step(ref), step(fused)
    torch.testing.assert_close(loss, loss_ref, rtol=loss_rtol, atol=1e-6)
    for (n, a), (_, b) in zip(ref.named_parameters(), fused.named_parameters()):
        assert (a.grad is None) == (b.grad is None), n
        if a.grad is not None:
            torch.testing.assert_close(b.grad, a.grad, rtol=1e-5, atol=1e-6, msg=n)
    assert not fallbacks.counts(fused), fallbacks.counts(fused)  # every call ran fused
    torchfuser.restore(fused)
    assert list(fused.state_dict()) == keys
