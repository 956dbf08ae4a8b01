"""The autograd Function that replays one captured layer: inputs copied (padded) into its static
buffers, the forward graph replayed, the outputs handed out as views; its backward likewise."""
from __future__ import annotations

import weakref

import torch

from torchfuser.cuda_graphs import buckets
from torchfuser.cuda_graphs.buckets import Padding
from torchfuser.cuda_graphs.capture import LayerGraphs


class _Token:
    """Lives as long as the autograd graph of one replay: weakly referenced to tell whether that
    replay's backward may still come."""

    __slots__ = ("__weakref__",)


class _Replay(torch.autograd.Function):
    @staticmethod
    def forward(ctx, stack: "Stack", g: LayerGraphs, pad: Padding, *tensors):
        for static, t, rule in zip(g.inputs, tensors, pad.rules):
            if static.data_ptr() != t.data_ptr():
                buckets.fill(static, t, rule, pad.s)
        g.fwd.replay()
        ctx.stack, ctx.graphs, ctx.pad, ctx.token = stack, g, pad, _Token()
        # Gradients for leaves (an input the user holds) are copied: stolen by autograd they would
        # alias a buffer the next replay overwrites.
        ctx.leaf = [t.is_leaf and t.requires_grad for t in tensors[: len(g.inputs)]]
        # A chained input is the previous layer's output buffer itself, which the backward reads.
        ctx.chained = (tensors[0], tensors[0]._version) if g.chained else None
        g.waiting = weakref.ref(ctx.token)
        outs = tuple(pad.unpad(o.detach()) for o in g.outputs)
        ctx.mark_non_differentiable(*(o for o, s in zip(outs, g.outputs) if not s.requires_grad))
        return outs

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, *grads):
        g, pad = ctx.graphs, ctx.pad
        if g.waiting is None or g.waiting() is not ctx.token:
            if ctx.stack.auto is not None:  # the default mode: eager for good, so that the step can run again
                ctx.stack.auto.give_up("a second backward through one forward (retain_graph=True)")
                ctx.stack.release()
                raise RuntimeError(
                    "torchfuser: a second backward through one forward (retain_graph=True) reached a layer replayed "
                    "from a CUDA graph, whose saved activations are gone. cuda_graphs='auto' has turned graphs off "
                    "for this model from now on: run the step again (or optimize with cuda_graphs=False).")
            raise RuntimeError(
                "torchfuser: a CUDA-graphed layer was asked for a second backward of one forward "
                "(retain_graph=True). Its saved activations live in the graph's buffers, which later "
                "replays reuse; optimize the model without cuda_graphs=True to backward twice."
            )
        g.waiting = None
        chained, ctx.chained = ctx.chained, None  # the input is no longer held here (auto's check of kept outputs)
        if chained is not None and chained[0]._version != chained[1]:
            raise RuntimeError(
                "torchfuser: the input of a CUDA-graphed layer was changed in place after the layer ran, "
                "and its backward reads that input. Change a clone instead, or optimize the model "
                "without cuda_graphs=True."
            )
        for static, d in zip(g.grad_outputs, grads):
            if static is not None and d is not None and static.data_ptr() != d.data_ptr():
                # A padded output's gradient is zero at the padding (buckets.fill zeros float tails).
                buckets.fill(static, d, buckets.SEQ1 if static.shape != d.shape else buckets.KEEP, pad.s)
        g.bwd.replay()
        ctx.stack.grads_in_pool = True
        n = len(g.inputs)
        ins = [None if s is None else pad.real(s.detach(), rule) for s, rule in zip(g.grad_inputs, pad.rules)]
        ins = tuple(None if s is None else s.clone() if leaf else s for s, leaf in zip(ins, ctx.leaf))
        return (None, None, None, *ins, *(None if s is None else s.detach() for s in g.grad_inputs[n:]))
