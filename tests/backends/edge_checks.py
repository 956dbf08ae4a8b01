"""The edge checks of tests/test_edge_inputs.py for one compiled backend: outputs that take in-place
updates (eager and through the custom op), and empty inputs that give what PyTorch gives (the
kernels are never asked to compile for zero-size rows)."""
from __future__ import annotations

import contextlib

import pytest

from edge_cases import CASES, PassThrough, assert_same, outputs_and_grads, shapes

# fp32 kernels against fp32 PyTorch; the MLIR backend's math library differs in the last bits.
TOL = dict(atol=2e-5, rtol=2e-5)


def cases(empty: bool):
    return [pytest.param(name, shape, id=f"{name}-{label}") for name in CASES
            for label, shape in shapes(name, empty).items()]


def check_inplace(backend: str, name: str, shape, traced: bool) -> None:
    make, fused, plain, n_grad = CASES[name]
    inputs = make(shape)
    want = outputs_and_grads(plain, inputs, n_grad, inplace=name)
    with PassThrough() if traced else contextlib.nullcontext():
        got = outputs_and_grads(lambda *a: fused(*a, backend), inputs, n_grad, inplace=name)
    assert_same(got[0] + got[1], want[0] + want[1], **TOL)


def check_empty(backend: str, name: str, shape) -> None:
    make, fused, plain, n_grad = CASES[name]
    inputs = make(shape)
    got = outputs_and_grads(lambda *a: fused(*a, backend), inputs, n_grad)
    want = outputs_and_grads(plain, inputs, n_grad)
    assert_same(got[0] + got[1], want[0] + want[1], **TOL)
