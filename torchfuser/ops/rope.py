from __future__ import annotations

import torch
from torch import Tensor

from ._call import autograd, kernel, run


@torch.library.custom_op("torchfuser::rope_fwd", mutates_args=())
def rope_fwd(q: Tensor, k: Tensor, cos: Tensor, sin: Tensor, backend: str) -> tuple[Tensor, Tensor]:
    return kernel(backend, "rope_fwd")(q, k, cos, sin)


@rope_fwd.register_fake
def _(q, k, cos, sin, backend):
    return q.new_empty(q.shape), k.new_empty(k.shape)


@torch.library.custom_op("torchfuser::rope_bwd", mutates_args=())
def rope_bwd(dq: Tensor, dk: Tensor, cos: Tensor, sin: Tensor, backend: str) -> tuple[Tensor, Tensor]:
    return kernel(backend, "rope_bwd")(dq, dk, cos, sin)


@rope_bwd.register_fake
def _(dq, dk, cos, sin, backend):
    return dq.new_empty(dq.shape), dk.new_empty(dk.shape)


def _setup(ctx, inputs, output):
    q, k, cos, sin, backend = inputs
    ctx.save_for_backward(cos, sin)
    ctx.backend = backend


def _backward(ctx, dq, dk):
    cos, sin = ctx.saved_tensors
    gq, gk = run(rope_bwd, dq.contiguous(), dk.contiguous(), cos, sin, ctx.backend)
    return gq, gk, None, None, None


_rope = autograd(rope_fwd, _setup, _backward)


def rope(q: Tensor, k: Tensor, cos: Tensor, sin: Tensor, backend: str) -> tuple[Tensor, Tensor]:
    return _rope(q, k, cos, sin, backend)
