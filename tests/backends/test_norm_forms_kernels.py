"""Every backend's norm kernels on the norm forms the fused modules hand them (``modules/norms.py``): Nemotron's
LayerNorm1P as layer_norm with w + 1 (w's dtype, as the original adds it), OLMo-1's weightless LayerNorm and
NanoChat's weightless RMS norm with a weight of ones. Forward and every gradient against the original module
(fp32: close; bf16: the numerics rule against float64); Triton under the interpreter; the residual adds of
those forms (add_layer_norm_fwd / layer_norm_res_bwd, add_rms_norm through rms_norm_bwd's dres) too."""
from __future__ import annotations

import copy

import pytest
import torch
from transformers.models.nanochat.modeling_nanochat import NanoChatRMSNorm
from transformers.models.nemotron.modeling_nemotron import NemotronLayerNorm1P
from transformers.models.olmo.modeling_olmo import OlmoLayerNorm

from norm_kernel_helpers import backend_module, row_strided

import test_triton_ops
from numerics import ATOL, assert_within_rule

interpreter, DEVICE = test_triton_ops.interpreter, test_triton_ops.DEVICE
F32, BF16 = torch.float32, torch.bfloat16
H = 96


def _nemotron():
    m = NemotronLayerNorm1P(H, eps=1e-5)
    g = torch.Generator().manual_seed(3)
    with torch.no_grad():
        m.weight.copy_(0.2 * torch.randn(H, generator=g))
        m.bias.copy_(0.2 * torch.randn(H, generator=g))
    return m


FORMS = {"nemotron_1p": _nemotron, "olmo_ln": lambda: OlmoLayerNorm(H), "nanochat_rms": lambda: NanoChatRMSNorm(1e-6)}


def _original(module, x, dy, dres):
    """y, dx + dres, and (dw, db) where it has them, of the original module."""
    x = x.detach().requires_grad_()
    y = module(x)
    params = list(module.parameters())
    grads = torch.autograd.grad(y, [x, *params], dy)
    return (y.detach(), grads[0] + dres.to(grads[0].dtype), *grads[1:])


def _kernels(B, form, module, x, dy, dres):
    """The same from the backend's kernels, handed what the fused module hands them."""
    if form == "nanochat_rms":
        w = torch.ones(x.shape[-1], dtype=x.dtype, device=x.device)
        y, rstd = B.rms_norm_fwd(x, w, 1e-6, 0.0)
        dx, _ = B.rms_norm_bwd(dy, x, w, rstd, 1e-6, 0.0, dres)
        return y, dx
    if form == "olmo_ln":  # (the original computes in fp32: so do the kernels)
        w, b = torch.ones(x.shape[-1], dtype=x.dtype, device=x.device), None
    else:
        w, b = module.weight.detach() + 1.0, module.bias.detach()
    y, mean, rstd = B.layer_norm_fwd(x, w, b, 1e-5)
    dx, dw, db = B.layer_norm_res_bwd(dy, x, w, b, mean, rstd, 1e-5, dres)
    assert (db.numel() == 0) == (b is None)
    return (y, dx) if b is None else (y, dx, dw, db)


def _inputs(shape, dtype, device, strided):
    gen = torch.Generator().manual_seed(0)
    x, dy, dres = ((torch.randn(*shape, generator=gen, dtype=torch.float64) + 0.4 * (i == 0)) for i in range(3))
    if strided:
        x = row_strided(x)
    return x.to(device, dtype), dy.to(device, dtype), dres.to(device, dtype)


@pytest.mark.parametrize("backend", ["reference", "triton", "mlir"])
@pytest.mark.parametrize("form", list(FORMS))
@pytest.mark.parametrize("shape", [(1, H), (37, H), (2, 5, H)], ids=lambda s: "x".join(map(str, s)))
def test_fp32_kernels_match_the_original(backend, form, shape, request):
    B = backend_module(backend, request)
    device = "cpu" if backend == "mlir" else DEVICE
    module = FORMS[form]().to(device)
    x, dy, dres = _inputs(shape, F32, device, strided=shape == (37, H))
    got, want = _kernels(B, form, module, x, dy, dres), _original(module, x, dy, dres)
    assert len(got) == len(want)
    for name, a, b in zip(("y", "dx", "dw", "db"), got, want):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=2e-5, msg=f"{form} {name}")


@pytest.mark.parametrize("backend", ["reference", "triton"])
@pytest.mark.parametrize("form", list(FORMS))
def test_bf16_kernels_within_the_rule(backend, form, request):
    B = backend_module(backend, request)
    module = FORMS[form]()
    x, dy, dres = _inputs((37, H), torch.float64, "cpu", strided=False)
    ref64 = _original(copy.deepcopy(module).double(), x, dy, dres)
    plain = copy.deepcopy(module).to(BF16)
    same = _original(plain, x.to(BF16), dy.to(BF16), dres.to(BF16))
    plain_dev = plain.to(DEVICE)
    got = _kernels(B, form, plain_dev, *(t.to(DEVICE, BF16) for t in (x, dy, dres)))
    for name, a, s, r in zip(("y", "dx", "dw", "db"), got, same, ref64):
        assert a.dtype == s.dtype, name
        assert_within_rule(a.cpu(), s, r, ATOL[BF16] * max(1.0, r.abs().max().item()), f"{form} {name}")
