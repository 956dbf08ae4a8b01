"""Edge inputs on the MLIR backend (tests/backends/edge_checks.py)."""
from __future__ import annotations

import pytest
import torch

from edge_checks import cases, check_empty, check_inplace
from numerics import needs_mlir
from torchfuser.backends import kernel

pytestmark = [needs_mlir, pytest.mark.usefixtures("mlir_tmp_cache")]


@pytest.mark.parametrize("name,shape", cases(empty=False))
@pytest.mark.parametrize("traced", [False, True], ids=["eager", "custom_op"])
def test_output_takes_inplace_update(name, shape, traced):
    check_inplace("mlir", name, shape, traced)


@pytest.mark.parametrize("name,shape", cases(empty=True))
def test_empty_input_gives_what_pytorch_gives(name, shape):
    check_empty("mlir", name, shape)


def test_zero_width_rows_are_refused_before_compiling():
    """Called directly (not through torchfuser.functional, which routes empty tensors to the
    reference backend), the kernel says what is wrong instead of failing in MLIR's parser."""
    with pytest.raises(ValueError, match="zero-size rows"):
        kernel("mlir", "rms_norm_fwd")(torch.randn(3, 0), torch.randn(0), 1e-6, 0.0)
