"""The backends' residual add + LayerNorm: add_layer_norm_fwd(x, r, w, b) -> (s, y, mean, rstd) and
layer_norm_res_bwd(..., dres) -> (dx + dres, dw, db), called directly (no autograd, no custom ops).

s must be torch's own x + r and y, mean, rstd layer_norm_fwd(s); every output is held to the
docs/numerics.md rule against float64 from plain torch ops. Triton runs under the interpreter.
"""
from __future__ import annotations

import importlib

import pytest
import torch

from norm_kernel_helpers import backend_module, row_strided

import test_triton_ops
from numerics import ATOL, assert_within_rule

interpreter, DEVICE = test_triton_ops.interpreter, test_triton_ops.DEVICE

EPS = 1e-5
F32, BF16 = torch.float32, torch.bfloat16
DTYPES = [(F32, F32), (BF16, BF16), (F32, BF16)]  # (x, r): the residual stream and a block's output


def _plain(x, r, w, b, dy, dres, dtype):
    """s, y, dx (+ dres), dw, db by plain torch ops in ``dtype``."""
    s = (x.to(dtype) + r.to(dtype)).detach().requires_grad_()
    wd = w.detach().to(dtype).requires_grad_()
    bd = None if b is None else b.detach().to(dtype).requires_grad_()
    y = torch.nn.functional.layer_norm(s, s.shape[-1:], wd, bd, EPS)
    grads = torch.autograd.grad(y, [t for t in (s, wd, bd) if t is not None], dy.to(dtype))
    return (s.detach(), y.detach(), grads[0] + dres.to(dtype), grads[1], grads[2] if b is not None else None)


def _check(B, shape, dts, bias, strided, device):
    xd, rd = dts
    sd = torch.result_type(torch.empty(0, dtype=xd), torch.empty(0, dtype=rd))
    gen = torch.Generator().manual_seed(0)
    rand = lambda *sh, dt: torch.randn(*sh, generator=gen).to(device, dt)  # noqa: E731
    x, r, dy, dres = rand(*shape, dt=xd) + 0.5, rand(*shape, dt=rd), rand(*shape, dt=sd), rand(*shape, dt=sd)
    if strided:
        x, dres = row_strided(x), row_strided(dres)
    w = rand(shape[-1], dt=sd)
    b = rand(shape[-1], dt=sd) if bias else None
    s, y, mean, rstd = B.add_layer_norm_fwd(x, r, w, b, EPS)
    assert (s.dtype, y.dtype, mean.dtype, rstd.dtype) == (sd, sd, F32, F32)
    assert torch.equal(s, x + r), "s is not torch's x + r"
    y1, mean1, rstd1 = B.layer_norm_fwd(s, w, b, EPS)
    torch.testing.assert_close(y, y1, rtol=0, atol=1e-6 if sd == F32 else 8e-3)
    torch.testing.assert_close(rstd, rstd1, rtol=1e-6, atol=0)
    dx, dw, db = B.layer_norm_res_bwd(dy, s, w, b, mean, rstd, EPS, dres)
    assert dx.dtype == sd and dx.shape == s.shape and dx.is_contiguous()
    assert (db.numel() == 0) == (b is None)
    dx0, dw0, _ = B.layer_norm_res_bwd(dy, s, w, b, mean, rstd, EPS)
    torch.testing.assert_close(dw, dw0, rtol=1e-6, atol=1e-6)
    ref = _plain(x, r, w, b, dy, dres, torch.float64)
    same = _plain(x, r, w, b, dy, dres, sd)
    for name, got, sm, rf in zip(("s", "y", "dx", "dw", "db"), (s, y, dx, dw, db if b is not None else None), same, ref):
        if rf is not None:
            assert_within_rule(got, sm, rf, ATOL[sd] * max(1.0, rf.abs().max().item()), f"{name} {shape} {dts}")


@pytest.mark.parametrize("backend", ["triton", "reference"])
@pytest.mark.parametrize("shape", [(1, 64), (37, 123), (2, 5, 96)], ids=lambda s: "x".join(map(str, s)))
@pytest.mark.parametrize("dts", DTYPES, ids=lambda d: "+".join(str(t)[6:] for t in d))
@pytest.mark.parametrize("bias", [True, False], ids=["bias", "nobias"])
def test_add_layer_norm(backend, shape, dts, bias, request):
    _check(backend_module(backend, request), shape, dts, bias, shape == (37, 123), DEVICE)


def test_add_layer_norm_mlir(request):
    _check(backend_module("mlir", request), (2, 5, 96), (F32, F32), True, True, "cpu")


@pytest.mark.parametrize("dts", DTYPES[:2], ids=["f32", "bf16"])
def test_add_layer_norm_looped_path(dts, request, monkeypatch):
    """The chunked path of rows longer than MAX_FUSED, forced on 123-wide rows with 32-wide chunks: the
    forward's later passes recompute s, the backward adds dres per chunk."""
    B = backend_module("triton", request)
    monkeypatch.setattr(importlib.import_module(B.__name__ + ".layer_norm"), "norm_config",
                        lambda *a, **k: (32, 1, False, 1))
    _check(B, (37, 123), dts, True, True, DEVICE)


@pytest.mark.parametrize("backend", ["triton", "reference"])
def test_shapes_must_match(backend, request):
    B = backend_module(backend, request)
    x, w = torch.randn(4, 8, device=DEVICE), torch.randn(8, device=DEVICE)
    with pytest.raises(ValueError, match="same shape"):
        B.add_layer_norm_fwd(x, torch.randn(2, 4, 8, device=DEVICE), w, None, EPS)
    _, _, mean, rstd = B.add_layer_norm_fwd(x, x, w, None, EPS)
    with pytest.raises(ValueError, match="dres"):
        B.layer_norm_res_bwd(x, x, w, None, mean, rstd, EPS, torch.randn(1, 8, device=DEVICE))


@pytest.mark.parametrize("backend", ["triton", "reference", "mlir"])
@pytest.mark.parametrize("dtype", [F32, BF16], ids=["f32", "bf16"])
@pytest.mark.parametrize("d, rd", [(16, 4), (12, 6)])
def test_partial_rotary_in_the_kernel(backend, dtype, d, rd, request):
    """rope with cos/sin narrower than the head (NeoX's rotary_pct, Phi's partial_rotary_factor): the first rd
    channels as rope on them alone, the rest copied through bit for bit, forward and backward."""
    B = backend_module(backend, request)
    device = "cpu" if backend == "mlir" else DEVICE
    gen = torch.Generator().manual_seed(2)
    q, k = (torch.randn(2, h, 5, d, generator=gen).to(device, dtype) for h in (4, 2))
    cos, sin = (torch.randn(1, 5, rd, generator=gen).to(device) for _ in range(2))
    for fn in (B.rope_fwd, B.rope_bwd):
        qo, ko = fn(q, k, cos, sin)
        qr, kr = fn(q[..., :rd].contiguous(), k[..., :rd].contiguous(), cos, sin)
        for out, part, full in ((qo, qr, q), (ko, kr, k)):
            assert out.shape == full.shape and out.dtype == dtype
            assert torch.equal(out[..., rd:], full[..., rd:])
            torch.testing.assert_close(out[..., :rd], part, rtol=0, atol=0 if backend != "triton" else 1e-6)
