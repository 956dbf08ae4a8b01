"""Activation checkpointing of the fused decoder layers, the input kept on the host (``checkpointing="offload"``).

    forward:  x ── layer ── y        nothing of the layer is kept but x (on the host, on CUDA)
    backward: x back on the device ── layer again (with its graph) ── gradients

Each fused decoder layer (``modules.residual_norm``) runs inside ``torch.utils.checkpoint`` (non-reentrant:
the forward is the plain fused forward, the random generators and autocast are kept for the recompute,
parameter gradients reach ``.grad`` / ``autograd.grad`` as without it), wrapped in saved-tensor hooks of
its own. Inside the checkpoint its hooks keep nothing; the only tensor saved outside them is what
``checkpoint`` keeps to recompute from: the layer input x. Our hooks see that one:

- on CUDA (``"offload"``) x is copied to pinned host memory on a side stream (one per device), after the
  compute stream's work that wrote it; x's device memory goes back to the allocator once the copy is done
  (``record_stream``), so no layer input stays on the GPU. In the backward, when a layer's recompute asks
  for its input, the input of the layer before it (the next one the backward reaches) is copied back on
  the side stream while this layer recomputes and runs its backward: two layer inputs on the device at a
  time, at most (double buffering). The compute stream waits for a copy's event only where it reads it.
- on the CPU the "host" is where x already is: x itself is kept (the semantics, and the bytes, are the
  same: one layer input a layer).
- ``checkpointing=True`` keeps x where it is (recompute without offload).

Gradient checkpointing enabled by Hugging Face (``gradient_checkpointing_enable``) on a layer wins there:
its checkpoint runs and this one stands aside, so no layer is checkpointed twice (``hf_on``).
Under torch.compile a checkpointed layer is a graph break: it runs eagerly, fused, with its hooks
(``eager``), and the compiler compiles what lies between the layers. CUDA graphs are refused (a captured
layer cannot copy to the host and back at the right moments: ``settings.merge``).
"""
from __future__ import annotations

import weakref

import torch
from torch import Tensor, nn
from torch.utils.checkpoint import checkpoint

from torchfuser.modules import recompute

KEY = "_torchfuser_checkpointing"
MODES = (False, True, "offload")


class _Parked:
    """A layer input kept for the backward: on the host (CUDA, offload) or as it is."""

    __slots__ = ("host", "device", "copied", "fetched", "prev", "__weakref__")

    def __init__(self, host: Tensor, device, copied, prev):
        self.host, self.device, self.copied, self.prev = host, device, copied, prev
        self.fetched = None  # (device tensor, event) copied back ahead of its use


class Checkpointing:
    """The checkpointing of one model's fused layers: its mode, the side streams, the last input parked.
    A model saved or copied whole keeps the mode only."""

    def __init__(self, mode):
        self.mode = mode
        self._streams: dict = {}
        self._last = None  # weakref to the input parked last: the backward reaches its layer first

    def __getstate__(self):
        return {"mode": self.mode}

    def __setstate__(self, state):
        self.__init__(state["mode"])

    def __repr__(self) -> str:
        return f"Checkpointing({self.mode!r})"

    def applies(self, layer: nn.Module) -> bool:
        """Whether this call of ``layer`` is checkpointed here: training with gradients, and Hugging Face's
        checkpointing not on for the layer (it checkpoints the call itself then)."""
        return layer.training and torch.is_grad_enabled() and not hf_on(layer)

    def run(self, fn, x: Tensor):
        """``fn(x)`` checkpointed, x kept as the mode says."""
        outer = recompute._outer()
        if outer:  # a counting hook (bench, tests) sees what is kept: the host copy, or x
            pack, unpack = outer

            def counted_pack(t):
                kept = self._pack(t)
                return kept, pack(kept.host if isinstance(kept, _Parked) else kept)

            def counted_unpack(packed):
                unpack(packed[1])
                return self._unpack(packed[0])

            hooks = torch.autograd.graph.saved_tensors_hooks(counted_pack, counted_unpack)
        else:
            hooks = torch.autograd.graph.saved_tensors_hooks(self._pack, self._unpack)
        with hooks:
            return checkpoint(fn, x, use_reentrant=False)

    # x on the way in (forward) and out (backward)
    def _pack(self, t: Tensor):
        if self.mode != "offload" or t.device.type != "cuda":
            return t
        stream = self._stream(t.device)
        host = torch.empty(t.size(), dtype=t.dtype, pin_memory=True)
        stream.wait_stream(torch.cuda.current_stream(t.device))
        with torch.cuda.stream(stream):
            host.copy_(t, non_blocking=True)
            copied = torch.cuda.Event()
            copied.record(stream)
        t.record_stream(stream)  # its memory is reused only once the copy has read it
        prev = self._last() if self._last is not None else None
        parked = _Parked(host, t.device, copied, weakref.ref(prev) if prev is not None else None)
        self._last = weakref.ref(parked)
        return parked

    def _unpack(self, packed):
        if not isinstance(packed, _Parked):
            return packed
        current = torch.cuda.current_stream(packed.device)
        if packed.fetched is not None:
            t, ready = packed.fetched
            packed.fetched = None
            current.wait_event(ready)
        else:
            current.wait_event(packed.copied)
            t = torch.empty(packed.host.size(), dtype=packed.host.dtype, device=packed.device)
            t.copy_(packed.host, non_blocking=True)
        prev = packed.prev() if packed.prev is not None else None
        if prev is not None and prev.fetched is None and prev.device == packed.device:
            self._prefetch(prev, current)
        return t

    def _prefetch(self, parked: _Parked, current) -> None:
        """The input of the layer the backward reaches next, copied back while this one runs."""
        t = torch.empty(parked.host.size(), dtype=parked.host.dtype, device=parked.device)  # on the compute stream
        stream = self._stream(parked.device)
        stream.wait_stream(current)  # t's memory is free for the side stream once the compute stream got here
        with torch.cuda.stream(stream):
            t.copy_(parked.host, non_blocking=True)
            ready = torch.cuda.Event()
            ready.record(stream)
        parked.fetched = (t, ready)

    def _stream(self, device):
        stream = self._streams.get(device)
        if stream is None:
            stream = self._streams[device] = torch.cuda.Stream(device)
        return stream


def hf_on(layer: nn.Module) -> bool:
    """Hugging Face gradient checkpointing enabled on ``layer`` (it checkpoints training calls itself)."""
    return bool(getattr(layer, "gradient_checkpointing", False)) and layer.training


def of(layer: nn.Module) -> Checkpointing | None:
    return layer.__dict__.get(KEY)


def set_mode(layers: list[nn.Module], mode) -> Checkpointing | None:
    """Every layer in ``layers`` checkpointed as ``mode`` says (one state shared: the backward prefetches
    across layers), or not at all (``False``)."""
    state = Checkpointing(mode) if mode else None
    for layer in layers:
        if state is None:
            layer.__dict__.pop(KEY, None)
        else:
            layer.__dict__[KEY] = state
    return state


def _call(forward, args, kwargs):
    """``forward(*args, **kwargs)`` run eagerly where torch.compile traces it (``eager``)."""
    return forward(*args, **kwargs)


# The checkpointed layer is a graph break: it runs fused, with its hooks and side-stream copies, outside the
# compiled graphs. Made here, not in the traced code (a torch.compiler.disable call there breaks the graph too).
eager = torch.compiler.disable(_call)


def check(mode) -> None:
    if mode not in MODES or isinstance(mode, int) and not isinstance(mode, bool):
        raise ValueError(f"checkpointing must be False, True (recompute each fused decoder layer in the backward) "
                         f"or 'offload' (and keep its input on the host), got {mode!r}")




HEAD = "checkpointing: "


def notes(model: nn.Module, result, asked) -> list[str]:
    """Which fused decoder layers are checkpointed (``asked``: the mode optimize was given), how, and where
    Hugging Face's checkpointing runs instead."""
    from torchfuser.modules.fallbacks import layer_glob

    grouped: dict[tuple[str, str], int] = {}
    mode = None
    for entry in result.fused:
        if entry.pattern != "residual_norm":
            continue
        try:
            layer = model.get_submodule(entry.name)
        except AttributeError:
            continue
        state = of(layer)
        if state is None:
            continue
        mode = state.mode
        if getattr(layer, "gradient_checkpointing", False):
            what = (f"Hugging Face's gradient checkpointing is enabled there and runs instead of checkpointing="
                    f"{state.mode!r} (each layer checkpointed once, its input kept on the device)")
        elif state.mode == "offload":
            what = ("checkpointing='offload': each keeps only its input for the backward, on the host (pinned memory, "
                    "copied on a side stream, copied back one layer ahead; on the CPU the input itself), and runs "
                    "again in the backward")
        else:
            what = "checkpointing=True: each keeps only its input for the backward and runs again in the backward"
        key = (layer_glob(entry.name), what)
        grouped[key] = grouped.get(key, 0) + 1
    lines = [f"{HEAD}{name}" + (f" ({n} layers)" if n > 1 else "") + f": {what}" for (name, what), n in grouped.items()]
    if asked and mode is None:
        lines.append(f"{HEAD}checkpointing={asked!r}, but no decoder layer was fused (residual_norm): nothing is "
                     "checkpointed by torchfuser")
    elif mode is not None:
        lines.append(f"{HEAD}other modules (embeddings, the last norm, the LM head + loss, and decoder layers not fused "
                     "by residual_norm) are not checkpointed; a call that leaves the fused path is not either")
    return lines
