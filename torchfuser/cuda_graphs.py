"""CUDA graphs for a model's repeated blocks: ``torchfuser.optimize(model, cuda_graphs=True)``.

A training step of a small model is bound by the host: every fused op and every ATen op around
it costs tens of microseconds of Python and launch time, more than its kernel. Here each decoder
layer's forward and backward are captured once into two CUDA graphs and then replayed, so the
host launches two graphs per layer instead of every kernel in it.

A graph fixes what it saw at capture, so that is what a call must match to replay: the shapes,
strides, dtypes and ``requires_grad`` of its tensor arguments, the values of the others, the
autocast state, train/eval mode and the parameters' storage. One signature per stack is kept;
a new one is captured in its place (at most ``MAX_RECAPTURES`` times, then the stack stays
eager). A call a graph cannot serve runs the layer's own forward, and the reason is counted in
``torchfuser.report(model)``: under torch.compile, without grad, with a KV-cache object
(``use_cache=True`` in training), with gradient checkpointing, with hooks on modules inside the
layer, or while an earlier replay of the same layer still waits for its backward (several
forwards before one backward). A layer that reads tensor values on the host is found during the
warm-up before capture and left eager.

The price of replay:
- A layer's outputs live in the graph's buffers and the next step's replay overwrites them:
  clone what you keep across steps (``output_hidden_states``).
- Activations and gradients stay allocated between steps, in the graphs' memory pools.
- One backward per forward: a second backward through the same replay raises.
"""
from __future__ import annotations

import gc
import itertools
import logging
import time
import weakref
from collections import Counter
from contextlib import contextmanager
from dataclasses import dataclass, field
from functools import partial

import torch
from torch import Tensor, nn
from torch.utils import _pytree as pytree

from torchfuser.modules.base import FusedModule, no_host_reads

log = logging.getLogger("torchfuser")
_ATTR = "_torchfuser_cuda_graphs"
MAX_RECAPTURES = 3
_SCALARS = (bool, int, float, str)
# transformers hands the loss's keyword arguments down to every decoder layer, which ignores them;
# a count that changes with every batch must not make every call a new signature.
_LOSS_ONLY = ("num_items_in_batch",)


# ---------------------------------------------------------------------------------------------
# A call's signature: its tensors in order, and a key for everything else a graph fixes.


def split_call(args: tuple, kwargs: dict):
    """(layout, tensors) of a call, or (None, type name) when an argument cannot be captured.

    layout: one entry per argument — ``(name, "t")`` a tensor, ``(name, "seq", n)`` a tuple of
    n tensors (rotary cos/sin), ``(name, "v", type, value)`` a constant."""
    layout, tensors = [], []
    for name, v in itertools.chain(enumerate(args), kwargs.items()):
        if name in _LOSS_ONLY:
            continue
        if isinstance(v, Tensor):
            layout.append((name, "t"))
            tensors.append(v)
        elif isinstance(v, tuple) and v and all(isinstance(x, Tensor) for x in v):
            layout.append((name, "seq", len(v)))
            tensors.extend(v)
        elif v is None or type(v) in _SCALARS:
            layout.append((name, "v", type(v), v))
        else:
            return None, type(v).__name__
    return tuple(layout), tensors


def join_call(layout, tensors):
    """The (args, kwargs) that ``split_call`` took apart, with ``tensors`` in their places."""
    it = iter(tensors)
    args, kwargs = [], {}
    for entry in layout:
        name, kind = entry[0], entry[1]
        value = next(it) if kind == "t" else tuple(itertools.islice(it, entry[2])) if kind == "seq" else entry[3]
        if isinstance(name, int):
            args.append(value)
        else:
            kwargs[name] = value
    return tuple(args), kwargs


def tensor_key(tensors) -> tuple:
    return tuple((t.shape, t.stride(), t.dtype, t.device, t.requires_grad) for t in tensors)


def autocast_key() -> tuple:
    return (torch.is_autocast_enabled("cuda"), torch.get_autocast_dtype("cuda"))


def param_key(params) -> tuple:
    return tuple((id(p), p.data_ptr(), p.requires_grad) for p in params)


def _static_copy(t: Tensor) -> Tensor:
    return t.detach().clone().requires_grad_(t.requires_grad)


def _hooked(mod: nn.Module) -> bool:
    return bool(mod._forward_hooks or mod._forward_pre_hooks or mod._backward_hooks or mod._backward_pre_hooks)


def _global_hooks() -> bool:
    m = nn.modules.module
    return bool(m._global_forward_hooks or m._global_forward_pre_hooks or m._global_backward_hooks
                or m._global_backward_pre_hooks)


# ---------------------------------------------------------------------------------------------
# One layer's captured pair of graphs, and the autograd Function that replays it.


class _Token:
    """Lives as long as the autograd graph of one replay: weakly referenced to tell whether that
    replay's backward may still come."""

    __slots__ = ("__weakref__",)


@dataclass(eq=False)
class LayerGraphs:
    fwd: torch.cuda.CUDAGraph
    bwd: torch.cuda.CUDAGraph | None
    inputs: list[Tensor]  # static tensor arguments, in call order
    params: tuple[nn.Parameter, ...]
    param_key: tuple
    outputs: tuple[Tensor, ...]  # flattened static outputs
    out_spec: pytree.TreeSpec | None  # None: the forward returns one tensor
    stand_ins: list[nn.Parameter]  # what the capture's autograd graph differentiated for ``params``
    grad_outputs: list[Tensor | None] = field(default_factory=list)
    grad_inputs: tuple[Tensor | None, ...] = ()  # per input, then per parameter
    waiting: weakref.ref | None = None

    def pending(self) -> bool:
        return self.waiting is not None and self.waiting() is not None


class _Replay(torch.autograd.Function):
    @staticmethod
    def forward(ctx, g: LayerGraphs, *tensors):
        for static, t in zip(g.inputs, tensors):
            if static.data_ptr() != t.data_ptr():
                static.copy_(t)
        g.fwd.replay()
        ctx.graphs, ctx.token = g, _Token()
        # Gradients for leaves (an input the user holds) are copied: stolen by autograd they would
        # alias a buffer the next replay overwrites.
        ctx.leaf = [t.is_leaf and t.requires_grad for t in tensors[: len(g.inputs)]]
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
        for static, d in zip(g.grad_outputs, grads):
            if static is not None and d is not None and static.data_ptr() != d.data_ptr():
                static.copy_(d)
        n = len(g.inputs)
        for p, s in zip(g.params, g.grad_inputs[n:]):
            # p.grad still holding an earlier replay's buffer (accumulation, or zero_grad without
            # set_to_none): keep its value in a tensor of its own before the replay overwrites it.
            if s is not None and p.grad is not None and p.grad.data_ptr() == s.data_ptr():
                p.grad = p.grad.clone()
        g.bwd.replay()
        ins = tuple(None if s is None else s.clone() if leaf else s.detach() for s, leaf in zip(g.grad_inputs, ctx.leaf))
        return (None, *ins, *(None if s is None else s.detach() for s in g.grad_inputs[n:]))


# ---------------------------------------------------------------------------------------------
# A stack of layers of one class (``model.layers``): captured together, replayed one by one.


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
            key = (layout, tensor_key(tensors), autocast_key(), layer.training)
            if key != self.key or self.graphs[index].param_key != param_key(params):
                why = self._recapture(key, layout, tensors)
        if why is None and self.graphs[index].pending():
            why = "an earlier forward of this layer still waits for its backward"
        if why is not None:
            self._note(why)
            return forward(*args, **kwargs)
        g = self.graphs[index]
        self.replays += 1
        outs = _Replay.apply(g, *tensors, *g.params)
        return outs[0] if g.out_spec is None else pytree.tree_unflatten(list(outs), g.out_spec)

    def _scan(self, layer) -> tuple[str | None, tuple]:
        """(why the layer cannot replay now or None, its parameters), in one walk of its modules."""
        if self.disabled:
            return self.disabled, ()
        if not torch.is_grad_enabled():
            return "grad is disabled (graphs are captured for training steps)", ()
        if getattr(layer, "gradient_checkpointing", False) and layer.training:
            return "gradient checkpointing is on", ()
        # The layer's own hooks run around the replay, in its __call__; those of the modules inside
        # it would run only while capturing.
        params, hooked = {}, _global_hooks()
        for mod in layer.modules():
            hooked = hooked or (mod is not layer and _hooked(mod))
            for p in mod._parameters.values():
                if p is not None:
                    params[id(p)] = p
        if hooked:
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
            self.graphs = capture(self.layers, self.forwards, [self._scan(layer)[1] for layer in self.layers], layout, tensors)
        except Exception as err:  # a layer that reads values on the host, or otherwise cannot be captured
            first = str(err).splitlines()[0] if str(err) else type(err).__name__
            self.disabled = (f"the layer reads tensor values on the host, which a graph cannot capture ({first})"
                             if "synchronizing" in first else f"capture failed: {type(err).__name__}: {first}")
        if self.disabled:
            log.warning("torchfuser: CUDA graphs for %s turned off: %s", self.name, self.disabled)
            _recover_from_failed_capture(torch.device("cuda", torch.cuda.current_device()))
            return self.disabled
        self.key = key
        self.captures += 1
        self.capture_s += time.perf_counter() - start
        log.info("torchfuser: captured CUDA graphs for %s (%d layers) in %.1f s", self.name, len(self.layers),
                 time.perf_counter() - start)
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


@contextmanager
def _syncs_raise():
    mode = torch.cuda.get_sync_debug_mode()
    torch.cuda.set_sync_debug_mode("error")
    try:
        yield
    finally:
        torch.cuda.set_sync_debug_mode(mode)


def _recover_from_failed_capture(device) -> None:
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


def capture(layers, forwards, params, layout, tensors) -> list[LayerGraphs]:
    """Capture every layer's forward (in order), then every backward (in reverse): the order they
    replay in, which is what lets all the captures share one memory pool (a backward's scratch
    reuses what later layers' activations held)."""
    pool = torch.cuda.graph_pool_handle()
    enabled, dtype = autocast_key()

    def call(i, ts):
        args, kwargs = join_call(layout, ts)
        return forwards[i](*args, **kwargs)

    with torch.autocast("cuda", dtype=dtype, enabled=enabled, cache_enabled=False), no_host_reads():
        # Warm-up off the capture: compiles kernels, picks cuBLAS/cuDNN algorithms, and finds a
        # layer that reads values back to the host (which would break the capture) while that
        # is still harmless.
        torch.cuda.synchronize()
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side), _syncs_raise():
            for i in range(len(forwards)):
                sample = [_static_copy(t) for t in tensors]
                with _stand_ins(layers[i], params[i]) as stand:
                    outs = [o for o in pytree.tree_leaves(call(i, sample)) if isinstance(o, Tensor) and o.requires_grad]
                wrt = [t for t in (*sample, *stand) if t.requires_grad]
                if outs and wrt:
                    torch.autograd.grad(outs, wrt, [torch.randn_like(o) for o in outs], allow_unused=True)
        torch.cuda.current_stream().wait_stream(side)
        torch.cuda.synchronize()

        graphs = []
        for i in range(len(forwards)):
            # Each layer gets inputs of its own, even where they are its predecessor's output: a
            # replay copies into them, and that copy must never overwrite a tensor still in use.
            inputs = [_static_copy(t) for t in tensors]
            fwd = torch.cuda.CUDAGraph()
            with _stand_ins(layers[i], params[i]) as stand, torch.cuda.graph(fwd, pool=pool):
                out = call(i, inputs)
            flat, spec = pytree.tree_flatten(out)
            if not all(isinstance(o, Tensor) for o in flat):
                raise TypeError("the layer returns non-tensor values")
            spec = None if isinstance(out, Tensor) else spec
            graphs.append(LayerGraphs(fwd, None, inputs, params[i], param_key(params[i]), tuple(flat), spec, stand))

        for g in reversed(graphs):
            g.grad_outputs = [torch.empty_like(o) if o.requires_grad else None for o in g.outputs]
            outs = [o for o in g.outputs if o.requires_grad]
            need_in = [t for t in g.inputs if t.requires_grad]
            # Parameter gradients outlive the backward (they become p.grad, kept through the
            # optimizer step and across accumulation steps), while the pool's memory is reused by
            # the backwards of later layers, which replay first: so the graph copies them into
            # buffers of their own, outside the pool.
            need_p = [(p, torch.empty_like(p)) for p in g.stand_ins if p.requires_grad]
            d_in, d_p = [None] * len(need_in), [None] * len(need_p)
            if outs and (need_in or need_p):
                g.bwd = torch.cuda.CUDAGraph()
                with torch.cuda.graph(g.bwd, pool=pool):
                    grads = torch.autograd.grad(outs, need_in + [p for p, _ in need_p],
                                                [d for d in g.grad_outputs if d is not None], allow_unused=True)
                    d_in, d_p = grads[: len(need_in)], grads[len(need_in):]
                    pairs = [(kept, d) for (_, kept), d in zip(need_p, d_p) if d is not None]
                    if pairs:
                        torch._foreach_copy_([k for k, _ in pairs], [d for _, d in pairs])
            kept = {id(p): k for (p, k), d in zip(need_p, d_p) if d is not None}
            it = iter(d_in)
            g.grad_inputs = (*(next(it) if t.requires_grad else None for t in g.inputs), *(kept.get(id(p)) for p in g.stand_ins))
    return graphs


# ---------------------------------------------------------------------------------------------
# Installing on a model.


def find_stacks(model: nn.Module):
    """[(qualified name, ModuleList)]: lists of two or more layers of one class that hold fused modules."""
    found = []
    for name, mod in model.named_modules():
        if isinstance(mod, nn.ModuleList) and len(mod) >= 2 and len({type(m) for m in mod}) == 1:
            if any(isinstance(sub, FusedModule) for sub in mod[0].modules()):
                found.append((name, mod))
    return found


def _unsupported(model: nn.Module, layers) -> str | None:
    p = next(model.parameters(), None)
    if p is None or p.device.type != "cuda":
        return f"the model is on {p.device if p is not None else 'no device'}: move it to a CUDA device before optimize(..., cuda_graphs=True)"
    for layer in layers:
        if "forward" in layer.__dict__:
            return "a layer's forward is already replaced on the instance (accelerate hooks?)"
        for q in layer.parameters():
            if type(q) is not nn.Parameter or type(q.data) is not torch.Tensor or q.device != p.device:
                return "parameters are sharded, wrapped or spread over devices"
            if q._backward_hooks or getattr(q, "_post_accumulate_grad_hooks", None):
                return "parameters have gradient hooks (they would run only at capture)"
        if any(b.requires_grad for b in layer.buffers()):
            return "a buffer requires grad"
    return None


def install(model: nn.Module) -> list[str]:
    """Route every stack's layers through their graphs; report notes, one per stack."""
    if model.__dict__.get(_ATTR):
        return [s.describe() for s in model.__dict__[_ATTR]]
    stacks, notes = [], []
    found = find_stacks(model)
    if not found:
        return ["cuda graphs: not used — no stack of fused layers (a ModuleList of one layer class) found"]
    for name, layers in found:
        why = _unsupported(model, layers)
        if why:
            notes.append(f"cuda graphs: not used for {name} — {why}")
            continue
        stack = Stack(name, list(layers), [layer.forward for layer in layers])
        for i, layer in enumerate(layers):
            layer.forward = partial(stack.call, i)
        stacks.append(stack)
        notes.append(stack.describe())
    if stacks:
        model.__dict__[_ATTR] = stacks
        if getattr(getattr(model, "config", None), "use_cache", False):
            notes.append("cuda graphs: model.config.use_cache is True, so training calls pass a KV cache, which a "
                         "graph cannot capture: pass use_cache=False or set model.config.use_cache = False")
    return notes


def remove(model: nn.Module) -> None:
    for stack in model.__dict__.pop(_ATTR, []):
        for layer in stack.layers:
            layer.__dict__.pop("forward", None)
        stack.graphs = None


def refresh_notes(model: nn.Module, notes: list[str]) -> list[str]:
    """``notes`` with each graphed stack's line brought up to date (replays, captures, eager calls)."""
    stacks = model.__dict__.get(_ATTR)
    if not stacks:
        return notes
    heads = tuple(s.head() for s in stacks)
    return [n for n in notes if not n.startswith(heads)] + [s.describe() for s in stacks]


def describe(model: nn.Module) -> list[str] | None:
    stacks = model.__dict__.get(_ATTR)
    return None if stacks is None else [s.describe() for s in stacks]
