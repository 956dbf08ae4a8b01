"""The numerics rule (docs/numerics.md), shared by the op tests of every backend."""
from __future__ import annotations

import pytest
import torch

from torchfuser.backends import unavailable_reason

_NO_MLIR = unavailable_reason("mlir", "cpu")
# Tests of what the MLIR backend compiles: skipped where torch-mlir is not installed (the GPU machine).
needs_mlir = pytest.mark.skipif(_NO_MLIR is not None, reason=_NO_MLIR or "")


def max_err(a: torch.Tensor, ref: torch.Tensor) -> float:
    return (a.double() - ref.double()).abs().max().item()


def assert_within_rule(fused: torch.Tensor, same_dtype: torch.Tensor, ref64: torch.Tensor, atol: float, what: str = "") -> None:
    """max|fused − ref64| ≤ 2 · max|torch_same_dtype − ref64| + atol."""
    assert fused.shape == ref64.shape, f"{what}: shape {tuple(fused.shape)} != {tuple(ref64.shape)}"
    assert torch.isfinite(fused).all(), f"{what}: non-finite values"
    err, base = max_err(fused, ref64), max_err(same_dtype, ref64)
    assert err <= 2 * base + atol, f"{what}: fused error {err:.3e} > 2 × torch error {base:.3e} + {atol:.1e}"


ATOL = {torch.float32: 1e-5, torch.bfloat16: 1e-2, torch.float16: 1e-3}


def assert_trains_like(ref, fused, step, keys, loss_rtol: float = 1e-6) -> None:
    """One fp32 training step of ``fused`` (fused in place, ``state_dict`` keys ``keys``) against ``ref``: the loss,
    every gradient (none where none), no call-time fallback; then ``restore`` gives the keys back."""
    import torchfuser
    from torchfuser.modules import fallbacks

    assert list(fused.state_dict()) == keys
    assert_step_like(ref, fused, step, loss_rtol)
    assert not fallbacks.counts(fused), fallbacks.counts(fused)  # every call ran fused
    torchfuser.restore(fused)
    assert list(fused.state_dict()) == keys


def assert_step_like(ref, fused, step, loss_rtol: float = 1e-6) -> None:
    """One fp32 training step (``step(model)`` returns the loss after its backward) of ``fused`` against ``ref``:
    the loss and every gradient (none where none)."""
    loss_ref, loss = step(ref), step(fused)
    torch.testing.assert_close(loss, loss_ref, rtol=loss_rtol, atol=1e-6)
    for (n, a), (_, b) in zip(ref.named_parameters(), fused.named_parameters()):
        assert (a.grad is None) == (b.grad is None), n
        if a.grad is not None:
            torch.testing.assert_close(b.grad, a.grad, rtol=1e-5, atol=1e-6, msg=n)


def assert_bf16_within_rule(fused, plain, ref64, step) -> None:
    """bf16 ``fused`` and ``plain`` (the same model unfused) against its float64 copy ``ref64``: the loss and every
    gradient of the fused model no further from float64's than twice the unfused model's error (+ 1e-2, scaled
    by the gradient's size)."""
    losses = [step(m) for m in (fused, plain, ref64)]
    assert_within_rule(losses[0].reshape(1), losses[1].reshape(1), losses[2].reshape(1), 1e-2, "loss")
    for (n, f), (_, p), (_, r) in zip(fused.named_parameters(), plain.named_parameters(), ref64.named_parameters()):
        assert_within_rule(f.grad, p.grad, r.grad, 1e-2 * max(1.0, r.grad.abs().max().item()), n)


def assert_cuda_steps_like(ref, fused, step) -> None:
    """Two CUDA training steps each (a second call may replay what the first captured): the last loss and every
    gradient of ``fused`` close to ``ref``'s (GPU kernels: a tolerance, not bits)."""
    losses = []
    for m in (ref, fused):
        for _ in range(2):
            m.zero_grad(set_to_none=True)
            loss = step(m, "cuda")
        losses.append(loss)
    torch.testing.assert_close(losses[1], losses[0], rtol=1e-4, atol=1e-4)
    for (n, a), (_, b) in zip(ref.named_parameters(), fused.named_parameters()):
        torch.testing.assert_close(b.grad, a.grad, rtol=1e-3, atol=1e-4, msg=n)
