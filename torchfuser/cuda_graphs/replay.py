"""Replaying captured layers: the autograd Function per layer and the stack that decides, call by
call, whether a graph can serve it."""
from __future__ import annotations

import logging
import time
import weakref
from collections import Counter
from dataclasses import dataclass, field

import torch
from torch import nn
from torch.utils import _pytree as pytree

from torchfuser.cuda_graphs.capture import LayerGraphs, capture, recover_from_failed_capture
from torchfuser.cuda_graphs.signature import autocast_key, param_key, split_call, tensor_key
from torchfuser.modules.base import hooked, loaded_fsdp
from torchfuser.modules.residual_norm import ResidualNormForward

log = logging.getLogger("torchfuser")
MAX_RECAPTURES = 3


def _fsdp2(mod: nn.Module) -> bool:
    fsdp = loaded_fsdp()
    return fsdp is not None and isinstance(mod, getattr(fsdp, "FSDPModule", ()))


class _Token:
    """Lives as long as the autograd graph of one replay: weakly referenced to tell whether that
    replay's backward may still come."""

    __slots__ = ("__weakref__",)


class _Replay(torch.autograd.Function):
    @staticmethod
    def forward(ctx, stack: "Stack", g: LayerGraphs, *tensors):
        for static, t in zip(g.inputs, tensors):
            if static.data_ptr() != t.data_ptr():
                static.copy_(t)
        g.fwd.replay()
        ctx.stack, ctx.graphs, ctx.token = stack, g, _Token()
        # Gradients for leaves (an input the user holds) are copied: stolen by autograd they would
        # alias a buffer the next replay overwrites.
        ctx.leaf = [t.is_leaf and t.requires_grad for t in tensors[: len(g.inputs)]]
        # A chained input is the previous layer's output buffer itself, which the backward reads.
        ctx.chained = (tensors[0], tensors[0]._version) if g.chained else None
        g.waiting = weakref.ref(ctx.token)
        outs = tuple(o.detach() for o in g.outputs)
        ctx.mark_non_differentiable(*(o for o, s in zip(outs, g.outputs) if not s.requires_grad))
        return outs

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, *grads):
        g = ctx.graphs
        if g.waiting is None or g.waiting() is not ctx.token:
            raise RuntimeError(
                "torchfuser: a CUDA-graphed layer was asked for a second backward of one forward "
                "(retain_graph=True). Its saved activations live in the graph's buffers, which later "
                "replays reuse; optimize the model without cuda_graphs=True to backward twice."
            )
        g.waiting = None
        if ctx.chained is not None and ctx.chained[0]._version != ctx.chained[1]:
            raise RuntimeError(
                "torchfuser: the input of a CUDA-graphed layer was changed in place after the layer ran, "
                "and its backward reads that input. Change a clone instead, or optimize the model "
                "without cuda_graphs=True."
            )
        for static, d in zip(g.grad_outputs, grads):
            if static is not None and d is not None and static.data_ptr() != d.data_ptr():
                static.copy_(d)
        g.bwd.replay()
        ctx.stack.grads_in_pool = True
        n = len(g.inputs)
        ins = tuple(None if s is None else s.clone() if leaf else s.detach() for s, leaf in zip(g.grad_inputs, ctx.leaf))
        return (None, None, *ins, *(None if s is None else s.detach() for s in g.grad_inputs[n:]))


@dataclass(eq=False)
class Stack:
    name: str
    layers: list[nn.Module]
    forwards: list  # each layer's own bound forward
    key: tuple | None = None
    graphs: list[LayerGraphs] | None = None
    captures: int = 0
    capture_s: float = 0.0
    replays: int = 0
    disabled: str | None = None
    eager: Counter = field(default_factory=Counter)
    chain: bool = True  # capture with chained hidden states (capture.capture); off once a call breaks the chain
    grads_in_pool: bool = False  # a backward replay handed out parameter gradients that live in the pool
    pooled_grads: frozenset = frozenset()  # where those gradients live (data pointers)

    def call(self, index: int, *args, **kwargs):
        layer, forward = self.layers[index], self.forwards[index]
        if torch.compiler.is_compiling() or torch.cuda.is_current_stream_capturing():
            return forward(*args, **kwargs)
        why, params = self._scan(layer)
        if why is None:
            layout, tensors = split_call(args, kwargs)
            if layout is None:
                why = (f"a {tensors} object is passed (in training: pass use_cache=False)" if "Cache" in tensors
                       else f"an argument of type {tensors} cannot be captured")
        if why is None:
            why = self._ready(index, layout, tensors, params)
        if why is not None:
            self._note(why)
            return forward(*args, **kwargs)
        g = self.graphs[index]
        if self.grads_in_pool:
            self._keep_grads()
        self.replays += 1
        outs = _Replay.apply(self, g, *tensors, *g.params)
        return outs[0] if g.out_spec is None else pytree.tree_unflatten(list(outs), g.out_spec)

    def _ready(self, index, layout, tensors, params) -> str | None:
        """None when layer ``index`` can replay this call (capturing first if needed), else why not."""
        key = (layout, tensor_key(tensors), autocast_key(), self.layers[index].training, self.chain)
        if key != self.key or self.graphs[index].param_key != param_key(params):
            why = self._recapture(key, layout, tensors)
            if why is not None:
                return why
        g = self.graphs[index]
        if g.pending():
            return "an earlier forward of this layer still waits for its backward"
        if g.chained and tensors[0].data_ptr() != g.inputs[0].data_ptr():
            # Copying into the previous layer's output would change a tensor the caller may still
            # use; the next capture gives every layer input buffers of its own.
            self.chain = False
            return "the layer was passed something other than the previous layer's output (recaptured unchained)"
        return None

    def _keep_grads(self) -> None:
        """Parameter gradients still held in the pool (accumulation, ``zero_grad(set_to_none=False)``)
        get storage of their own before a forward replay can overwrite them."""
        self.grads_in_pool = False
        for g in self.graphs:
            for p in g.params:
                if p.grad is not None and p.grad.data_ptr() in self.pooled_grads:
                    p.grad = p.grad.clone()

    def release_replica(self, replica: nn.Module) -> None:
        """An nn.DataParallel replica of a layer runs its own forward, eagerly: the graphs hold the
        original layer's parameters and buffers, on one device."""
        if not isinstance(replica.__dict__.get("forward"), ResidualNormForward):  # rebound to the replica
            replica.__dict__.pop("forward", None)
        self._note("nn.DataParallel replica (DistributedDataParallel keeps the graphs)")

    def _scan(self, layer) -> tuple[str | None, tuple]:
        """(why the layer cannot replay now or None, its parameters), in one walk of its modules."""
        if self.disabled:
            return self.disabled, ()
        if not torch.is_grad_enabled():
            return "grad is disabled (graphs are captured for training steps)", ()
        if getattr(layer, "gradient_checkpointing", False) and layer.training:
            return "gradient checkpointing is on", ()
        if _fsdp2(layer):
            return "the layer is sharded by FSDP2 (fully_shard): its hooks gather and reduce around autograd, which a replay bypasses", ()
        # The layer's own hooks run around the replay, in its __call__; those of the modules inside
        # it would run only while capturing.
        params, inside = {}, []
        for mod in layer.modules():
            if mod is not layer:
                inside.append(mod)
            for p in mod._parameters.values():
                if p is not None:
                    params[id(p)] = p
        if hooked(*inside):
            return "hooks are registered on modules inside the layer (they would run only at capture)", ()
        return None, tuple(params.values())

    def _note(self, why: str) -> None:
        if why not in self.eager:
            log.info("torchfuser: %s runs eagerly: %s", self.name, why)
        self.eager[why] += 1

    def _recapture(self, key, layout, tensors) -> str | None:
        if self.graphs and any(g.pending() for g in self.graphs):
            return "a new input signature arrived while a replay waits for its backward"
        if self.captures > MAX_RECAPTURES:
            self.disabled = f"input signatures kept changing ({self.captures} captures): pad batches to one shape"
            return self.disabled
        self.key = self.graphs = None
        start = time.perf_counter()
        try:
            self.graphs = capture(self.layers, self.forwards, [self._scan(layer)[1] for layer in self.layers], layout,
                                  tensors, chain=self.chain)
        except Exception as err:  # a layer that reads values on the host, or otherwise cannot be captured
            first = str(err).splitlines()[0] if str(err) else type(err).__name__
            self.disabled = (f"the layer reads tensor values on the host, which a graph cannot capture ({first})"
                             if "synchronizing" in first else f"capture failed: {type(err).__name__}: {first}")
        if self.disabled:
            log.warning("torchfuser: CUDA graphs for %s turned off: %s", self.name, self.disabled)
            recover_from_failed_capture(torch.device("cuda", torch.cuda.current_device()))
            return self.disabled
        took = time.perf_counter() - start
        self.key = key
        self.pooled_grads = frozenset(s.data_ptr() for g in self.graphs for s in g.grad_inputs[len(g.inputs):] if s is not None)
        self.captures += 1
        self.capture_s += took
        log.info("torchfuser: captured CUDA graphs for %s (%d layers) in %.1f s", self.name, len(self.layers), took)
        return None

    def head(self) -> str:
        return f"cuda graphs: {self.name} ({len(self.layers)} × {type(self.layers[0]).__name__})"

    def describe(self) -> str:
        head = self.head()
        if self.captures == 0 and not self.eager:
            return f"{head}: captured at the first training step"
        text = f"{head}: {self.replays} layer calls replayed, {self.captures} capture(s) in {self.capture_s:.1f} s"
        if self.eager:
            text += "; eager calls: " + "; ".join(f"{n}× {why}" for why, n in self.eager.most_common())
        return text
