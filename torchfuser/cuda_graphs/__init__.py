"""CUDA graphs for a model's repeated blocks: ``torchfuser.optimize(model, cuda_graphs=True)``, or chosen per
stack where safe and measured faster by ``optimize(model)``'s default ``cuda_graphs="auto"`` (``auto.py``).

A training step of a small model is bound by the host: every fused op and every ATen op around
it costs tens of microseconds of Python and launch time, more than its kernel. Here each decoder
layer's forward and backward are captured once into two CUDA graphs and then replayed, so the
host launches two graphs per layer instead of every kernel in it.

A graph fixes what it saw at capture, so that is what a call must match to replay: the shapes,
dtypes and ``requires_grad`` of its tensor arguments, the values of the others, the autocast
state, train/eval mode and the parameters' storage. Sequence lengths are rounded up to length
buckets (``buckets.py``: the call is padded inside the graph path, the padding masked out, so the
result is the unpadded call's); each bucket gets its own set of graphs, all of a stack's sets are
captured into one memory pool, and their number and memory are bounded (``GraphOptions``: pass
``cuda_graphs=GraphOptions(...)``; the least recently used set is dropped for a new one). A stack
whose lengths keep leaving the kept sets (``CHURN`` drops per kept set) stops capturing and stays
eager. The report gives each bucket's steps and hit rate. A call a graph cannot serve runs the layer's own forward, and the reason is counted in
``torchfuser.report(model)``: under torch.compile, without grad, with a KV-cache object
(``use_cache=True`` in training), with gradient checkpointing, with hooks on modules inside the
layer, on packed rows (variable-length attention, eager, is faster there), or while an earlier replay of the same layer still waits for its backward (several
forwards before one backward). A layer that reads tensor values on the host is found during the
warm-up before capture and left eager.

Consecutive layers share buffers: a layer reads its predecessor's output buffer as its hidden
state, and the predecessor's backward reads the gradient buffer this layer's backward writes, so
a replay copies neither in. A call passing anything else breaks the chain: that call runs
eagerly and the next capture gives every layer input buffers of its own. Parameter gradients are
written into the pool too and handed to autograd as they are; one still held as ``p.grad`` when
the next forward replay starts (gradient accumulation) is copied out first.

The price of replay:
- A layer's outputs live in the graph's buffers and the next step's replay overwrites them:
  clone what you keep across steps (``output_hidden_states``).
- Activations and gradients stay allocated between steps, in the graphs' memory pools.
- One backward per forward: a second backward through the same replay raises.

Files: ``signature.py`` (what a call must match), ``buckets.py`` (length buckets and padding),
``capture.py`` (warm-up and capture), ``function.py`` (the autograd Function that replays a layer),
``replay.py`` (the per-stack decisions: which set of graphs serves a call, captures and drops).
"""
from __future__ import annotations

from functools import partial

import torch
from torch import nn

from torchfuser.cuda_graphs import auto as _auto
from torchfuser.cuda_graphs.buckets import GraphOptions
from torchfuser.cuda_graphs.replay import CHURN, Stack
from torchfuser.cuda_graphs.signature import join_call, split_call
from torchfuser.modules.adapters import quantized_base
from torchfuser.modules.base import FusedModule, follow_replicas, unfollow_replicas
from torchfuser.modules.residual_norm import ResidualNormForward  # ours on the instance: graphed, put back

__all__ = ["install", "install_auto", "remove", "detach", "reattach", "refresh_notes", "describe", "find_stacks",
           "split_call", "join_call", "GraphOptions", "CHURN", "options", "pool_bytes"]
_ATTR = "_torchfuser_cuda_graphs"
HEAD = "cuda graphs: "  # every report note made here starts so


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
        if "forward" in layer.__dict__ and not isinstance(layer.__dict__["forward"], ResidualNormForward):
            return "a layer's forward is already replaced on the instance (accelerate hooks?)"
        for q in layer.parameters():
            if why := param_problem(q, p.device):
                return why
            if q._backward_hooks or getattr(q, "_post_accumulate_grad_hooks", None):
                return "parameters have gradient hooks (they would run only at capture)"
        if any(b.requires_grad for b in layer.buffers()):
            return "a buffer requires grad"
    return None


def param_problem(q: nn.Parameter, device: torch.device) -> str | None:
    """Why a replay could not read the parameter ``q`` where the capture read it, or None. A frozen quantised
    base (bitsandbytes' Params4bit / Int8Params, torchao's NF4) is a tensor subclass, but its bytes stay where
    they are between steps and get no gradient: the fused LoRA node dequantises them inside the graph."""
    if q.device != device:
        return "parameters are spread over devices"
    if (type(q) is not nn.Parameter or type(q.data) is not torch.Tensor) and not quantized_base.frozen_bytes(q):
        return "parameters are sharded or wrapped (tensor subclasses)"
    return None


def install_auto(model: nn.Module, checkpointing: bool = False) -> list[str]:
    """``cuda_graphs="auto"`` (``auto.py``): stacks installed with an ``Auto`` policy on a CUDA device. Elsewhere
    nothing happens and nothing is said (CPU reports stay as they were); with checkpointing, one note."""
    p = next(model.parameters(), None)
    if p is None or p.device.type != "cuda":
        return []
    if checkpointing:
        return [f"{HEAD}auto: off (checkpointing is on: a captured layer cannot recompute in the backward)"]
    bound = _auto.MEMORY_FRACTION * _auto.device_bytes() / 2**30
    return install(model, GraphOptions(pool_gib=bound), auto=True)


def install(model: nn.Module, options: GraphOptions | None = None, auto: bool = False) -> list[str]:
    """Route every stack's layers through their graphs; report notes, one per stack."""
    options = GraphOptions() if options is None else options
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
        stack = Stack(name, list(layers), [layer.forward for layer in layers], options)
        if auto:
            stack.auto, stack.config = _auto.Auto(), getattr(model, "config", None)
        _route(stack)
        stacks.append(stack)
        notes.append(stack.describe())
    if stacks:
        model.__dict__[_ATTR] = stacks
        if getattr(getattr(model, "config", None), "use_cache", False):
            notes.append("cuda graphs: model.config.use_cache is True: a training call that does not pass "
                         "use_cache=False hands the layers a KV cache, which a graph cannot capture (such calls run "
                         "eager, counted with that reason); pass use_cache=False or set model.config.use_cache = False "
                         "(Hugging Face's Trainer and TRL's trainers do)")
    return notes


def _route(stack: Stack) -> None:
    for i, layer in enumerate(stack.layers):
        layer.forward = partial(stack.call, i)
        follow_replicas(layer, stack.release_replica)


def remove(model: nn.Module) -> None:
    detached = detach(model)
    for stack in detached[0] if detached else ():
        stack.sets.clear()


def detach(model: nn.Module) -> tuple[list[Stack], GraphOptions] | None:
    """Take the stacks out of the layers, as ``remove`` does, but keep what they captured: (stacks,
    their options) for ``reattach``, or None where none is installed."""
    stacks = model.__dict__.pop(_ATTR, None)
    if stacks is None:
        return None
    for stack in stacks:
        for layer, forward in zip(stack.layers, stack.forwards):
            layer.__dict__.pop("forward", None)
            if isinstance(forward, ResidualNormForward):
                layer.__dict__["forward"] = forward
            unfollow_replicas(layer)
    return stacks, stacks[0].options


def reattach(model: nn.Module, stacks: list[Stack]) -> None:
    """Route the layers through ``stacks`` again (``detach``'s), their captured graphs as they were."""
    for stack in stacks:
        _route(stack)
    model.__dict__[_ATTR] = stacks


def refresh_notes(model: nn.Module, notes: list[str]) -> list[str]:
    """``notes`` with each graphed stack's line brought up to date (replays, captures, eager calls)."""
    stacks = model.__dict__.get(_ATTR)
    if not stacks:
        return notes
    heads = tuple(s.head() for s in stacks)
    return [n for n in notes if not n.startswith(heads)] + [s.describe() for s in stacks]


def options(model: nn.Module) -> GraphOptions:
    """The options the model's stacks were installed with (the defaults where none is)."""
    stacks = model.__dict__.get(_ATTR)
    return stacks[0].options if stacks else GraphOptions()


def pool_bytes(model: nn.Module) -> tuple[int, int]:
    """(the device memory the model's CUDA graphs hold, the part of it that ``torch.cuda.memory_allocated``
    leaves out): what a peak of allocated memory misses while graphs replay. (0, 0) without graphs."""
    held = [s.pool_bytes() for s in model.__dict__.get(_ATTR) or ()]
    return sum(h for h, _ in held), sum(u for _, u in held)


def describe(model: nn.Module) -> list[str] | None:
    stacks = model.__dict__.get(_ATTR)
    return None if stacks is None else [s.describe() for s in stacks]
