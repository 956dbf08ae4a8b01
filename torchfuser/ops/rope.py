from __future__ import annotations

import torch
from torch import Tensor

from torchfuser.backends.reference.rope import empty_heads_inner

from ._call import autograd, kernel, run


# Outputs (and input gradients) are B×H×S×D views of B×S×H×D memory (``empty_heads_inner``):
# attention transposes B×S×H×D projections into rope, and SDPA gives its output and dq/dk its query's
# layout, so this layout spares the copies back to B×S×(H·D) after attention and rope's backward.


# ``out_dtype`` (None: each input's own): both outputs in it, from fp32 arithmetic rounded once. Attention under
# autocast asks for its dtype where q and k come fp32 (after Qwen3's q/k norms): SDPA would round them to it next.
@torch.library.custom_op("torchfuser::rope_fwd", mutates_args=())
def rope_fwd(
    q: Tensor, k: Tensor, cos: Tensor, sin: Tensor, out_dtype: torch.dtype | None, backend: str
) -> tuple[Tensor, Tensor]:
    return kernel(backend, "rope_fwd")(q, k, cos, sin, out_dtype)


@rope_fwd.register_fake
def _(q, k, cos, sin, out_dtype, backend):
    return empty_heads_inner(q, out_dtype), empty_heads_inner(k, out_dtype)


@torch.library.custom_op("torchfuser::rope_bwd", mutates_args=())
def rope_bwd(
    dq: Tensor, dk: Tensor, cos: Tensor, sin: Tensor, out_dtype: torch.dtype | None, backend: str
) -> tuple[Tensor, Tensor]:
    return kernel(backend, "rope_bwd")(dq, dk, cos, sin, out_dtype)


@rope_bwd.register_fake
def _(dq, dk, cos, sin, out_dtype, backend):
    return empty_heads_inner(dq, out_dtype), empty_heads_inner(dk, out_dtype)


def _setup(ctx, inputs, output):
    q, k, cos, sin, out_dtype, backend = inputs
    ctx.save_for_backward(cos, sin)
    ctx.backend = backend
    ctx.outputs = [(o.shape, o.dtype) for o in output]
    ctx.in_dtype = None if out_dtype is None else q.dtype  # the gradients' (q's and k's: one dtype, rope checks)


def _backward(ctx, dq, dk):
    cos, sin = ctx.saved_tensors
    # An output the loss does not use gets no gradient, and neither does its input, as with q and k rotated apart:
    # a layer whose rotated query reaches nothing (the last layer of a prefix read only through its KV cache, PI0's
    # VLM) leaves q_proj's gradient None, not zeros (an optimizer decays a zero gradient's weight, skips a None one).
    # For the kernel, which rotates both, zeros stand in for the missing one.
    used = (dq is not None, dk is not None)
    if not any(used):
        return None, None, None, None, None, None
    dq, dk = (g if g is not None else cos.new_zeros(shape, dtype=dtype) for g, (shape, dtype) in zip((dq, dk), ctx.outputs))
    # Every backend reads strided gradients (SDPA's come B×S×H×D-laid): no copy here.
    gq, gk = run(rope_bwd, dq, dk, cos, sin, ctx.in_dtype, ctx.backend)
    return gq if used[0] else None, gk if used[1] else None, None, None, None, None


_rope = autograd(rope_fwd, _setup, _backward)


def rope(
    q: Tensor, k: Tensor, cos: Tensor, sin: Tensor, backend: str, out_dtype: torch.dtype | None = None
) -> tuple[Tensor, Tensor]:
    """(q, k) rotated; with ``out_dtype``, both written in it (q and k must then share a dtype)."""
    if out_dtype is not None and q.dtype != k.dtype:
        raise ValueError(f"rope: out_dtype needs q and k of one dtype, got {q.dtype} and {k.dtype}")
    return _rope(q, k, cos, sin, out_dtype, backend)
