"""The input embedding's gradient added in place to the fused LM head's, for a tied weight W (V×H).

A tied W gets two gradients in a training step: the head's, dense (from linear_cross_entropy), and
the input embedding's, nonzero only in the rows of the step's tokens. Autograd builds the latter
as a dense V×H tensor (a zero fill, then a scatter) and adds the two: three more passes over V×H
(on an H200, 0.58 ms of qwen05b's step for its 151936×896 fp32 W). Here the two meet in one
autograd node instead: the embedding's function has a second output, W itself (an alias), which is
the weight the fused head multiplies by. Autograd calls that node's backward once both of its
outputs' gradients have arrived, the head's (dense) and the embedding's (the token rows); it adds
the N rows into the head's gradient with ``index_put_(accumulate=True)`` (sorted, no atomics:
deterministic on CUDA; no host sync) and returns the sum as its one gradient for W.

Why there, and not in ``W.grad``: the sum leaves the node complete, as an ordinary gradient of W,
so whatever else meets on W afterwards is autograd's own accumulation and stays right — several
forwards before one backward (each forward's node returns its own sum), a term of the loss on
``lm_head.weight`` or ``embed_tokens.weight`` directly (an L2 penalty), ``torch.autograd.grad``,
micro-batch accumulation into an existing ``.grad``, DDP's and FSDP2's hooks on W's accumulator.
(The previous version left the head's gradient in a slot and added the rows into that tensor after
it had gone on towards W; that was right only while the tensor was the one autograd made ``W.grad``,
and lost the embedding's part when a second gradient of W was added to it first.) A post-accumulate
hook on W would miss ``torch.autograd.grad`` and run in an unspecified order with DDP's and FSDP's
hooks; a dense embedding gradient would bring back the V×H passes this module exists to save.

The rows go into the head's tensor in place only where that tensor is the node's to write: no
graph being built over the backward (``create_graph``), W's shape, dtype and a contiguous layout.
``linear_cross_entropy`` hands a copy of its saved gradient where the graph is retained, so a
later backward is not changed by the write. Otherwise the sum is made out of place; without the
head's gradient (the head not run through the alias) the embedding returns its dense gradient as
``nn.Embedding`` does.
"""
from __future__ import annotations

import torch
from torch import Tensor, nn


class GradSlot:
    """The alias of W that this forward's embedding call produced, for the fused head to use."""

    __slots__ = ("weight", "alias")

    def __init__(self):
        self.weight: Tensor | None = None  # the W the alias is of
        self.alias: Tensor | None = None

    def take(self, weight: Tensor) -> Tensor | None:
        alias, source = self.alias, self.weight
        self.weight = self.alias = None  # no reference kept past the forward
        return alias if source is weight and alias is not None and alias.requires_grad else None


class _TiedEmbedding(torch.autograd.Function):
    """(embedding(ids, W), W): the second output is the weight the fused head uses, so that the
    head's gradient of W comes back through this node's backward."""

    @staticmethod
    def forward(ctx, ids: Tensor, weight: Tensor, padding_idx: int | None):
        ctx.set_materialize_grads(False)  # an unused alias must not cost a V×H zero fill
        ctx.save_for_backward(ids)
        ctx.padding_idx, ctx.weight_shape = padding_idx, weight.shape
        return nn.functional.embedding(ids, weight, padding_idx), weight.view_as(weight)

    @staticmethod
    def backward(ctx, grad: Tensor | None, head_grad: Tensor | None):
        if grad is None:
            return None, head_grad, None
        (ids,) = ctx.saved_tensors
        idx, rows = ids.reshape(-1), grad.reshape(-1, grad.shape[-1])
        if ctx.padding_idx is not None:  # nn.Embedding gives the padding row no gradient
            rows = rows.masked_fill((idx == ctx.padding_idx).unsqueeze(1), 0)
        if head_grad is None:
            return None, rows.new_zeros(ctx.weight_shape).index_put_((idx,), rows, accumulate=True), None
        writable = (
            not torch.is_grad_enabled()  # create_graph: no in-place on a tensor of the graph being built
            and head_grad.shape == ctx.weight_shape and head_grad.dtype == rows.dtype and head_grad.is_contiguous()
        )
        if not writable:
            return None, head_grad.index_put((idx,), rows.to(head_grad.dtype), accumulate=True), None
        return None, head_grad.index_put_((idx,), rows, accumulate=True), None


def routable(embedding: nn.Module, head: nn.Linear) -> bool:
    """Whether the embedding's gradient can go into the head's: a plain ``nn.Embedding`` (not a
    subclass that scales its output) sharing the head's weight, with no forward of its own on the
    instance (a hook library's), and no ``max_norm``, ``scale_grad_by_freq`` or sparse gradients."""
    return (type(embedding) is nn.Embedding and embedding.weight is head.weight
            and "forward" not in embedding.__dict__ and embedding.max_norm is None
            and not embedding.scale_grad_by_freq and not embedding.sparse)


def install(embedding: nn.Embedding) -> GradSlot:
    """Route this embedding's first call with grad on through a new slot until ``uninstall``
    (module hooks still run); any later call in the same forward is a plain embedding."""
    slot = GradSlot()

    def forward(ids: Tensor) -> Tensor:
        weight = embedding.weight
        if slot.alias is not None or not (torch.is_grad_enabled() and weight.requires_grad):
            return nn.functional.embedding(ids, weight, embedding.padding_idx)
        out, slot.alias = _TiedEmbedding.apply(ids, weight, embedding.padding_idx)
        slot.weight = weight
        return out

    embedding.__dict__["forward"] = forward
    return slot


def uninstall(embedding: nn.Embedding) -> None:
    embedding.__dict__.pop("forward", None)


def head_weight(weight: Tensor, slot: GradSlot) -> Tensor:
    """The weight for the head's product: the alias the embedding made of ``weight`` in this forward
    (its gradient then meets the embedding's in one node), else ``weight`` itself."""
    alias = slot.take(weight)
    return weight if alias is None else alias
