"""The backends' residual add + RMSNorm: add_rms_norm_fwd(x, r, w) -> (s, y, rstd) and
rms_norm_bwd(..., dres) -> (dx + dres, dw), called directly (no autograd, no custom ops).

s must be torch's own x + r (one add, torch's type promotion) and y, rstd exactly rms_norm_fwd(s);
s, y, rstd, dx and dw are held to the docs/numerics.md rule against float64 built from plain torch ops.
The Triton kernels run under the interpreter (test_triton_ops's fixture, autouse here too).
"""
from __future__ import annotations

import importlib

import pytest
import torch

from norm_kernel_helpers import backend_module, row_strided

import test_triton_ops
from numerics import ATOL, assert_within_rule

# test_triton_ops's module fixture (autouse here too): the Triton backend, interpreted on a CPU.
interpreter, DEVICE = test_triton_ops.interpreter, test_triton_ops.DEVICE

EPS = 1e-6
F32, BF16 = torch.float32, torch.bfloat16
DTYPES = [(F32, F32), (BF16, BF16), (F32, BF16)]  # (x, r): the residual stream and a projection's output
CASES = [  # (shape, the inputs read through row-strided views)
    ((1, 64), ()),
    ((37, 123), ()),
    ((2, 5, 96), ()),
    ((37, 123), ("x", "dres")),
    ((37, 123), ("r", "dy")),  # other strides than x's: a kernel reading r with x's stride fails
]


def _ids(dts):
    return "+".join(str(d)[6:] for d in dts)


def _plain_rms(s, w, offset):
    """RMSNorm as plain torch ops in s's dtype: (y, rstd)."""
    rstd = torch.rsqrt(s.pow(2).mean(-1) + EPS)
    return s * rstd.unsqueeze(-1) * (offset + w), rstd


def _plain_fwd_bwd(x, r, w, dy, dres, offset, dtype):
    """s, y, rstd, dx (+ dres) and dw by plain torch ops, all in ``dtype``."""
    s = (x.to(dtype) + r.to(dtype)).detach().requires_grad_()
    wd = w.detach().to(dtype).requires_grad_()
    y, rstd = _plain_rms(s, wd, offset)
    ds, dw = torch.autograd.grad(y, (s, wd), dy.to(dtype))
    return s.detach(), y.detach(), rstd.detach(), ds + dres.to(dtype), dw


def _same(a, b, what, exact=True):
    """Bit for bit under the interpreter; compiled for a GPU, the fused kernel may contract the add into
    an FMA or order a reduction differently: then equal to a few fp32 ulps (one bf16 ulp). ``exact=False``:
    a and b come from different kernels (one-pass and looped), whose row sums are ordered differently."""
    if a.device.type == "cpu" and exact:
        assert torch.equal(a, b), what
    else:
        tol = 2e-6 if a.dtype == F32 else 8e-3
        torch.testing.assert_close(a, b, rtol=tol, atol=tol, msg=what)


def _check(B, shape, strided, dts, device, exact=True):
    xd, rd = dts
    sd = torch.result_type(torch.empty(0, dtype=xd), torch.empty(0, dtype=rd))
    offset = 1.0 if shape[-1] == 123 else 0.0  # Gemma's (1 + w) on some cases
    gen = torch.Generator().manual_seed(0)
    rand = lambda *sh, dt: torch.randn(*sh, generator=gen).to(device, dt)  # noqa: E731  never zeros
    t = {"x": rand(*shape, dt=xd), "r": rand(*shape, dt=rd), "dy": rand(*shape, dt=sd), "dres": rand(*shape, dt=sd)}
    x, r, dy, dres = (row_strided(v, 7) if k in strided else v for k, v in t.items())
    w = rand(shape[-1], dt=sd)

    s, y, rstd = B.add_rms_norm_fwd(x, r, w, EPS, offset)
    assert (s.dtype, y.dtype, rstd.dtype) == (sd, sd, F32) and rstd.shape == shape[:-1]
    assert all(o.is_contiguous() for o in (s, y, rstd))
    assert torch.equal(s, x + r), "s is not torch's x + r"
    y1, rstd1 = B.rms_norm_fwd(s, w, EPS, offset)
    _same(y, y1, "y differs from rms_norm_fwd(s)")
    _same(rstd, rstd1, "rstd differs from rms_norm_fwd(s)")

    dx, dw = B.rms_norm_bwd(dy, s, w, rstd, EPS, offset, dres)
    assert (dx.dtype, dw.dtype) == (sd, sd) and dx.is_contiguous() and dx.shape == shape
    dx0, dw0 = B.rms_norm_bwd(dy, s, w, rstd, EPS, offset)
    if exact:
        assert torch.equal(dw, dw0), "dres changed dw"
    else:
        _same(dw, dw0, "dres changed dw", exact)
    if sd == F32:  # the norm's dx is exact in fp32 before the add: one rounding either way
        _same(dx, dx0 + dres, "dx != the norm's dx + dres", exact)

    dx3, dr, dw3 = B.add_rms_norm_bwd(dy, s, w, rstd, EPS, offset, dres, rd)
    assert dr.dtype == rd and dr.is_contiguous()
    # Another specialisation of the same kernel (it also stores dr): compiled, its code may differ.
    _same(dx3, dx, "add_rms_norm_bwd's dx differs from rms_norm_bwd's with dres")
    _same(dw3, dw, "add_rms_norm_bwd's dw differs from rms_norm_bwd's")
    assert torch.equal(dr, dx3.to(rd)), "the residual branch's gradient is not dx rounded to its dtype"

    ref = _plain_fwd_bwd(x, r, w, dy, dres, offset, torch.float64)
    same = _plain_fwd_bwd(x, r, w, dy, dres, offset, sd)
    for name, got, sm, rf in zip(("s", "y", "rstd", "dx", "dw"), (s, y, rstd, dx, dw), same, ref):
        assert_within_rule(got, sm, rf, ATOL[sd] * max(1.0, rf.abs().max().item()), f"{name} {shape} {_ids(dts)}")


def _params():
    for b in ("triton", "reference"):
        for shape, strided in CASES:
            for dts in DTYPES:
                yield pytest.param(b, shape, strided, dts, id=f"{b}-{'x'.join(map(str, shape))}-{_ids(dts)}-{'+'.join(strided) or 'dense'}")
    yield pytest.param("mlir", (2, 5, 96), ("x", "dres"), (F32, BF16), id="mlir-2x5x96-float32+bfloat16-x+dres")


@pytest.mark.parametrize("backend,shape,strided,dts", list(_params()))
def test_add_rms_norm(backend, shape, strided, dts, request):
    _check(backend_module(backend, request), shape, strided, dts, "cpu" if backend == "mlir" else DEVICE)


@pytest.mark.parametrize("dts", DTYPES, ids=_ids)
def test_add_rms_norm_looped_path(dts, request, monkeypatch):
    """The chunked path of rows longer than MAX_FUSED, forced on 123-wide rows with 32-wide chunks
    (four per row, the last one partial): the forward recomputes s in its second pass."""
    B = backend_module("triton", request)
    looped = lambda *args, **kwargs: (32, 1, False, 1)  # noqa: E731
    monkeypatch.setattr(importlib.import_module(B.__name__ + ".rms_norm"), "norm_config", looped)
    _check(B, (37, 123), ("x", "dres"), dts, DEVICE)


def test_wide_rows_with_the_residual_gradient_take_the_looped_backward(request):
    """Past 8192 elements a backward that adds dres walks its row in chunks (it spills holding five
    rows in registers), one without dres stays one-pass up to MAX_FUSED; both compute the same."""
    B = backend_module("triton", request)
    rn = importlib.import_module(B.__name__ + ".rms_norm")
    assert rn.norm_config(8192, True, dres=True)[2] and rn.norm_config(12288, True)[2]
    assert not rn.norm_config(8200, True, dres=True)[2] and rn.norm_config(8200, False, dres=True)[2]
    _check(B, (3, 8200), ("dres",), (F32, BF16), DEVICE, exact=False)  # with dres looped, without one-pass


@pytest.mark.parametrize("backend", ["triton", "reference", "mlir"])
def test_shapes_must_match(backend, request):
    B, device = backend_module(backend, request), "cpu" if backend == "mlir" else DEVICE
    x, w = torch.randn(4, 8, device=device), torch.randn(8, device=device)
    with pytest.raises(ValueError, match="same shape"):
        B.add_rms_norm_fwd(x, torch.randn(2, 4, 8, device=device), w, EPS, 0.0)  # would broadcast: refused
    _, _, rstd = B.add_rms_norm_fwd(x, x, w, EPS, 0.0)
    with pytest.raises(ValueError, match="dres"):
        B.rms_norm_bwd(x, x, w, rstd, EPS, 0.0, torch.randn(1, 8, device=device))


@pytest.mark.parametrize("backend", ["triton", "reference", "mlir"])
def test_low_precision_output_and_its_gradient(backend, request):
    """A norm asked for a bf16 output (the projections after it cast to bf16 anyway): y is the fp32
    result rounded once, and a bf16 dy is read as the fp32 value it is."""
    B, device = backend_module(backend, request), "cpu" if backend == "mlir" else DEVICE
    gen = torch.Generator().manual_seed(4)
    x, r, dres = (torch.randn(37, 123, generator=gen).to(device) for _ in range(3))
    w = torch.randn(123, generator=gen).to(device)
    y32, rstd = B.rms_norm_fwd(x, w, EPS, 0.0)
    y16, rstd16 = B.rms_norm_fwd(x, w, EPS, 0.0, BF16)
    assert y16.dtype == BF16
    _same(y16, y32.to(BF16), "bf16 y")
    _same(rstd16, rstd, "rstd")
    s, ys32, _ = B.add_rms_norm_fwd(x, r.to(BF16), w, EPS, 0.0)
    s16, ys16, _ = B.add_rms_norm_fwd(x, r.to(BF16), w, EPS, 0.0, BF16)
    assert torch.equal(s16, s) and ys16.dtype == BF16
    _same(ys16, ys32.to(BF16), "bf16 y of s")
    dy = torch.randn(37, 123, generator=gen).to(device, BF16)
    for extra in (None, dres):
        dx16, dw16 = B.rms_norm_bwd(dy, x, w, rstd, EPS, 0.0, extra)
        dx32, dw32 = B.rms_norm_bwd(dy.float(), x, w, rstd, EPS, 0.0, extra)
        assert dx16.dtype == F32
        _same(dx16, dx32, "dx from a bf16 dy")
        _same(dw16, dw32, "dw from a bf16 dy")
