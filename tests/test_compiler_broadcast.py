"""Every region of a broadcast pattern compiles through MLIR, and the result is right.

Issue 35: ``@torchfuser.jit`` on ``silu(x) * y + 0.5 * sin(b)`` with x, y of n × n and b of n ran its
forward region eagerly ("The size of tensor a (64) must match the size of tensor b (32)"): the
region compiler took every input whose dim 0 had the row count for a row input, so b — which
broadcasts along x's *last* dim — was split by rows. A region that falls back runs right but slow,
so the parity checks alone never saw it: these tests ask the compile records that every region,
forward and backward, was compiled by MLIR, then check the forward and every gradient against the
function run eagerly in float64. Square shapes on purpose: that is where dim 0 sizes coincide.
"""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

import torchfuser
from numerics import assert_within_rule, needs_mlir

pytestmark = needs_mlir


@pytest.fixture(autouse=True)
def _fresh(monkeypatch, tmp_path):
    # an empty kernel cache of our own, on disk and in memory: every region compiles here
    from torchfuser.backends.mlir import cache

    monkeypatch.setenv("TORCHFUSER_CACHE_DIR", str(tmp_path))
    cache.clear_memory()
    torch._dynamo.reset()
    yield
    cache.clear_memory()


def chain(x, y, b):  # issue 35's function: b[n] broadcasts along the last dim of x[n, n]
    return F.silu(x) * y + 0.5 * torch.sin(b)


def chain_bias_first(b, x, y):  # b is traced first: the region's first input is the 1-D one
    return 0.5 * torch.sin(b) + F.silu(x) * y


def column(x, c):  # c[n, 1]: one value per row
    return torch.tanh(x) * c + c


def scalar(x, s):  # s: a 0-d tensor with a gradient
    return torch.sigmoid(x) * s + x * x


def scalar_first(s, x):
    return s * torch.sigmoid(x) + x * x


def middle(x, w, b):  # x[B, S, H], w[B, 1, H] broadcast over S, b[H] with H = B
    return torch.exp(-x * x) * w + b


def row_values(x, w, b):  # a lower-rank *row* input (w: one value per row after the reduction)
    return (x * x).sum(-1) * w, torch.tanh(x) + b  # ... beside a lower-rank broadcast one (b)


def _r(*shape, dtype=torch.float32):
    return torch.randn(shape).to(dtype).requires_grad_()


PATTERNS = {
    "row_vector_64": (chain, lambda: [_r(64, 64), _r(64, 64), _r(64)]),
    "row_vector_40": (chain, lambda: [_r(40, 40), _r(40, 40), _r(40)]),
    "row_vector_rect": (chain, lambda: [_r(48, 64), _r(48, 64), _r(64)]),
    "bias_first_40": (chain_bias_first, lambda: [_r(40), _r(40, 40), _r(40, 40)]),
    "bias_first_rect": (chain_bias_first, lambda: [_r(64), _r(48, 64), _r(48, 64)]),
    "column": (column, lambda: [_r(40, 40), _r(40, 1)]),
    "scalar": (scalar, lambda: [_r(40, 40), _r()]),
    "scalar_first": (scalar_first, lambda: [_r(), _r(40, 40)]),
    "middle_3d": (middle, lambda: [_r(8, 5, 8), _r(8, 1, 8), _r(8)]),
    "row_values_and_bias": (row_values, lambda: [_r(40, 40), _r(40), _r(40)]),
}


def _leaves(args):
    return [a for a in args if a.requires_grad]


def _run(fn, args):
    out = fn(*args)
    outs = out if isinstance(out, tuple) else (out,)
    # weights of the output gradient: not all ones, so that a wrong broadcast cannot cancel out
    gouts = [torch.linspace(-1, 2, o.numel(), dtype=torch.float64).reshape(o.shape).to(o.dtype) for o in outs]
    return outs, torch.autograd.grad(outs, _leaves(args), gouts)


def _as(args, dtype):
    return [a.detach().to(dtype).requires_grad_(a.requires_grad) for a in args]


def _regions_all_mlir(jitted):
    regions = [r for rec in jitted.records for r in rec.regions]
    assert {r.graph for r in regions} >= {"forward", "backward"}, regions
    eager = [(r.graph, r.name, r.compiled_by) for r in regions if r.compiled_by != "mlir"]
    notes = [n for rec in jitted.records for n in rec.notes]
    assert not eager, f"regions not compiled by MLIR: {eager}; notes: {notes}"


@pytest.mark.parametrize("name", list(PATTERNS))
def test_every_region_of_a_broadcast_pattern_compiles_and_is_right(name):
    fn, make = PATTERNS[name]
    args = make()
    f = torchfuser.jit(fn)
    outs, grads = _run(f, args)
    _regions_all_mlir(f)
    outs64, grads64 = _run(fn, _as(args, torch.float64))
    for got, want in list(zip(outs, outs64)) + list(zip(grads, grads64)):
        assert got.shape == want.shape
        torch.testing.assert_close(got.double(), want, atol=3e-5, rtol=3e-5)


def test_mixed_dtypes_broadcast_compiles_and_is_right():
    """bf16 x, y with an fp32 b[n] (the output promotes to fp32): every region MLIR, the forward and
    every gradient within the low-precision rule against float64."""
    x, y = _r(40, 40, dtype=torch.bfloat16), _r(40, 40, dtype=torch.bfloat16)
    b = _r(40)
    args = [x, y, b]
    f = torchfuser.jit(chain)
    outs, grads = _run(f, args)
    _regions_all_mlir(f)
    same, same_grads = _run(chain, [a.detach().requires_grad_() for a in args])  # eager, same dtypes
    outs64, grads64 = _run(chain, _as(args, torch.float64))
    for i, (got, ref, want) in enumerate(list(zip(outs, same, outs64)) + list(zip(grads, same_grads, grads64))):
        assert got.dtype == ref.dtype
        assert_within_rule(got, ref, want, atol=1e-5, what=f"tensor {i}")


def test_explain_says_every_region_of_issue_35s_chain_is_mlir(capsys):
    """What a user runs to see it: ``explain`` lists the regions, each compiled by MLIR."""
    f = torchfuser.jit(chain)
    e = f.explain(_r(64, 64), _r(64, 64), _r(64), print_=False)
    assert e.regions and all(r.compiled_by == "mlir" for r in e.regions), str(e)
    assert {r.graph for r in e.regions} == {"forward", "backward"}


def constant_for_a_matmul(x, w):
    return torch.sigmoid(x) * 3, torch.full((8, 16), 2.0, dtype=w.dtype) @ w


def test_independent_parts_are_regions_of_their_own_and_constants_no_region():
    """The partitioner groups independent computations; each part with inputs is a region of its
    own (all MLIR), and a constant that reads no input stays an ATen call, not an eager region."""
    x, w = _r(8, 16), _r(16, 4)
    f = torchfuser.jit(constant_for_a_matmul)
    outs, grads = _run(f, [x, w])
    _regions_all_mlir(f)
    assert "torch.ops.aten.full.default" in f.records[0].graphs["forward regions"]
    outs64, grads64 = _run(constant_for_a_matmul, _as([x, w], torch.float64))
    for got, want in list(zip(outs, outs64)) + list(zip(grads, grads64)):
        torch.testing.assert_close(got.double(), want, atol=3e-5, rtol=3e-5)
