"""The hi/lo operand split of the fused LoRA node (backends/triton/hilo_split.py): the Triton kernel
(interpreted on the CPU: TRITON_INTERPRET=1; compiled on a GPU where there is one) against the torch
spelling (backends/reference/hilo_split.py), bit for bit, and both against the definition
hi = bf16(t·s), lo = bf16(t·s − hi): every layout the node uses ("hl" along rows, "hlh" / "hhl" along
columns), with and without a scale, a single row, odd sizes, a strided column slice (the node splits
columns of h), special values (±inf, NaN, the largest fp32; subnormal parts on a GPU only), and bf16 input (lo = 0)."""
from __future__ import annotations

import pytest
import torch

from test_triton_ops import DEVICE, interpreter  # noqa: F401  (module fixture: the interpreted backend)
from torchfuser.backends.reference import hilo_split as ref_split  # the function (the package exports it)

pytest.importorskip("triton")

SHAPES = [(1, 1), (1, 130), (123, 77), (16, 64), (33, 8)]
LAYOUTS = [("hl", 0), ("hlh", 1), ("hhl", 1), ("hl", 1), ("hlh", 0)]


def _source(shape, seed=0):
    g = torch.Generator().manual_seed(seed + sum(shape))
    return torch.randn(*shape, generator=g) * torch.exp2(torch.randint(-20, 20, shape, generator=g).float())


def _definition(t, parts, dim, scale):
    u = t.float() * scale if scale != 1 else t.float()
    hi = u.to(torch.bfloat16)
    lo = (u - hi.float()).to(torch.bfloat16)
    return torch.cat([hi if p == "h" else lo for p in parts], dim)


def _same_bits(a, b):
    assert a.dtype == b.dtype and a.shape == b.shape
    assert torch.equal(a.view(torch.int16), b.view(torch.int16))


@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "x".join(map(str, s)))
@pytest.mark.parametrize("parts,dim", LAYOUTS, ids=lambda v: str(v))
@pytest.mark.parametrize("scale", [1.0, 0.3125, 2.7], ids=str)
def test_bit_exact(interpreter, shape, parts, dim, scale):  # noqa: F811
    t = _source(shape)
    want = ref_split(t, parts, dim, torch.bfloat16, scale)
    _same_bits(want, _definition(t, parts, dim, scale))
    got = interpreter.hilo_split(t.to(DEVICE), parts, dim, torch.bfloat16, scale).cpu()
    _same_bits(got, want)
    assert got.is_contiguous()


def test_strided_column_slice_and_transpose(interpreter):  # noqa: F811
    h = _source((37, 24), 1)
    for view in (h[:, 8:16], h.t(), h[::2]):
        want = ref_split(view, "hlh", 1, torch.bfloat16, 0.5)
        _same_bits(interpreter.hilo_split(view.to(DEVICE), "hlh", 1, torch.bfloat16, 0.5).cpu(), want)


def test_special_values(interpreter):  # noqa: F811
    f = torch.finfo(torch.float32)
    vals = [0.0, -0.0, f.tiny * 2, -f.tiny * 3.3, f.max, -f.max, float("inf"), float("-inf"), float("nan"),
            1 + 2 ** -9, 1 + 2 ** -8 + 2 ** -20, 3.0e38, -1e-30]
    if DEVICE == "cuda":  # subnormal parts: Triton 3.6's interpreter rounds fp32 subnormals to bf16 wrongly
        vals += [f.tiny / 8, f.tiny, -1e-40, 5e-41]  # (its own cast: 8.2e-42 gives 54 ulps, not 0)
    vals = torch.tensor(vals)
    t = vals.repeat(3, 1)
    for scale in (1.0, 0.5):
        want = ref_split(t, "hl", 0, torch.bfloat16, scale)
        got = interpreter.hilo_split(t.to(DEVICE), "hl", 0, torch.bfloat16, scale).cpu()
        assert torch.equal(got.isnan(), want.isnan())
        _same_bits(torch.where(want.isnan(), 0, got), torch.where(want.isnan(), 0, want))


def test_bf16_source_has_zero_lo(interpreter):  # noqa: F811
    t = _source((9, 12)).to(torch.bfloat16)
    got = interpreter.hilo_split(t.to(DEVICE), "hl", 0, torch.bfloat16).cpu()
    _same_bits(got, ref_split(t, "hl", 0, torch.bfloat16))
    assert torch.equal(got[9:], torch.zeros_like(t)) and torch.equal(got[:9], t)


def test_empty_and_bad_layouts(interpreter):  # noqa: F811
    e = torch.empty(0, 5, device=DEVICE)
    assert interpreter.hilo_split(e, "hl", 0, torch.bfloat16).shape == (0, 5)
    for parts, dim in (("hh", 0), ("hl", 2), ("hxl", 1)):
        with pytest.raises(ValueError, match="hilo_split"):
            interpreter.hilo_split(torch.ones(2, 2, device=DEVICE), parts, dim, torch.bfloat16)
