"""Activations made again in the backward instead of kept: the gated MLP's act(gate)·up, and a decoder
layer's RMSNorm outputs (``FusedRMSNorm.made_again``: made again from what the norm keeps).

A gated MLP saves [gate | up] (T × 2I) for its activation's backward, and the down projection saves
its input h = act(gate)·up (T × I) for its weight's or its LoRA adapter's gradient. h is one
elementwise pass over [gate | up], which is kept anyway: so h is not kept but made again, bit for bit,
when the backward first asks for it. That is a third of the MLP's saved activations (for Llama-3-8B's
shapes 3.5 hidden-sized tensors a token a layer, ≈ 3.5 GiB at 2 × 2048 tokens over 32 layers) for
one more elementwise kernel in the backward.

The mechanism is a saved-tensor hook around the down projection alone: a tensor saved there that is h
(its storage, its size) is packed as the recipe to make it again; any other goes through unchanged.
It stands aside (h is kept, as before) where it could change what others rely on:
- another saved-tensor hook is active that is not a counting one (``COUNTING``) or another recipe's: non-reentrant
  checkpointing or an offloading hook decides what is kept there, and a recipe holding [gate | up]
  would keep what they free;
- under ``torch.compile`` (the compiler plans what to save itself) and where no gradient is recorded.
"""
from __future__ import annotations

import contextlib
from typing import Callable

import torch
from torch import Tensor

_autograd = torch._C._autograd
# A pack hook carrying this attribute only looks at what is saved (bytes counters): recipes compose with it.
COUNTING = "_torchfuser_counting"
# A pack hook carrying this one is made_again's own: an inner made_again composes with it (the norm's output
# made again around the MLP whose h is made again too).
RECIPE = "_torchfuser_recipe"
RECIPES = [0]  # tensors packed as recipes so far (made again in the backward, not kept): the probes read it


class _Recipe:
    __slots__ = ("make", "size", "stride", "offset")

    def __init__(self, make: Callable[[], Tensor], t: Tensor):
        self.make, self.size, self.stride, self.offset = make, t.size(), t.stride(), t.storage_offset()

    def __call__(self) -> Tensor:
        with torch.no_grad():
            return self.make().as_strided(self.size, self.stride, self.offset)


def _outer():
    """The saved-tensor hooks active now: None, the counting ones (pack, unpack), or False (others)."""
    top = getattr(_autograd, "_top_saved_tensors_default_hooks", None)
    if top is None:
        return False
    hooks = top(True)
    if hooks is None:
        return None
    return hooks if getattr(hooks[0], COUNTING, False) or getattr(hooks[0], RECIPE, False) else False


def _data_ptr(t: Tensor) -> int | None:
    """The storage's address; None for a wrapper subclass without one (torchao's NF4Tensor, saved by its linear)."""
    try:
        return t.untyped_storage().data_ptr()
    except (RuntimeError, NotImplementedError):
        return None


@contextlib.contextmanager
def made_again(out: Tensor, make: Callable[[], Tensor]):
    """While active, ``out`` (the result of ``make()``, which reads only tensors kept anyway) is not kept
    by what saves it for the backward: the backward calls ``make`` again."""
    # (out itself may need no gradient and still be saved: layer 0's norm output, read by its LoRA A's gradient)
    if torch.compiler.is_compiling() or not torch.is_grad_enabled():
        yield
        return
    outer = _outer()
    if outer is False:
        yield
        return
    ptr, numel = out.untyped_storage().data_ptr(), out.numel()

    def pack(t: Tensor):
        if t.numel() == numel and t.dtype == out.dtype and _data_ptr(t) == ptr:
            RECIPES[0] += 1
            return _Recipe(make, t)
        return (outer[0](t),) if outer else (t,)

    def unpack(packed):
        if isinstance(packed, _Recipe):
            return packed()
        return outer[1](packed[0]) if outer else packed[0]

    setattr(pack, RECIPE, True)
    with torch.autograd.graph.saved_tensors_hooks(pack, unpack):
        yield
