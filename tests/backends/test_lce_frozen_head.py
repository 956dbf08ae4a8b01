"""The fused linear + cross-entropy on a frozen head (LoRA, a reference model's scoring pass): no dW, no dbias.

The op computes its gradients in the forward. With the head's weight (and bias) frozen it used to compute dW
anyway — a V × H GEMM (≈ 4 TFLOP a Llama-3-8B step at 4096 tokens) and a V × H tensor saved (1 GiB there) —
and throw it away. Each backend (reference, the Triton kernels under the interpreter or on the GPU, MLIR, the
FP8 forms) now gives dh alone: the same loss and dh as with a trainable head, no gradient for the weight,
and nothing head-sized saved for the backward."""
from __future__ import annotations

import pytest
import torch

import torchfuser.functional as F
from numerics import needs_mlir
from test_triton_ops import DEVICE, interpreter  # noqa: F401  (module fixture: the interpreted backend)

V, H, N = 96, 32, 48

CASES = [("reference", None, torch.float32), ("triton", None, torch.float32), ("triton", None, torch.bfloat16),
         pytest.param("mlir", None, torch.float32, marks=needs_mlir),
         ("reference", "rowwise", torch.bfloat16), ("triton", "rowwise", torch.bfloat16)]


def _inputs(dtype, bias: bool):
    g = torch.Generator().manual_seed(5)
    h = torch.randn(N, H, generator=g).to(dtype)
    w = (torch.randn(V, H, generator=g) * 0.3).to(dtype)
    b = (torch.randn(V, generator=g) * 0.1).to(dtype) if bias else None
    labels = torch.randint(0, V, (N,), generator=g)
    labels[::7] = -100
    return h, w, b, labels


def _step(h, w, b, labels, backend, fp8, frozen: bool):
    device = DEVICE if backend == "triton" else "cpu"
    h = h.to(device, copy=True).requires_grad_()
    w = w.to(device, copy=True).requires_grad_(not frozen)
    b = None if b is None else b.to(device, copy=True).requires_grad_(not frozen)
    saved = []

    def pack(t):
        saved.append(tuple(t.shape))
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        loss = F.linear_cross_entropy(h, w, labels.to(device), bias=b, backend=backend, fp8=fp8)
    (2.0 * loss).backward()
    return loss.detach().cpu(), h.grad.cpu(), w.grad, None if b is None else b.grad, saved


@pytest.mark.parametrize("bias", [False, True], ids=["no-bias", "bias"])
@pytest.mark.parametrize("backend,fp8,dtype", CASES)
def test_a_frozen_head_gives_dh_alone(interpreter, backend, fp8, dtype, bias):  # noqa: F811
    if fp8 is not None and bias:
        pytest.skip("the FP8 head is tested without a bias (LM heads have none)")
    h, w, b, labels = _inputs(dtype, bias)
    loss, dh, dw, db, saved = _step(h, w, b, labels, backend, fp8, frozen=False)
    assert dw is not None and (db is not None) == bias and (V, H) in saved
    f_loss, f_dh, f_dw, f_db, f_saved = _step(h, w, b, labels, backend, fp8, frozen=True)
    assert f_dw is None and f_db is None
    assert (V, H) not in f_saved and (V,) not in f_saved, f_saved
    assert torch.equal(f_loss, loss)
    # dh: the same computation row by row; the chunking may differ (the dW buffer no longer counts
    # against the chunk budget), which can move a GEMM's rounding but nothing more.
    tol = dict(rtol=0, atol=0) if dtype == torch.float32 and backend != "triton" else {}
    torch.testing.assert_close(f_dh, dh, **tol)


def test_only_a_frozen_bias_still_gives_dw(interpreter):  # noqa: F811
    """weight_grad follows the weight and the bias: a trainable weight with a frozen bias keeps dW."""
    h, w, b, labels = _inputs(torch.float32, True)
    h, w, b = h.requires_grad_(), w.requires_grad_(), b.requires_grad_(False)
    F.linear_cross_entropy(h, w, labels, bias=b, backend="reference").backward()
    assert w.grad is not None and b.grad is None and h.grad is not None
