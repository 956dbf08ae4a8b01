"""Every fused op as (inputs, fused call, plain PyTorch call), for the edge tests of every backend
(tests/test_edge_inputs.py, tests/backends/test_edge_kernels.py): in-place updates of the outputs,
empty inputs (rows of width 0, no rows, an empty batch), the meta device."""
from __future__ import annotations

import torch
import torch.nn.functional as TF

import torchfuser.functional as F
from torchfuser import ops

EPS = 1e-6


def _rms(x, w):
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + EPS) * w


def _rot(t):
    half = t.shape[-1] // 2
    return torch.cat((-t[..., half:], t[..., :half]), dim=-1)


def _rope(q, k, cos, sin):
    c, s = cos.unsqueeze(1), sin.unsqueeze(1)
    return q * c + _rot(q) * s, k * c + _rot(k) * s


def _norm_inputs(shape, bias=False):
    x = torch.randn(shape)
    return (x, torch.randn(shape[-1]), torch.randn(shape[-1])) if bias else (x, torch.randn(shape[-1]))


def _rope_inputs(shape):
    b, h, s, d = shape
    return torch.randn(shape), torch.randn(b, max(h // 2, h and 1), s, d), torch.randn(1, s, d), torch.randn(1, s, d)


# name: (inputs from a shape, fused(*inputs, backend), torch(*inputs), how many leading inputs get gradients)
CASES = {
    "rms_norm": (_norm_inputs, lambda x, w, be: F.rms_norm(x, w, EPS, backend=be), _rms, 2),
    "rms_norm_opening_residual": (
        _norm_inputs, lambda x, w, be: ops.rms_norm_opening_residual(x, w, EPS, 0.0, F.backend_for(be, x.device)),
        lambda x, w: (_rms(x, w), x), 2),
    "add_rms_norm": (
        lambda shape: (torch.randn(shape), *_norm_inputs(shape)),
        lambda x, r, w, be: F.add_rms_norm(x, r, w, EPS, backend=be), lambda x, r, w: (s := x + r, _rms(s, w)), 3),
    "layer_norm": (
        lambda shape: _norm_inputs(shape, bias=True), lambda x, w, b, be: F.layer_norm(x, w, b, EPS, backend=be),
        lambda x, w, b: TF.layer_norm(x, x.shape[-1:], w, b, EPS), 3),
    "swiglu": (
        lambda shape: (torch.randn(shape), torch.randn(shape)), lambda g, u, be: F.swiglu(g, u, backend=be),
        lambda g, u: TF.silu(g) * u, 2),
    "geglu": (
        lambda shape: (torch.randn(shape), torch.randn(shape)), lambda g, u, be: F.geglu(g, u, backend=be),
        lambda g, u: TF.gelu(g, approximate="tanh") * u, 2),
    "swiglu_packed": (
        lambda shape: (torch.randn(*shape[:-1], 2 * shape[-1]),), lambda gu, be: F.swiglu(gu, backend=be),
        lambda gu: TF.silu(gu.chunk(2, -1)[0]) * gu.chunk(2, -1)[1], 1),
    "gelu": ((lambda shape: (torch.randn(shape),)), lambda x, be: F.gelu(x, "tanh", backend=be),
             lambda x: TF.gelu(x, approximate="tanh"), 1),
    "activation": ((lambda shape: (torch.randn(shape),)), lambda x, be: F.activation(x, "relu2", backend=be),
                   lambda x: TF.relu(x) ** 2, 1),
    "rope": (_rope_inputs, lambda q, k, c, s, be: F.rope(q, k, c, s, backend=be), _rope, 2),
}

# Outputs an in-place update may not touch, in the unfused computation too: add_rms_norm's sum s is
# what the norm's backward reads (a model's residual stream, which it saves as well).
SAVED_OUTPUTS = {"add_rms_norm": (0,)}

SHAPES = {"rows": (3, 8), "batched": (2, 3, 8)}  # ordinary inputs
EMPTY = {"width 0": (3, 0), "no rows": (0, 8), "empty batch": (0, 3, 8), "no rows, width 0": (2, 0, 0)}
ROPE_SHAPES = {"rows": (2, 4, 3, 8)}
ROPE_EMPTY = {"width 0": (2, 4, 3, 0), "no rows": (2, 4, 0, 8), "empty batch": (0, 4, 3, 8), "no heads": (2, 0, 3, 8)}


def shapes(name: str, empty: bool) -> dict:
    if name == "rope":
        return ROPE_EMPTY if empty else ROPE_SHAPES
    return EMPTY if empty else SHAPES


def outputs_and_grads(fn, inputs, n_grad, inplace=None, device="cpu"):
    """fn's outputs and the gradients of (outputs · fixed cotangents) w.r.t. the first n_grad inputs
    (zeros where unused). With ``inplace`` (an op's name), every output but its SAVED_OUTPUTS is
    multiplied in place by a mask first, as XLM does to its norms' outputs."""
    leaves = [t.detach().clone().to(device).requires_grad_(i < n_grad) for i, t in enumerate(inputs)]
    outs = fn(*leaves)
    outs = outs if isinstance(outs, tuple) else (outs,)
    if inplace:
        mask = torch.arange(outs[0].shape[-1], device=device) % 3 - 0.5
        keep = SAVED_OUTPUTS.get(inplace, ())
        outs = tuple(o if i in keep or _aliases(o, leaves) else o.mul_(mask) for i, o in enumerate(outs))
    gen = torch.Generator().manual_seed(1)
    cots = [torch.randn(o.shape, generator=gen).to(device) for o in outs]
    total = sum((o * c).sum() for o, c in zip(outs, cots))
    grads = torch.autograd.grad(total, leaves[:n_grad], allow_unused=True) if total.requires_grad else [None] * n_grad
    grads = [torch.zeros_like(t) if g is None else g for g, t in zip(grads, leaves)]
    return [o.detach() for o in outs], grads


class PassThrough(torch.overrides.TorchFunctionMode):
    """A function mode that changes nothing but makes every fused op take its custom op's path."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        return func(*args, **(kwargs or {}))


def _aliases(t, others) -> bool:
    """Whether t shares memory with one of others (an input handed back: the residual of
    rms_norm_opening_residual), which an in-place update would change under the caller."""
    return any(t.untyped_storage().data_ptr() == o.untyped_storage().data_ptr() for o in others)


def assert_same(got, want, atol=1e-5, rtol=1e-5):
    for g, w in zip(got, want, strict=True):
        assert g.shape == w.shape and g.dtype == w.dtype and g.device == w.device, (g.shape, w.shape)
        torch.testing.assert_close(g, w, atol=atol, rtol=rtol, equal_nan=True)
