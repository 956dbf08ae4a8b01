"""What the norm kernels' tests share: a backend module by name, and row-strided views of a tensor."""
from __future__ import annotations

import importlib

import pytest
import torch


def backend_module(name: str, request):
    """``torchfuser.backends.<name>``; Triton's under the ``interpreter`` fixture, MLIR's with a fresh cache (or skipped)."""
    if name == "triton":
        return request.getfixturevalue("interpreter")
    if name == "mlir":
        pytest.importorskip("torch_mlir")
        request.getfixturevalue("mlir_tmp_cache")
    return importlib.import_module(f"torchfuser.backends.{name}")


def row_strided(t: torch.Tensor, pad: int = 5) -> torch.Tensor:
    """``t``'s values as a view whose rows are ``pad`` elements apart more than their width."""
    return torch.cat([t, torch.full_like(t[..., :pad], 3.0)], dim=-1)[..., : t.shape[-1]]
