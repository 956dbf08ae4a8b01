"""Edge inputs on the Triton backend, interpreted on the CPU (tests/backends/edge_checks.py)."""
from __future__ import annotations

import pytest

from edge_checks import cases, check_empty, check_inplace
from test_triton_ops import DEVICE, interpreter  # noqa: F401  (the module-scoped TRITON_INTERPRET=1 fixture)

pytestmark = pytest.mark.skipif(DEVICE != "cpu", reason="the edge cases build CPU tensors")


@pytest.mark.parametrize("name,shape", cases(empty=False))
@pytest.mark.parametrize("traced", [False, True], ids=["eager", "custom_op"])
def test_output_takes_inplace_update(name, shape, traced):
    check_inplace("triton", name, shape, traced)


@pytest.mark.parametrize("name,shape", cases(empty=True))
def test_empty_input_gives_what_pytorch_gives(name, shape):
    check_empty("triton", name, shape)
