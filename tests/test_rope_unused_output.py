"""rope rotates q and k in one op; where the loss uses only one of its outputs, the other input gets no gradient
(None), as with q and k rotated apart: a layer whose rotated query reaches nothing (the last layer of PI0's VLM prefix,
read by its action expert only through the KV cache) kept q_proj's gradient None unfused and got zeros fused, which an
optimizer treats otherwise (AdamW decays a weight whose gradient is zero, skips one whose gradient is None)."""
from __future__ import annotations

import pytest
import torch

from torchfuser import functional as F


def _torch_rope(t, cos, sin):
    rot = torch.cat((-t[..., t.shape[-1] // 2:], t[..., : t.shape[-1] // 2]), -1)
    return t * cos.unsqueeze(1) + rot * sin.unsqueeze(1)


_CUDA = pytest.mark.skipif(not torch.cuda.is_available(), reason="the Triton kernel needs a CUDA device")


@pytest.mark.parametrize("backend,device", [("reference", "cpu"), pytest.param("triton", "cuda", marks=_CUDA)])
@pytest.mark.parametrize("used", ["q", "k", "both"])
def test_only_the_inputs_of_used_outputs_get_gradients(used, backend, device):
    gen = torch.Generator().manual_seed(0)
    q0, k0 = torch.randn(2, 4, 5, 8, generator=gen), torch.randn(2, 2, 5, 8, generator=gen)
    angle = torch.rand(1, 5, 4, generator=gen) * 6
    cos, sin = torch.cat((angle, angle), -1).cos(), torch.cat((angle, angle), -1).sin()
    wq, wk = torch.randn(2, 4, 5, 8, generator=gen), torch.randn(2, 2, 5, 8, generator=gen)
    q0, k0, cos, sin, wq, wk = (t.to(device) for t in (q0, k0, cos, sin, wq, wk))
    grads = {}
    for name, rope in (("fused", lambda q, k: F.rope(q, k, cos, sin, backend=backend)),
                       ("torch", lambda q, k: (_torch_rope(q, cos, sin), _torch_rope(k, cos, sin)))):
        q, k = q0.clone().requires_grad_(), k0.clone().requires_grad_()
        qr, kr = rope(q, k)
        loss = (qr * wq).sum() if used == "q" else (kr * wk).sum() if used == "k" else (qr * wq).sum() + (kr * wk).sum()
        loss.backward()
        grads[name] = (q.grad, k.grad)
    for got, want in zip(grads["fused"], grads["torch"]):
        assert (got is None) == (want is None)
        if want is not None:
            torch.testing.assert_close(got, want)
