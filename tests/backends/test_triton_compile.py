"""The custom-op wiring every backend shares is compile-safe: torch.compile(fullgraph=True) of a
function using every torchfuser.functional op traces with no graph break (fullgraph raises on
one) and gives eager's loss and gradients. Run on the CPU with the reference backend; the
Triton backend plugs into the same custom ops."""
from __future__ import annotations

import pytest
import torch

import torchfuser.functional as F


def _block(x, w_norm, w_ln, b_ln, w_gu, q, k, cos, sin, w_head, labels):
    h = F.rms_norm(x, w_norm, 1e-6, offset=1.0, backend="reference")
    h = F.layer_norm(h, w_ln, b_ln, 1e-5, backend="reference")
    gate, up = (h @ w_gu.T).chunk(2, dim=-1)
    m = F.swiglu(gate, up, backend="reference") + F.geglu(gate, up, backend="reference")
    m = F.gelu(m, "tanh", backend="reference") + F.gelu(m, "none", backend="reference")
    qr, kr = F.rope(q, k, cos, sin, backend="reference")
    rope_term = (qr.sum() + kr.sum()) * 1e-3
    loss = F.linear_cross_entropy(m, w_head, labels, softcap=30.0, backend="reference")
    return loss + rope_term


def _inputs():
    g = torch.Generator().manual_seed(0)
    r = lambda *s: torch.randn(*s, generator=g)  # noqa: E731
    b, s, hid, inter, v, hq, hk, d = 2, 5, 32, 24, 50, 4, 2, 8
    params = dict(
        x=r(b, s, hid), w_norm=r(hid) * 0.1, w_ln=r(hid), b_ln=r(hid), w_gu=r(2 * inter, hid) * 0.2,
        q=r(b, s, hq, d).transpose(1, 2), k=r(b, hk, s, d), w_head=r(v, inter) * 0.2,
    )
    for t in params.values():
        t.requires_grad_()
    labels = torch.randint(0, v, (b, s), generator=g)
    labels[0, 0] = -100
    return params, dict(cos=r(1, s, d), sin=r(1, s, d), labels=labels)


def _loss_and_grads(fn):
    params, consts = _inputs()
    loss = fn(**params, **consts)
    grads = torch.autograd.grad(loss, list(params.values()))
    return loss, grads


@pytest.mark.parametrize("compile_backend", ["aot_eager", "inductor"])
def test_compile_fullgraph_matches_eager(compile_backend):
    torch._dynamo.reset()
    eager_loss, eager_grads = _loss_and_grads(_block)
    compiled = torch.compile(_block, fullgraph=True, backend=compile_backend)
    loss, grads = _loss_and_grads(compiled)
    torch.testing.assert_close(loss, eager_loss, rtol=1e-5, atol=1e-6)
    for g, e in zip(grads, eager_grads):
        torch.testing.assert_close(g, e, rtol=1e-4, atol=1e-6)


def test_compile_has_no_graph_breaks():
    torch._dynamo.reset()
    params, consts = _inputs()
    explanation = torch._dynamo.explain(_block)(**params, **consts)
    assert explanation.graph_break_count == 0, explanation.break_reasons
    assert explanation.graph_count == 1


def test_reference_kernels_run_under_a_dispatch_mode():
    """torch.compile's runtime (and FlopCounterMode, debug modes) call custom ops under a
    TorchDispatchMode; the reference kernels' torch.func backward must still work there."""
    from torch.utils._python_dispatch import TorchDispatchMode

    class PassThrough(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            return func(*args, **(kwargs or {}))

    h, w, y = torch.randn(6, 8), torch.randn(5, 8), torch.randint(0, 5, (6,))
    op = torch.ops.torchfuser.linear_cross_entropy_fwd
    plain = op(h, w, None, y, -100, None, "mean", True, None, "reference")
    with PassThrough():
        moded = op(h, w, None, y, -100, None, "mean", True, None, "reference")
        dx, dw = torch.ops.torchfuser.rms_norm_bwd(h, h, w[0] + 1, h[:, 0].abs() + 1, 1e-6, 0.0, "reference")
    for a, b in zip(plain, moded):
        torch.testing.assert_close(a, b)
    assert torch.isfinite(dx).all() and torch.isfinite(dw).all()

