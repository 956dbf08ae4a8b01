"""All or nothing: an ``optimize`` call that raises leaves the model, and the process-wide hooks it
holds, exactly as they were before the call.

Everything optimize changes lives in ``__dict__``s: a parent's ``_modules`` (a swap), an instance
``forward`` (the LM head + loss, a fused decoder layer, CUDA graphs), flags on fused modules (FP8,
backend), hook dicts (autotune), the walker's state and report, and the objects those hold. So the
snapshot is a shallow copy of the ``__dict__`` of every module of the model and of every TorchFuser
object reachable from them, with a copy of each dict, list and set in it (restored in place, so that
whoever holds those containers sees them as before). Two process-wide holds are taken apart: the
Inductor pass and the FP8 optimizer-step hook.
"""
from __future__ import annotations

import contextlib
import sys

from torch import nn

from torchfuser import walker
from torchfuser.modules.fp8 import step as fp8_step

_CONTAINERS = (dict, list, set)


def _ours(obj) -> bool:
    return type(obj).__module__.startswith("torchfuser.") and hasattr(obj, "__dict__")


def _reachable(model: nn.Module) -> list:
    """The model's modules, and the TorchFuser objects (and the modules they hold: the originals of the
    swapped blocks) reachable from their ``__dict__``s through lists, tuples and dicts."""
    seen: dict[int, object] = {}
    todo: list = list(model.modules())
    while todo:
        obj = todo.pop()
        if id(obj) in seen:
            continue
        seen[id(obj)] = obj
        stack = list(vars(obj).values())
        while stack:
            value = stack.pop()
            if isinstance(value, nn.Module) or _ours(value):
                todo.append(value)
            elif isinstance(value, (list, tuple)):
                stack.extend(value)
            elif isinstance(value, dict):
                stack.extend(value.values())
    return list(seen.values())


def _same(container, content) -> bool:
    """Whether ``container`` holds what ``content`` held, object for object (values are compared by
    identity: a tensor's ``==`` is no answer), keys in the same order."""
    if isinstance(container, dict):
        return list(container) == list(content) and all(container[k] is v for k, v in content.items())
    if isinstance(container, list):
        return len(container) == len(content) and all(a is b for a, b in zip(container, content))
    return container == content


class Snapshot:
    def __init__(self, model: nn.Module):
        self.model = model
        self.objects = []
        for obj in _reachable(model):
            attrs = dict(vars(obj))
            contents = [(c, c.copy()) for c in attrs.values() if isinstance(c, _CONTAINERS)]
            self.objects.append((obj, attrs, contents))
        st = walker.state(model)
        self.undo_count = len(st.undo) if st is not None else 0
        self.state = st
        ip = sys.modules.get("torchfuser.compiler.inductor_pass")
        self.inductor = None if ip is None else (dict(ip._holders), ip.config.pre_grad_custom_pass)
        self.fp8_step_held = id(model) in fp8_step._holders

    def rollback(self) -> None:
        # Swaps made since, undone by their own undos first (a user's pattern may change more than __dict__s).
        st = walker.state(self.model)
        if st is not None:
            for applied in reversed(st.undo[self.undo_count if st is self.state else 0:]):
                applied.undo()
        for obj, attrs, contents in self.objects:
            current = vars(obj)
            for key in [k for k in current if k not in attrs]:
                del current[key]
            current.update(attrs)
            for container, content in contents:
                if _same(container, content):
                    continue
                container.clear()
                container.update(content) if not isinstance(container, list) else container.extend(content)
        ip = sys.modules.get("torchfuser.compiler.inductor_pass")
        if ip is not None and self.inductor is not None:
            holders, chain = self.inductor
            ip._holders.clear()
            ip._holders.update(holders)
            ip.config.pre_grad_custom_pass = chain
        elif ip is not None:  # imported by this call: nothing held before it
            ip.release(self.model)
        held = id(self.model) in fp8_step._holders
        if held and not self.fp8_step_held:
            fp8_step.release(self.model)
        elif self.fp8_step_held and not held:
            fp8_step.hold(self.model)


@contextlib.contextmanager
def atomic(model: nn.Module):
    """Run the body; if it raises, put ``model`` back as it was and re-raise."""
    snapshot = Snapshot(model)
    try:
        yield snapshot
    except BaseException:
        snapshot.rollback()
        raise
