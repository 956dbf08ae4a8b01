"""Which fused ops torch.compile sees as custom ops and which as their definitions, for Inductor to
fuse (``TORCHFUSER_COMPILED_ELEMENTWISE``), on the Triton backend: interpreted on the CPU, compiled
on a GPU (the interpreter fixture of test_triton_ops)."""
from __future__ import annotations

import pytest
import torch

import torchfuser.functional as F
from test_triton_compile import _inputs
from test_triton_ops import DEVICE, interpreter  # noqa: F401  (module fixture: the interpreted backend)


def _elementwise_block(x, w_norm, w_ln, b_ln, w_gu, q, k, cos, sin, backend):
    h = F.layer_norm(F.rms_norm(x, w_norm, 1e-6, offset=1.0, backend=backend), w_ln, b_ln, 1e-5, backend=backend)
    gu = h @ w_gu.T
    m = F.swiglu(gu, backend=backend) + F.geglu(*gu.chunk(2, dim=-1), backend=backend)
    qr, kr = F.rope(q, k, cos, sin, backend=backend)
    return F.gelu(m, "tanh", backend=backend).square().mean() + qr.square().mean() + (kr * kr.detach().sin()).mean()


_IN_GRAPH = {  # the torchfuser forward ops left in the compiled graph under each policy
    "kernels": {"rms_norm", "layer_norm", "swiglu_packed", "geglu", "rope", "gelu"},
    "auto": {"layer_norm", "swiglu_packed", "geglu", "rope", "gelu"},
    "inductor": set(),
    "inductor:rope,gelu": {"rms_norm", "layer_norm", "swiglu_packed", "geglu"},
}


@pytest.mark.parametrize("policy", list(_IN_GRAPH))
def test_compiled_elementwise_policy(policy, monkeypatch):
    """TORCHFUSER_COMPILED_ELEMENTWISE: under torch.compile the Triton backend's elementwise ops
    named by the policy trace as their definitions (for Inductor to fuse), the others stay custom
    ops. Loss and every gradient match float64 whatever the policy (Triton interpreted on the CPU)."""
    monkeypatch.setenv("TORCHFUSER_COMPILED_ELEMENTWISE", policy)
    torch._dynamo.reset()
    params, consts = _inputs()
    args = {n: params[n].detach().to(DEVICE).requires_grad_() for n in ("x", "w_norm", "w_ln", "b_ln", "w_gu", "q", "k")}
    args.update(cos=consts["cos"].to(DEVICE), sin=consts["sin"].to(DEVICE))
    ops_seen = []

    def recording(gm, example_inputs):
        ops_seen.extend(str(n.target) for n in gm.graph.nodes if "torchfuser" in str(n.target))
        from torch._inductor.compile_fx import compile_fx

        return compile_fx(gm, example_inputs)

    loss = torch.compile(_elementwise_block, backend=recording, fullgraph=True)(**args, backend="triton")
    leaves = [n for n, t in args.items() if t.requires_grad]
    grads = torch.autograd.grad(loss, [args[n] for n in leaves])
    args64 = {n: t.detach().double().requires_grad_(t.requires_grad) for n, t in args.items()}
    loss64 = _elementwise_block(**args64, backend="reference")
    grads64 = torch.autograd.grad(loss64, [args64[n] for n in leaves])
    torch.testing.assert_close(loss.double(), loss64, rtol=1e-5, atol=1e-6)
    for name, g, g64 in zip(leaves, grads, grads64):
        torch.testing.assert_close(g.double(), g64, rtol=1e-4, atol=1e-6, msg=name)
    fwd_ops = {t.split(".")[1].removesuffix("_fwd") for t in ops_seen if t.split(".")[1].endswith("_fwd")}
    assert fwd_ops == _IN_GRAPH[policy]


def test_compiled_elementwise_policy_must_be_known(monkeypatch):
    monkeypatch.setenv("TORCHFUSER_COMPILED_ELEMENTWISE", "inductr")
    torch._dynamo.reset()
    x, w = torch.randn(3, 8, device=DEVICE), torch.randn(8, device=DEVICE)
    with pytest.raises(Exception, match="use auto, kernels, inductor"):
        torch.compile(lambda a, b: F.rms_norm(a, b, backend="triton"), backend="eager", fullgraph=True)(x, w)
