"""Norm then add: the backends' rms_norm_add_fwd(a, r, w, …, y_dtype) -> (out, rstd) and rms_norm_add_bwd(dout, a,
w, rstd, …, y_dtype) -> (da, dw), called directly, and the op (ops.rms_norm_add) through autograd.

out must be exactly the backend's own norm rounded to y's dtype plus r (torch's add), and out, da, dr, dw are held to
the docs/numerics.md rule against float64 from plain torch ops. Triton runs under the interpreter.
"""
from __future__ import annotations

import importlib

import pytest
import torch

from norm_kernel_helpers import backend_module, row_strided

import test_triton_ops
from numerics import ATOL, assert_within_rule, needs_mlir

interpreter, DEVICE = test_triton_ops.interpreter, test_triton_ops.DEVICE

EPS = 1e-6
F32, BF16, F16 = torch.float32, torch.bfloat16, torch.float16
# (a, r, y): a block's output, the residual stream, the norm's output dtype (None: a's)
DTYPES = [(F32, F32, None), (BF16, BF16, None), (F16, F16, None), (BF16, F32, None), (BF16, F32, F32), (F32, F32, BF16)]


def _ids(d):
    return "+".join("-" if t is None else str(t)[6:] for t in d)


def _plain(a, r, w, offset, dout, y_dtype, dtype):
    """out, da, dr, dw by plain torch ops: in ``dtype`` (float64: no rounding anywhere), else as the unfused model
    computes them (the norm in fp32, rounded to y's dtype, then torch's add)."""
    if dtype == torch.float64:
        a_, r_, w_ = (t.detach().double().requires_grad_() for t in (a, r, w))
        y = a_ * torch.rsqrt(a_.pow(2).mean(-1, keepdim=True) + EPS) * (w_ + offset)
        g = dout.double()
    else:
        a_, r_, w_ = (t.detach().requires_grad_() for t in (a, r, w))
        af = a_.float()
        y = (af * torch.rsqrt(af.pow(2).mean(-1, keepdim=True) + EPS) * (w_.float() + offset)).to(y_dtype or a.dtype)
        g = dout
    out = r_ + y
    return (out.detach(), *torch.autograd.grad(out, (a_, r_, w_), g))


def _check(B, shape, dts, offset, strided, device, exact=True):
    ad, rd, yd = dts
    od = torch.promote_types(rd, yd or ad)
    gen = torch.Generator().manual_seed(0)
    rand = lambda *sh, dt: torch.randn(*sh, generator=gen).to(device, dt)  # noqa: E731
    a, r, dout, w = rand(*shape, dt=ad) * 3 + 0.5, rand(*shape, dt=rd), rand(*shape, dt=od), rand(shape[-1], dt=F32)
    if strided:
        a, r = row_strided(a), row_strided(r)
    out, rstd = B.rms_norm_add_fwd(a, r, w, EPS, offset, yd)
    assert (out.dtype, rstd.dtype, out.shape, rstd.shape) == (od, F32, a.shape, a.shape[:-1]) and out.is_contiguous()
    wide = torch.promote_types(ad, yd or ad)
    y1, rstd1 = B.rms_norm_fwd(a.to(wide), w, EPS, offset, yd or ad)
    if exact and a.device.type == "cpu":  # the backend's own norm, rounded as it rounds it, then torch's add: bit for bit
        assert torch.equal(out, r + y1), "out is not r + the backend's rms_norm(a)"
    elif exact:  # compiled for a GPU, an fp32 y = a·rstd·w and r + y contract to one FMA (one rounding, not two)
        torch.testing.assert_close(out, r + y1, rtol=4 * torch.finfo(od).eps, atol=4 * torch.finfo(od).eps,
                                   msg="out is not r + the backend's rms_norm(a) within 4 ulps")
    torch.testing.assert_close(rstd, rstd1, rtol=1e-6, atol=0)
    da, dw = B.rms_norm_add_bwd(dout, a, w, rstd, EPS, offset, yd)
    assert (da.dtype, dw.dtype, da.shape) == (ad, w.dtype, a.shape)
    ref = _plain(a, r, w, offset, dout, yd, torch.float64)
    same = _plain(a, r, w, offset, dout, yd, None)
    for name, got, sm, rf in zip(("out", "da", "dw"), (out, da, dw), (same[0], same[1], same[3]), (ref[0], ref[1], ref[3])):
        assert_within_rule(got, sm, rf, ATOL[got.dtype] * max(1.0, rf.abs().max().item()), f"{name} {shape} {dts}")


@pytest.mark.parametrize("backend", ["triton", "reference"])
@pytest.mark.parametrize("shape", [(1, 64), (37, 123), (2, 5, 96)], ids=lambda s: "x".join(map(str, s)))
@pytest.mark.parametrize("dts", DTYPES, ids=_ids)
def test_rms_norm_add(backend, shape, dts, request):
    _check(backend_module(backend, request), shape, dts, 0.0, shape == (37, 123), DEVICE)


@pytest.mark.parametrize("backend", ["triton", "reference"])
def test_offset_and_a_wide_row(backend, request):
    """Gemma's 1 + w, and one row of 8192 (hidden ≥ 8192: the widest one-pass tile)."""
    B = backend_module(backend, request)
    _check(B, (2, 7, 40), (BF16, F32, None), 1.0, False, DEVICE)
    _check(B, (1, 8192), (F32, F32, None), 0.0, False, DEVICE)


@needs_mlir
@pytest.mark.parametrize("dts", [DTYPES[0], DTYPES[3], DTYPES[4]], ids=_ids)
def test_rms_norm_add_mlir(dts, request):
    _check(backend_module("mlir", request), (2, 5, 96), dts, 0.0, True, "cpu")


@pytest.mark.parametrize("dts", [DTYPES[0], DTYPES[3]], ids=_ids)
def test_rms_norm_add_looped_path(dts, request, monkeypatch):
    """The chunked path of rows longer than MAX_FUSED, forced on 123-wide rows with 32-wide chunks."""
    B = backend_module("triton", request)
    monkeypatch.setattr(importlib.import_module(B.__name__ + ".rms_norm_add"), "norm_config",
                        lambda *a, **k: (32, 1, False, 1))
    _check(B, (37, 123), dts, 0.0, True, DEVICE, exact=False)


@pytest.mark.parametrize("backend", ["triton", "reference"])
def test_shapes_must_match(backend, request):
    B = backend_module(backend, request)
    a, w = torch.randn(4, 8, device=DEVICE), torch.randn(8, device=DEVICE)
    with pytest.raises(ValueError, match="same shape"):
        B.rms_norm_add_fwd(a, torch.randn(2, 4, 8, device=DEVICE), w, EPS, 0.0)


def test_triton_refuses_float64(request):
    B = backend_module("triton", request)
    a = torch.randn(4, 8, device=DEVICE, dtype=torch.float64)
    with pytest.raises(TypeError, match="float64"):
        B.rms_norm_add_fwd(a, a, a[0], EPS, 0.0)


# --- the op, through autograd: every gradient as the unfused r + rms_norm(a) ---

def _unfused(a, r, w, offset, y_dtype):
    af = a.float()
    return r + (af * torch.rsqrt(af.pow(2).mean(-1, keepdim=True) + EPS) * (w.float() + offset)).to(y_dtype or a.dtype)


@pytest.mark.parametrize("backend", ["reference", "triton", pytest.param("mlir", marks=needs_mlir)])
@pytest.mark.parametrize("dts", [DTYPES[0], DTYPES[3]], ids=_ids)
def test_op_gradients(backend, dts, request):
    from torchfuser import functional as F

    if backend == "triton":
        request.getfixturevalue("interpreter")
    elif backend == "mlir":
        request.getfixturevalue("mlir_tmp_cache")
    device = DEVICE if backend == "triton" else "cpu"
    ad, rd, yd = dts
    gen = torch.Generator().manual_seed(1)
    a0, r0 = torch.randn(3, 5, 48, generator=gen), torch.randn(3, 5, 48, generator=gen)
    w0 = torch.randn(48, generator=gen)
    ins = [(a0.to(device, ad), r0.to(device, rd), w0.to(device)) for _ in range(2)]
    ins = [[t.requires_grad_() for t in group] for group in ins]
    out = F.rms_norm_add(*ins[0], EPS, y_dtype=yd, backend=backend)
    want = _unfused(*ins[1], 0.0, yd)
    assert out.dtype == want.dtype
    dout = torch.randn(out.shape, generator=gen).to(device, out.dtype)
    got_g = torch.autograd.grad(out, ins[0], dout)
    want_g = torch.autograd.grad(want, ins[1], dout)
    tol = dict(rtol=0, atol=1e-5) if ad == F32 else dict(rtol=1e-2, atol=1e-2)
    torch.testing.assert_close(out, want, **tol)
    for name, g, wg in zip(("da", "dr", "dw"), got_g, want_g):
        assert g.dtype == wg.dtype, name
        torch.testing.assert_close(g, wg, **tol, msg=name)
    assert torch.equal(got_g[1], dout.to(rd))  # r's gradient is out's


def test_op_under_torch_compile_fake():
    """The custom op's fake implementation gives the kernels' dtypes and shapes (torch.compile, the meta device)."""
    from torchfuser import functional as F

    a, r, w = torch.empty(2, 3, 8, device="meta", dtype=BF16), torch.empty(2, 3, 8, device="meta"), torch.empty(8)
    out = F.rms_norm_add(a, r, w.to("meta"), EPS)
    assert out.dtype == F32 and out.shape == a.shape and out.device.type == "meta"


@pytest.mark.parametrize("dts", [DTYPES[0], DTYPES[4]], ids=_ids)
def test_custom_ops_pass_opcheck(dts):
    """The registered ops (schema, fake implementation, autograd registration) as torch.library checks them."""
    ad, rd, yd = dts
    gen = torch.Generator().manual_seed(3)
    a, r = torch.randn(3, 16, generator=gen).to(ad), torch.randn(3, 16, generator=gen).to(rd)
    w = torch.randn(16, generator=gen)
    fwd = torch.ops.torchfuser.rms_norm_add_fwd
    torch.library.opcheck(fwd, (a.requires_grad_(), r.requires_grad_(), w.requires_grad_(), EPS, 0.0, yd, "reference"))
    out, rstd = fwd(a.detach(), r.detach(), w.detach(), EPS, 0.0, yd, "reference")
    torch.library.opcheck(torch.ops.torchfuser.rms_norm_add_bwd,
                          (torch.randn_like(out), a.detach(), w.detach(), rstd, EPS, 0.0, yd, "reference"))
