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
