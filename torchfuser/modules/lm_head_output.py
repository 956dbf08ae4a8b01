"""The output of a fused LM head + loss training call that did not keep its logits.

``FusedLMHeadLoss`` never builds the logits (that is the memory it saves), so the output has none. A
``logits=None`` would fail far from its cause (``outputs.logits.argmax(-1)``: a TypeError about NoneType in
the user's metric code), so the output is an instance of a subclass of the model's own output class in
which reading the attribute ``logits`` raises ``LogitsNotKept``, saying why and what to pass. Everything
else is the model's output class unchanged: ``logits`` is a None field, so, as for every None field of a
``ModelOutput``, it is not among ``keys()``, ``to_tuple()``, ``out[0]`` (the loss) or ``"logits" in out``,
and ``out.get("logits")`` is None; the Trainer, TRL and PEFT read ``outputs["loss"]`` / ``outputs[0]``.
``LogitsNotKept`` is an AttributeError, so ``getattr(out, "logits", None)`` and ``hasattr`` still answer
None / False: a default asked for explicitly. Transformers' own ``past_key_values`` is such a property.
"""
from __future__ import annotations

import dataclasses
import typing

import torch

try:
    from transformers.utils import ModelOutput
except ImportError:  # pragma: no cover - transformers is a dependency
    ModelOutput = None


class LogitsNotKept(AttributeError):
    """``outputs.logits`` of a training call whose loss the fused LM head + loss computed without the logits."""


MESSAGE = (
    "outputs.logits was not kept: torchfuser's fused LM head + loss (pattern lm_head_loss) computes the loss of a "
    "training call with labels without building the logits, which saves their memory. To have them too, pass "
    "torchfuser.optimize(model, keep_logits=True) (the loss stays fused; the logits cost one more matmul and their "
    "memory), or exclude=['lm_head_loss']; calls without labels or in eval mode return them as usual")

_CLASSES: dict[type, type] = {}


def _logits(self):
    value = self.__dict__.get("logits")
    if value is None:
        raise LogitsNotKept(MESSAGE)
    return value


def _set_logits(self, value) -> None:
    self.__dict__["logits"] = value


def _field_values(self) -> tuple:
    return tuple(self.__dict__.get(f.name) for f in dataclasses.fields(self))


def _rebuild(base: type, values: tuple):
    return without_logits_class(base)(*values)


def _reduce(self):
    # ModelOutput's __reduce__ reads every field by attribute (logits raises) and names this class, which
    # has no importable name: rebuilt through the model's own output class instead (copy, deepcopy, pickle).
    return _rebuild, (type(self).__bases__[0], _field_values(self)), None, None, iter(self.items())


def _repr(self) -> str:
    fields = ", ".join(f"{f.name}={self.__dict__.get(f.name)!r}" for f in dataclasses.fields(self) if f.repr)
    return f"{type(self).__qualname__}({fields})"


def _eq(self, other):
    if other.__class__ is not self.__class__:
        return NotImplemented
    return _field_values(self) == _field_values(other)


def without_logits_class(base: type) -> type:
    """``base`` (a ModelOutput dataclass) with an attribute ``logits`` that raises where it is None; one per class."""
    cls = _CLASSES.get(base)
    if cls is None:
        cls = type(base.__name__, (base,), {
            "__module__": f"{__name__}.{base.__module__}",  # distinct pytree names for same-named classes
            "__qualname__": base.__qualname__,
            "__doc__": f"{base.__name__} of a fused training call that did not keep its logits "
                       "(torchfuser.modules.lm_head_output).",
            "logits": property(_logits, _set_logits),
            "__reduce__": _reduce,
            "__repr__": _repr,
            "__eq__": _eq,
            "__hash__": None,
        })
        _CLASSES[base] = cls
    return cls


def prepare(annotation) -> None:
    """Make the classes for the output types a forward is annotated to return (a class, or a Union of them):
    Dynamo cannot make a class while it traces, so a compiled first call finds it made."""
    for kind in typing.get_args(annotation) or (annotation,):
        if (ModelOutput is not None and isinstance(kind, type) and issubclass(kind, ModelOutput)
                and "logits" in getattr(kind, "__dataclass_fields__", {}) and kind not in _CLASSES.values()):
            without_logits_class(kind)


def without_logits(out, loss):
    """``out`` with ``loss`` and no logits: where ``out`` is a ``ModelOutput``, one whose ``logits`` raises."""
    if ModelOutput is None or not isinstance(out, ModelOutput) or type(out) in _CLASSES.values():
        return dataclasses.replace(out, loss=loss, logits=None)
    if type(out) not in _CLASSES and torch.compiler.is_compiling():
        # Not made at install (a forward not annotated with its output class) and no eager call yet: a class
        # cannot be made inside a traced graph, so this graph returns a plain None, as before LogitsNotKept.
        return dataclasses.replace(out, loss=loss, logits=None)
    values = {f.name: out.__dict__.get(f.name) for f in dataclasses.fields(out) if f.init}
    values.update(loss=loss, logits=None)
    return without_logits_class(type(out))(**values)
