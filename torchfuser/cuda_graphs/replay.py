"""The stack of captured layers that decides, call by call, whether a graph can serve it and which
bucket's (the autograd Function that replays one layer is in ``function.py``)."""
from __future__ import annotations

import logging
import time
import weakref
from collections import Counter
from dataclasses import dataclass, field

import torch
from torch import nn
from torch.utils import _pytree as pytree

from torchfuser.cuda_graphs import auto as _auto, buckets
from torchfuser.cuda_graphs.buckets import GraphOptions, Padding
from torchfuser.cuda_graphs.capture import LayerGraphs, capture, recover_from_failed_capture
from torchfuser.cuda_graphs.function import _Replay
from torchfuser.cuda_graphs.signature import autocast_key, join_call, param_key, split_call
from torchfuser.modules import packed
from torchfuser.modules.adapters import quantized_base
from torchfuser.modules.base import hooked, loaded_fsdp
from torchfuser.modules.residual_norm import ResidualNormForward

log = logging.getLogger("torchfuser")
CHURN = 2  # sets of graphs dropped per kept set before a stack stops capturing: lengths spread too wide


def _fsdp2(mod: nn.Module) -> bool:
    fsdp = loaded_fsdp()
    return fsdp is not None and isinstance(mod, getattr(fsdp, "FSDPModule", ()))


def _memory() -> tuple[int, int]:
    return torch.cuda.memory_allocated(), torch.cuda.memory_reserved()


def _took(before: tuple[int, int], after: tuple[int, int]) -> tuple[int, int]:
    """What a capture took, and how much of it reads as unallocated: the larger of the allocated and the
    reserved growth, and the reserved growth beyond the allocated. Once a capture ends, the caching allocator
    counts the blocks its graphs use and free again (saved activations the backward consumed, scratch) as
    unallocated, yet they stay reserved for the private pool, and replays allocate nothing: the allocated
    growth alone (and ``max_memory_allocated``) leaves much of a set out (llama1b on an H100: 5.9 of 12.9 GiB).
    The reserved growth also counts what the capture's warm-up added to the cache."""
    allocated, reserved = after[0] - before[0], after[1] - before[1]
    return max(allocated, reserved, 0), max(reserved - max(allocated, 0), 0)


@dataclass(eq=False)
class Bucket:
    """One set of graphs, every layer's, for one call signature: one length bucket (or one exact length)."""

    graphs: list[LayerGraphs]
    length: int  # the sequence length the graphs were captured for
    bytes: int  # device memory the capture took (static buffers, saved activations, the pool's scratch): _took
    unallocated: int = 0  # of those, what reads as unallocated though the pool keeps it reserved
    used: int = 0  # the stack's step count at its last use: the least recently used set is dropped first

    def pending(self) -> bool:
        return any(g.pending() for g in self.graphs)


@dataclass(eq=False)
class Stack(_auto.StackPolicy):
    name: str
    layers: list[nn.Module]
    forwards: list  # each layer's own bound forward
    options: GraphOptions = field(default_factory=GraphOptions)
    sets: dict = field(default_factory=dict)  # signature key → Bucket, least recently captured first
    retired: list = field(default_factory=list)  # stale sets a replay may still wait on (dropped at the next capture)
    pool: tuple | None = None  # the memory pool every bucket's graphs are captured into
    captures: int = 0
    capture_s: float = 0.0
    replays: int = 0
    steps: int = 0  # layer-0 replays
    dropped: int = 0  # sets dropped to make room
    most: int = 0  # the most sets held at once: what the bounds let fit
    served: Counter = field(default_factory=Counter)  # bucket length → steps its graphs served
    captured: Counter = field(default_factory=Counter)  # bucket length → captures
    exact: str | None = None  # why calls get graphs per exact length rather than per length bucket
    checked: bool = False  # the padding check (buckets.check) has passed
    disabled: str | None = None
    eager: Counter = field(default_factory=Counter)
    chain: bool = True  # capture with chained hidden states (capture.capture); off once a call breaks the chain
    grads_in_pool: bool = False  # a backward replay handed out parameter gradients that live in the pool
    pooled_grads: frozenset = frozenset()  # where those gradients live (data pointers)
    auto: _auto.Auto | None = None  # cuda_graphs="auto": graphs only where safe and measured faster
    config: object = None  # the model's config (auto reads output_hidden_states / output_attentions)
    mode: str = "graphs"  # auto: how layer 0's call ran this step, which the other layers follow
    mem0: int | None = None  # auto: memory allocated as layer 0's eager timed call began

    def call(self, index: int, *args, **kwargs):
        layer, forward = self.layers[index], self.forwards[index]
        if torch.compiler.is_compiling() or torch.cuda.is_current_stream_capturing():
            return forward(*args, **kwargs)
        why = self._auto_safe(layer) if self.auto is not None else None
        params = ()
        if why is None:
            why, params = self._scan(layer)
        if why is None:
            layout, tensors = split_call(args, kwargs)
            if layout is None:
                why = (f"a {tensors} object is passed (in training: pass use_cache=False)" if "Cache" in tensors
                       else f"an argument of type {tensors} cannot be captured")
        if why is None and packed.segments(kwargs.get("attention_mask"), kwargs.get("position_ids")) is not None:
            why = ("packed rows: variable-length attention reads the samples' offsets on the host, so the layer "
                   "runs eagerly (faster than a graph of attention over the dense block mask)")
        bucket = pad = None
        if why is None and self.auto is not None:
            why = self._auto_step(index, tensors)
        if why is None:
            pad = self._padding(index, layout, tensors)
            why, bucket = self._ready(index, layout, tensors, params, pad)
        if why is not None:
            self._note(why)
            if self.auto is not None:
                if self.disabled and self.retired:  # a capture just failed: its memory back before the eager call
                    self._free_retired()
                if index == 0:
                    self.idle_call(why)
            if why is _auto.EAGER_TIMING and index == len(self.layers) - 1:
                return self._probed(forward(*args, **kwargs))
            return forward(*args, **kwargs)
        g = bucket.graphs[index]
        if self.auto is not None and self._outputs_kept(index, g):
            # Still referenced after its backward: a replay would overwrite what its holder sees.
            self.auto.give_up("an output of the previous replay is still referenced (output_hidden_states collected "
                              "by the model, a hook or a variable): the next replay would overwrite it")
            self.release()
            self._note(self.disabled)
            return forward(*args, **kwargs)
        if self.grads_in_pool:
            self._keep_grads()
        self.replays += 1
        if index == 0:
            self.steps += 1
            bucket.used = self.steps
            self.served[bucket.length] += 1
        outs = _Replay.apply(self, g, pad, *tensors, *g.params)
        if self.auto is not None:
            g.handed = tuple(weakref.ref(o) for o in outs)
        return outs[0] if g.out_spec is None else pytree.tree_unflatten(list(outs), g.out_spec)

    def _padding(self, index, layout, tensors) -> Padding:
        """How this call maps to a bucket's buffers: padded to its length bucket, or as it is."""
        if self.exact is None:
            pad = buckets.padding(layout, tensors, self.options)
            if isinstance(pad, str):
                self.exact = pad
            elif pad.pads and not self.checked:  # the first call that pads: is padding exact for this layer?
                if index != 0:  # checked on layer 0's call
                    return Padding.exact(tensors)
                self.exact = self._check(layout, tensors, pad)
                self.checked = self.exact is None
            if self.exact is None:
                return pad
        return Padding.exact(tensors)

    def _check(self, layout, tensors, pad) -> str | None:
        layer = self.layers[0]
        modes = [(m, m.training) for m in layer.modules()]
        layer.eval()
        try:
            why = buckets.check(self.forwards[0], layout, tensors, pad, join_call)
        except Exception as err:  # the layer refuses the padded shapes: it gets graphs per exact length
            why = f"the padded call raised {type(err).__name__}: {str(err).splitlines()[0] if str(err) else ''}"
        finally:
            for m, mode in modes:
                m.training = mode
        if why is not None:
            log.info("torchfuser: %s gets CUDA graphs per exact length: %s", self.name, why)
        return why

    def _ready(self, index, layout, tensors, params, pad: Padding):
        """(None, the bucket) when layer ``index`` can replay this call (capturing first if needed),
        else (why not, None)."""
        # The hidden state's requires_grad is no part of the key: layer 0's may differ from the others'
        # (frozen embeddings), and each layer's graphs were captured with its own (checked below).
        meta = tuple((pad.shape(t, r), t.dtype, t.device, t.requires_grad and i > 0)
                     for i, (t, r) in enumerate(zip(tensors, pad.rules)))
        key = (layout, meta, autocast_key(), self.layers[index].training, self.chain)
        bucket = self.sets.get(key)
        stale = bucket is not None and (bucket.graphs[index].param_key != param_key(params)
                                        or index == 0 and bucket.graphs[0].inputs[0].requires_grad != tensors[0].requires_grad)
        if stale:
            self._retire()  # the parameters' storage changed (moved, reloaded), or the embeddings' training
            bucket = None
        if bucket is None:
            why, bucket = self._capture(key, layout, tensors, pad)
            if why is not None:
                return why, None
        g = bucket.graphs[index]
        if g.inputs[0].requires_grad != tensors[0].requires_grad:
            return "the hidden state requires grad where the capture's did not, or the other way round", None
        if g.pending():
            return "an earlier forward of this layer still waits for its backward", None
        if g.chained and tensors[0].data_ptr() != g.inputs[0].data_ptr():
            # Copying into the previous layer's output would change a tensor the caller may still
            # use; the next capture gives every layer input buffers of its own.
            self.chain = False
            self._retire()
            return "the layer was passed something other than the previous layer's output (recaptured unchained)", None
        return None, bucket

    def _keep_grads(self) -> None:
        """Parameter gradients still held in the pool (accumulation, ``zero_grad(set_to_none=False)``)
        get storage of their own before a forward replay can overwrite them."""
        self.grads_in_pool = False
        for layer in self.layers:
            for p in layer.parameters():
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
                # (a frozen quantised base is read in place: no stand-in, no gradient; plain ones skip the check)
                if p is not None and (type(p) is nn.Parameter or not quantized_base.frozen_bytes(p)):
                    params[id(p)] = p
        if hooked(*inside):
            return "hooks are registered on modules inside the layer (they would run only at capture)", ()
        return None, tuple(params.values())

    def _note(self, why: str) -> None:
        if why not in self.eager:
            log.info("torchfuser: %s runs eagerly: %s", self.name, why)
        self.eager[why] += 1

    def _make_room(self, length: int) -> str | None:
        """Drop least recently used sets until a new one of ``length`` fits (max_buckets, pool_gib)."""
        cap = None if self.options.pool_gib is None else self.options.pool_gib * 2**30
        while self.sets:
            need = max((b.bytes * length / max(b.length, 1) for b in self.sets.values()), default=0)
            held = sum(b.bytes for b in self.sets.values())
            if len(self.sets) < self.options.max_buckets and (cap is None or held + need <= cap):
                return None
            idle = [(b.used, k) for k, b in self.sets.items() if not b.pending()]
            if not idle:
                return "every kept set of graphs waits for its backward, and a new length arrived"
            self.sets.pop(min(idle)[1]).graphs = None
            self.dropped += 1
        return None

    def _retire(self) -> None:
        self.retired += self.sets.values()
        self.sets.clear()

    def _capture(self, key, layout, tensors, pad: Padding):
        if any(b.pending() for b in (*self.sets.values(), *self.retired)):
            return "a new input signature arrived while a replay waits for its backward", None
        for b in self.retired:
            b.graphs = None
        self.retired.clear()
        if self.dropped >= CHURN * max(self.most, 1):
            self.disabled = (f"lengths kept leaving the {self.most} set(s) of graphs that fit ({self.captures} captures, "
                             f"{self.dropped} dropped): raise GraphOptions(max_buckets=..., pool_gib=...) or pad "
                             "batches to fewer lengths")
            return self.disabled, None
        length = pad.l or (tensors[0].shape[1] if tensors and tensors[0].dim() >= 2 else 0)
        why = self._make_room(length)
        if why is not None:
            return why, None
        if not self.sets or self.pool is None:
            # A pool lives while a graph captured into it does: once every set is gone, capture into a new one
            # (capturing into a pool whose graphs were all destroyed trips the caching allocator's asserts).
            self.pool = torch.cuda.graph_pool_handle()
        sample = pad.sample(tensors) if pad.l else tensors
        start, before = time.perf_counter(), _memory()
        graphs = None
        try:
            graphs = capture(self.layers, self.forwards, [self._scan(layer)[1] for layer in self.layers], layout,
                             sample, chain=self.chain, pool=self.pool)
        except Exception as err:  # a layer that reads values on the host, or otherwise cannot be captured
            first = str(err).splitlines()[0] if str(err) else type(err).__name__
            self.disabled = (f"the layer reads tensor values on the host, which a graph cannot capture ({first})"
                             if "synchronizing" in first else f"capture failed: {type(err).__name__}: {first}")
        if self.disabled:
            log.warning("torchfuser: CUDA graphs for %s turned off: %s", self.name, self.disabled)
            self._retire()
            recover_from_failed_capture(torch.device("cuda", torch.cuda.current_device()))
            return self.disabled, None
        took = time.perf_counter() - start
        bucket = self.sets[key] = Bucket(graphs, length, *_took(before, _memory()))
        self.pooled_grads = frozenset(s.data_ptr() for b in self.sets.values() for g in b.graphs
                                      for s in g.grad_inputs[len(g.inputs):] if s is not None)
        self.captures += 1
        self.most = max(self.most, len(self.sets))
        self.captured[length] += 1
        self.capture_s += took
        log.info("torchfuser: captured CUDA graphs for %s (%d layers, length %d) in %.1f s", self.name,
                 len(self.layers), length, took)
        return None, bucket

    def pool_bytes(self) -> tuple[int, int]:
        """(what the kept and retired sets of graphs hold, the part of it ``memory_allocated`` does not count)."""
        sets = (*self.sets.values(), *self.retired)
        return sum(b.bytes for b in sets), sum(b.unallocated for b in sets)

    def head(self) -> str:
        return f"cuda graphs: {self.name} ({len(self.layers)} × {type(self.layers[0]).__name__})"

    def describe(self) -> str:
        head = self.head()
        if self.captures == 0 and not self.eager:
            return f"{head}: " + (f"auto: {self.auto.describe()}" if self.auto is not None
                                  else "captured at the first training step")
        text = f"{head}: {self.replays} layer calls replayed, {self.captures} capture(s) in {self.capture_s:.1f} s"
        if self.served:
            kind = "exact lengths" if self.exact else "length buckets"
            rates = ", ".join(f"{n}: {self.served[n]} steps, {_rate(self.served[n], self.captured[n])} hits"
                              for n in sorted(self.served))
            held = sum(b.bytes for b in self.sets.values()) / 2**30
            text += (f"; {kind} ({rates}); {len(self.sets)} set(s) kept (max {self.options.max_buckets}), "
                     f"{held:.1f} GiB")
            if self.dropped:
                text += f", {self.dropped} dropped to make room"
        if self.exact and self.served:
            text += f"; graphs per exact length: {self.exact}"
        if self.auto is not None:
            text += f"; auto: {self.auto.describe()}"
        if self.eager:
            text += "; eager calls: " + "; ".join(f"{n}× {why}" for why, n in self.eager.most_common())
        return text


def _rate(steps: int, captures: int) -> str:
    return f"{100 * (steps - captures) / steps:.0f}%" if steps else "—"
