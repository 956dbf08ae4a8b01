"""Capturing a stack of layers: warm-up, the forward graphs in order, the backward graphs in reverse."""
from __future__ import annotations

import gc
import weakref
from contextlib import contextmanager
from dataclasses import dataclass, field

import torch
from torch import Tensor, nn
from torch.utils import _pytree as pytree

from torchfuser.cuda_graphs.signature import autocast_key, join_call, param_key
from torchfuser.modules.base import no_host_reads


@dataclass(eq=False)
class LayerGraphs:
    """One layer's captured forward and backward graphs and the static tensors they read and write."""

    fwd: torch.cuda.CUDAGraph
    bwd: torch.cuda.CUDAGraph | None
    inputs: list[Tensor]  # static tensor arguments, in call order
    params: tuple[nn.Parameter, ...]
    param_key: tuple
    outputs: tuple[Tensor, ...]  # flattened static outputs
    out_spec: pytree.TreeSpec | None  # None: the forward returns one tensor
    stand_ins: list[nn.Parameter]  # what the capture's autograd graph differentiated for ``params``
    chained: bool = False  # inputs[0] is the previous layer's outputs[0] (and so are their gradients)
    grad_outputs: list[Tensor | None] = field(default_factory=list)
    grad_inputs: tuple[Tensor | None, ...] = ()  # per input, then per parameter
    waiting: weakref.ref | None = None
    handed: tuple = ()  # cuda_graphs="auto": weak references to the outputs the last replay handed out

    def pending(self) -> bool:
        return self.waiting is not None and self.waiting() is not None


def _static_copy(t: Tensor) -> Tensor:
    return t.detach().clone().requires_grad_(t.requires_grad)


@contextmanager
def _no_gc():
    """Python's cyclic collector off while capturing: run inside a capture, it may destroy an
    unreachable CUDA graph or release its pool, calls that invalidate the capture. (Each
    ``torch.cuda.graph`` still collects once before its capture begins.)"""
    enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if enabled:
            gc.enable()


@contextmanager
def _syncs_raise():
    mode = torch.cuda.get_sync_debug_mode()
    torch.cuda.set_sync_debug_mode("error")
    try:
        yield
    finally:
        torch.cuda.set_sync_debug_mode(mode)


def recover_from_failed_capture(device) -> None:
    """A capture that failed part-way can leave the CUDA generator marked as capturing, and every
    later random op would then fail. Dropping the failed graphs and ending one small capture
    cleanly resets it; if even that fails, say so now rather than at the user's next dropout."""
    gc.collect()
    try:
        probe = torch.cuda.CUDAGraph()
        with torch.cuda.graph(probe):
            torch.rand(1, device=device)
        del probe
        torch.rand(1, device=device)
    except Exception as err:
        raise RuntimeError(
            "torchfuser: a failed CUDA graph capture left CUDA's random generator unusable in this "
            "process; restart it and optimize the model without cuda_graphs=True"
        ) from err


@contextmanager
def _stand_ins(layer: nn.Module, params):
    """The layer's parameters replaced, for the span, by new leaves over the same storage.

    A capture then reads the parameters' memory, as it must, but its autograd graph ends at
    leaves of its own: the parameters' gradient accumulators, which the caller's autograd graph
    may hold on another stream (a cross-stream wait breaks a capture), are never touched, and the
    replays' gradients reach them through ``_Replay`` on the caller's stream."""
    stand = {id(p): nn.Parameter(p.detach(), requires_grad=p.requires_grad) for p in params}
    slots = [(m, name, q) for m in layer.modules() for name, q in m._parameters.items() if q is not None and id(q) in stand]
    for m, name, q in slots:
        m._parameters[name] = stand[id(q)]
    try:
        yield [stand[id(p)] for p in params]
    finally:
        for m, name, q in slots:
            m._parameters[name] = q


def _chains(prev: LayerGraphs | None, tensors) -> bool:
    """Whether the layer's first tensor argument can be the previous layer's first output itself."""
    if prev is None or not tensors:
        return False
    o, t = prev.outputs[0], tensors[0]
    return (o.shape, o.stride(), o.dtype) == (t.shape, t.stride(), t.dtype)


def _hidden_sample(tensors, wants_grad: bool) -> list[Tensor]:
    """Static copies of a call's tensors, the hidden state requiring grad as this layer's will: layer 0's
    as the caller's (frozen embeddings under LoRA give one that does not), a later layer's as the
    previous layer's output does."""
    sample = [_static_copy(t) for t in tensors]
    if sample:
        sample[0].requires_grad_(wants_grad)
    return sample


def _first_out(out) -> Tensor | None:
    leaves = [o for o in pytree.tree_leaves(out) if isinstance(o, Tensor)]
    return leaves[0] if leaves else None


def capture(layers, forwards, params, layout, tensors, chain: bool = True, pool=None) -> list[LayerGraphs]:
    """Capture every layer's forward (in order), then every backward (in reverse): the order they
    replay in, which is what lets all the captures share one memory pool (a backward's scratch
    reuses what later layers' activations held).

    With ``chain``, a layer whose first argument is shaped like the previous layer's first output
    (the hidden state a decoder passes on) reads that output's buffer directly, and the previous
    layer's backward reads this layer's gradient buffer for it: a replay then copies neither the
    hidden state in nor its gradient back (``Stack.call`` checks that the call passes that very
    buffer, and recaptures without chaining when something runs between the layers). ``pool``: the
    memory pool to capture into (a new one by default); a stack's length buckets share one."""
    pool = torch.cuda.graph_pool_handle() if pool is None else pool
    enabled, dtype = autocast_key()

    def call(i, ts):
        args, kwargs = join_call(layout, ts)
        return forwards[i](*args, **kwargs)

    with torch.autocast("cuda", dtype=dtype, enabled=enabled, cache_enabled=False), no_host_reads():
        _warm_up(layers, params, tensors, call)
        with _no_gc():
            graphs = _capture_forwards(layers, params, tensors, call, pool, chain)
            _capture_backwards(graphs, pool)
    return graphs


def _warm_up(layers, params, tensors, call) -> None:
    """Every layer's forward and backward once, off the capture: compiles kernels, picks cuBLAS and
    cuDNN algorithms, and finds a layer that reads values back to the host (which would break the
    capture) while that is still harmless."""
    torch.cuda.synchronize()
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    wants_grad = bool(tensors) and tensors[0].requires_grad
    # Gradients from a generator of its own (made before syncs raise): warming up must not move the caller's.
    gen = torch.Generator(device=tensors[0].device).manual_seed(0)
    with torch.cuda.stream(side), _syncs_raise():
        for i in range(len(layers)):
            sample = _hidden_sample(tensors, wants_grad)
            with _stand_ins(layers[i], params[i]) as stand:
                out = call(i, sample)
                first = _first_out(out)
                wants_grad = first is not None and first.requires_grad
                outs = [o for o in pytree.tree_leaves(out) if isinstance(o, Tensor) and o.requires_grad]
            wrt = [t for t in (*sample, *stand) if t.requires_grad]
            if outs and wrt:
                grads = [torch.empty_like(o).normal_(generator=gen) for o in outs]
                torch.autograd.grad(outs, wrt, grads, allow_unused=True)
    torch.cuda.current_stream().wait_stream(side)
    torch.cuda.synchronize()


def _capture_forwards(layers, params, tensors, call, pool, chain: bool) -> list[LayerGraphs]:
    graphs = []
    for i in range(len(layers)):
        # Inputs of its own, except a chained hidden state: a replay copies into these, and that
        # copy must never overwrite a tensor still in use.
        prev = graphs[-1] if graphs else None
        chained = chain and _chains(prev, tensors)
        wants_grad = prev.outputs[0].requires_grad if prev is not None else bool(tensors) and tensors[0].requires_grad
        inputs = _hidden_sample(tensors, wants_grad)
        if chained:  # a new leaf over the buffer, so that each capture's autograd graph ends at its inputs
            inputs[0] = prev.outputs[0].detach().requires_grad_(wants_grad)
        fwd = torch.cuda.CUDAGraph()
        with _stand_ins(layers[i], params[i]) as stand, torch.cuda.graph(fwd, pool=pool):
            out = call(i, inputs)
        flat, spec = pytree.tree_flatten(out)
        if not all(isinstance(o, Tensor) for o in flat):
            raise TypeError("the layer returns non-tensor values")
        spec = None if isinstance(out, Tensor) else spec
        graphs.append(LayerGraphs(fwd, None, inputs, params[i], param_key(params[i]), tuple(flat), spec, stand, chained))
    return graphs


def _capture_backwards(graphs: list[LayerGraphs], pool) -> None:
    """Each layer's backward graph, last layer first (the order they replay in)."""
    for i in reversed(range(len(graphs))):
        g, after = graphs[i], graphs[i + 1] if i + 1 < len(graphs) else None
        g.grad_outputs = [torch.empty_like(o) if o.requires_grad else None for o in g.outputs]
        if after is not None and after.chained and after.grad_inputs[0] is not None:
            g.grad_outputs[0] = after.grad_inputs[0]
        outs = [o for o in g.outputs if o.requires_grad]
        need_in = [t for t in g.inputs if t.requires_grad]
        # Parameter gradients stay in the pool: they become p.grad, which later layers' forward
        # replays may overwrite (their activations can share that memory), so Stack clones any
        # p.grad still held there before the next forward replay (gradient accumulation).
        need_p = [p for p in g.stand_ins if p.requires_grad]
        d_in, d_p = [None] * len(need_in), [None] * len(need_p)
        if outs and (need_in or need_p):
            g.bwd = torch.cuda.CUDAGraph()
            with torch.cuda.graph(g.bwd, pool=pool):
                grads = torch.autograd.grad(outs, need_in + need_p, [d for d in g.grad_outputs if d is not None],
                                            allow_unused=True)
            d_in, d_p = grads[: len(need_in)], grads[len(need_in):]
        by_param = dict(zip(map(id, need_p), d_p))
        it = iter(d_in)
        g.grad_inputs = (*(next(it) if t.requires_grad else None for t in g.inputs),
                         *(by_param.get(id(p)) for p in g.stand_ins))
