"""The input embedding's gradient added in place to the fused LM head's, for a tied weight W (V×H).

A tied W gets two gradients in a training step: the head's, dense (from linear_cross_entropy), and
the input embedding's, nonzero only in the rows of the step's tokens. Autograd builds the latter
as a dense V×H tensor (a zero fill, then a scatter) and adds the two: three more passes over V×H
(on an H200, 0.58 ms of qwen05b's step for its 151936×896 fp32 W). Here the head's gradient, on
its way to W, is left in a ``GradSlot``; the embedding's backward adds its N token rows into it
with ``index_put_(accumulate=True)`` (sorted, no atomics: deterministic on CUDA; no host sync)
and returns no gradient of its own, so that autograd hands W the head's tensor, now the sum.

Autograd runs W's accumulation only after both backwards have run, so the sum is complete when it
lands in ``W.grad``. Where the head's gradient is not in the slot when the embedding's backward
runs (another order, a double backward, a dtype or layout it should not be written in), the
embedding's backward returns its dense gradient as ``nn.Embedding`` does.
"""
from __future__ import annotations

import torch
from torch import Tensor, nn


class GradSlot:
    """The head's gradient of the tied weight, handed once to the embedding's backward."""

    __slots__ = ("grad",)

    def __init__(self):
        self.grad: Tensor | None = None

    def take(self) -> Tensor | None:
        grad, self.grad = self.grad, None  # no reference kept: autograd may then adopt it as W.grad
        return grad


class _LeaveGrad(torch.autograd.Function):
    """Identity on the head's weight; its backward leaves the incoming gradient in the slot."""

    @staticmethod
    def forward(ctx, weight: Tensor, slot: GradSlot) -> Tensor:
        ctx.slot = slot
        return weight.view_as(weight)

    @staticmethod
    def backward(ctx, grad: Tensor):
        ctx.slot.grad = grad
        return grad, None


class _TiedEmbedding(torch.autograd.Function):
    @staticmethod
    def forward(ctx, ids: Tensor, weight: Tensor, slot: GradSlot, padding_idx: int | None) -> Tensor:
        ctx.save_for_backward(ids)
        ctx.slot, ctx.padding_idx, ctx.weight_shape = slot, padding_idx, weight.shape
        return nn.functional.embedding(ids, weight, padding_idx)

    @staticmethod
    def backward(ctx, grad: Tensor):
        (ids,) = ctx.saved_tensors
        idx, rows = ids.reshape(-1), grad.reshape(-1, grad.shape[-1])
        if ctx.padding_idx is not None:  # nn.Embedding gives the padding row no gradient
            rows = rows.masked_fill((idx == ctx.padding_idx).unsqueeze(1), 0)
        total = ctx.slot.take()
        writable = (
            total is not None and not torch.is_grad_enabled()  # create_graph: no in-place on a graph's tensor
            and total.shape == ctx.weight_shape and total.dtype == grad.dtype and total.is_contiguous()
        )
        if not writable:
            dense = rows.new_zeros(ctx.weight_shape).index_put_((idx,), rows, accumulate=True)
            return None, dense, None, None
        total.index_put_((idx,), rows, accumulate=True)
        return None, None, None, None


def routable(embedding: nn.Module, head: nn.Linear) -> bool:
    """Whether the embedding's gradient can go into the head's: a plain ``nn.Embedding`` (not a
    subclass that scales its output) sharing the head's weight, with no forward of its own on the
    instance (a hook library's), and no ``max_norm``, ``scale_grad_by_freq`` or sparse gradients."""
    return (type(embedding) is nn.Embedding and embedding.weight is head.weight
            and "forward" not in embedding.__dict__ and embedding.max_norm is None
            and not embedding.scale_grad_by_freq and not embedding.sparse)


def install(embedding: nn.Embedding) -> GradSlot:
    """Route this embedding's calls through a new slot until ``uninstall`` (module hooks still run)."""
    slot = GradSlot()

    def forward(ids: Tensor) -> Tensor:
        return _TiedEmbedding.apply(ids, embedding.weight, slot, embedding.padding_idx)

    embedding.__dict__["forward"] = forward
    return slot


def uninstall(embedding: nn.Embedding) -> None:
    embedding.__dict__.pop("forward", None)


def leave_grad(weight: Tensor, slot: GradSlot) -> Tensor:
    """``weight`` for the head's product, its gradient left in ``slot`` on the way back."""
    return _LeaveGrad.apply(weight, slot)
