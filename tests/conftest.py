import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).parent))


@pytest.fixture(autouse=True)
def _seed():
    torch.manual_seed(0)


@pytest.fixture(autouse=True)
def _fuse_cpu_blocks_without_mlir(request, monkeypatch):
    """Without torch-mlir (the GPU machine has none), ``backend="auto"`` leaves CPU blocks to PyTorch
    (backends/policy.py). The suite's CPU tests are about the fused blocks, so there they are fused as
    ``backend="reference"`` fuses them; tests/test_cpu_default_policy.py tests the policy itself."""
    if request.module.__name__ == "test_cpu_default_policy":
        return
    from torchfuser import backends
    from torchfuser.backends import policy

    if backends.unavailable_reason("mlir", "cpu") is not None:
        monkeypatch.setattr(policy, "held", lambda *args, **kwargs: None)
