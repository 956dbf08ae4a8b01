"""Post-block norms on CUDA (skipped without it): the Triton norm-then-add kernel (``rms_norm_add``) at a training
step's shapes against float64 (the numerics rule, every output and gradient), and the OLMo-2 / OLMo-3 / EXAONE 4 /
FlexOlmo layers fused with the defaults against the unfused model (two steps, every gradient; under bf16 autocast
against the same model with only the residual-norm pattern left out). On the CPU the kernel runs under the
interpreter (tests/backends/test_rms_norm_add_kernels.py) and the layers exactly (tests/test_residual_post_block.py)."""
from __future__ import annotations

import copy

import pytest
import torch

import torchfuser
from torchfuser import functional as F

from numerics import ATOL, assert_cuda_steps_like, assert_within_rule
from tiny_lm import fused_layers, lm_step as step, tiny_model

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")

F32, BF16, F16 = torch.float32, torch.bfloat16, torch.float16
EPS = 1e-6


def _grads(a, r, w, dout, y_dtype, dtype):
    """out, da, dr, dw by plain torch: float64 throughout, or the unfused model's roundings (``dtype`` None)."""
    a_, r_, w_ = (t.detach().to(dtype or t.dtype).requires_grad_() for t in (a, r, w))
    af = a_ if dtype else a_.float()
    y = af * torch.rsqrt(af.pow(2).mean(-1, keepdim=True) + EPS) * (w_ if dtype else w_.float())
    out = r_ + (y if dtype else y.to(y_dtype or a.dtype))
    return (out.detach(), *torch.autograd.grad(out, (a_, r_, w_), dout.to(out.dtype)))


@pytest.mark.parametrize("rows, n", [(4096, 2048), (2048, 8192), (512, 16384), (64, 32768)],
                         ids=lambda v: str(v))
@pytest.mark.parametrize("dts", [(F32, F32, None), (BF16, BF16, None), (F16, F16, None), (BF16, F32, None),
                                 (BF16, F32, F32)], ids=lambda d: "+".join("-" if t is None else str(t)[6:] for t in d))
def test_kernel_against_float64(rows, n, dts):
    ad, rd, yd = dts
    gen = torch.Generator(device="cuda").manual_seed(0)
    a = torch.randn(rows, n, device="cuda", generator=gen).to(ad) * 3
    r = torch.randn(rows, n + 8, device="cuda", generator=gen).to(rd)[:, :n]  # row-strided
    w = torch.randn(n, device="cuda", generator=gen)
    ins = [t.detach().requires_grad_() for t in (a, r, w)]
    out = F.rms_norm_add(*ins, EPS, y_dtype=yd, backend="triton")
    dout = torch.randn(out.shape, device="cuda", generator=gen).to(out.dtype)
    got = (out.detach(), *torch.autograd.grad(out, ins, dout))
    ref, same = _grads(a, r, w, dout, yd, torch.float64), _grads(a, r, w, dout, yd, None)
    for name, g, s, f in zip(("out", "da", "dr", "dw"), got, same, ref):
        assert g.dtype == s.dtype, name
        assert_within_rule(g, s, f, ATOL[g.dtype] * max(1.0, f.abs().max().item()), f"{name} {rows}x{n} {dts}")


@pytest.mark.parametrize("model_type", ["olmo2", "olmo3", "exaone4", "flex_olmo"])
def test_layers_on_cuda_with_the_defaults(model_type):
    ref = tiny_model(model_type).cuda()
    fused = copy.deepcopy(ref)
    torchfuser.optimize(fused)
    layers = fused_layers(fused)
    assert len(layers) == 2, str(torchfuser.report(fused))
    assert_cuda_steps_like(ref, fused, step)


@pytest.mark.parametrize("model_type", ["olmo2", "exaone4"])
def test_layers_under_bf16_autocast(model_type):
    """The fused layers against the same model with only the residual-norm pattern left out (its norms, attention and
    MLP the same kernels): bf16 block outputs into the fp32 residual stream, OLMo-2's norm in bf16, EXAONE 4's in fp32."""
    base = tiny_model(model_type).cuda()
    fused, other = copy.deepcopy(base), copy.deepcopy(base)
    torchfuser.optimize(fused, cuda_graphs=False)
    torchfuser.optimize(other, cuda_graphs=False, exclude=("residual_norm",))
    assert len(fused_layers(fused)) == 2 and not fused_layers(other)
    with torch.autocast("cuda", torch.bfloat16):
        losses = [step(m, "cuda") for m in (other, fused)]
    torch.testing.assert_close(losses[1], losses[0], rtol=1e-3, atol=1e-3)
    for (n, a), (_, b) in zip(other.named_parameters(), fused.named_parameters()):
        torch.testing.assert_close(b.grad, a.grad, rtol=2e-2, atol=1e-3, msg=n)
