"""Optimizer steps, counted for ``optimize(model, fp8=..., fp8_weights="per_step")``.

A trainable weight's quantised FP8 copies (modules/fp8/__init__.py) may be kept from one call to the next only
while the weight cannot have changed. Its version counter does not say so: fused optimizers
(``AdamW(fused=True)``) update parameters in place without bumping it. So with ``"per_step"`` a kept copy
is also keyed on the number of optimizer steps taken in the process, which a step post-hook of
``torch.optim`` counts: any ``torch.optim.Optimizer`` step (every optimizer, ours or not, so a step
of an unrelated one only costs a requantisation). No host sync: the count is a Python integer.

The hook is process-wide, so it is scoped: it is in while a model optimized with ``"per_step"`` lives
and comes out with the last one's ``restore`` (or garbage collection).

Frozen weights (LoRA's bases) are kept the same way: remade after every counted step, so a write through
``param.data`` made with a step (EMA, weight averaging after ``step()``) is seen from the next call on.
What ``"per_step"`` assumes (the docs repeat it): between an optimizer step and the calls that follow it,
the weights change only through ``load_state_dict``, in-place operations on the parameters themselves
(they bump the version) or a new storage (``param.data = t``, ``swap_tensors``); not through a write into
``param.data``'s storage, which neither bumps the version nor steps an optimizer. The default,
``"per_call"``, assumes nothing: every weight is quantised at every call.
"""
from __future__ import annotations

import weakref

from torch.optim.optimizer import register_optimizer_step_post_hook

_count = 0
_handle = None
_holders: dict[int, weakref.ref] = {}


def steps() -> int | None:
    """Optimizer steps taken while the hook was in (the key a kept trainable FP8 copy carries), or None
    while it is out: then nothing counts steps and no trainable copy may be kept (a copy of a model made
    with ``copy.deepcopy`` after its original was restored)."""
    return _count if _handle is not None else None


def _stepped(optimizer, args, kwargs) -> None:
    global _count
    _count += 1


def hold(model) -> None:
    """``model`` keeps FP8 weight copies per optimizer step: the hook is in until ``release(model)``."""
    global _handle
    key = id(model)
    if key not in _holders:
        _holders[key] = weakref.ref(model, lambda _, key=key: _let_go(key))
    if _handle is None:
        _handle = register_optimizer_step_post_hook(_stepped)


def release(model) -> None:
    _let_go(id(model))


def _let_go(key: int) -> None:
    global _handle, _count
    if _holders.pop(key, None) is not None and not _holders and _handle is not None:
        _handle.remove()
        _handle = None
        _count += 1  # steps while the hook was out go uncounted: no copy kept from before may be reused


def holders() -> int:
    return len(_holders)
