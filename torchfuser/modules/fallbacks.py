"""Call-time fallbacks: a fused block that hands a call to the original forward says so here.

A block reported fused must run fused, or the report must say how often it did not. Each
fallback adds one to a Counter in the module's ``__dict__``, keyed by the reason; the fused
path pays nothing. ``torchfuser.report(model)`` turns the counters into notes (``notes``).

Not counted while torch.compile traces: a trace runs once for many calls, so a count there
would say nothing about how often the code ran. nn.DataParallel replicas copy ``__dict__``
shallowly and so count into the original's Counter.
"""
from __future__ import annotations

import re
from collections import Counter

import torch
from torch import nn

_ATTR = "_torchfuser_fallbacks"
HEAD = "fallback: "  # every note made here starts so, to be replaced when the report is refreshed


def count(module: nn.Module, why: str) -> None:
    if torch.compiler.is_compiling():
        return
    counter = module.__dict__.get(_ATTR)
    if counter is None:
        counter = module.__dict__[_ATTR] = Counter()
    counter[why] += 1


def counts(model: nn.Module) -> dict[str, dict[str, int]]:
    """{qualified module name: {reason: calls}} for every module of ``model`` that fell back."""
    return {name: dict(c) for name, m in model.named_modules() if (c := m.__dict__.get(_ATTR))}


def clear(module: nn.Module) -> None:
    module.__dict__.pop(_ATTR, None)


class Calls:
    """Eager calls that ran a fused path, counted where the report must show that a block runs at all (the
    LM head + loss, which a trainer's own head can bypass). One object shared by the shallow copies
    nn.DataParallel makes; compiled calls are not counted (a count would make torch.compile guard on it)."""

    __slots__ = ("n",)

    def __init__(self, n: int = 0):
        self.n = n

    def __getstate__(self):
        return self.n

    def __setstate__(self, n):
        self.n = n

    def __repr__(self) -> str:
        return f"Calls({self.n})"


def layer_glob(name: str) -> str:
    """A qualified name with its layer indices as * ("model.layers.*.mlp"): one line for all layers."""
    return re.sub(r"(^|\.)\d+(?=\.|$)", r"\1*", name) or "(model)"


def notes(model: nn.Module) -> list[str]:
    """One line per (module name with layer indices as *, reason), summed over the layers."""
    grouped: dict[tuple[str, str], list[int]] = {}
    for name, reasons in counts(model).items():
        for why, n in reasons.items():
            grouped.setdefault((layer_glob(name), why), []).append(n)
    lines = []
    for (name, why), ns in grouped.items():
        where = f"{name} ({len(ns)} modules)" if len(ns) > 1 else name
        calls = "call" if sum(ns) == 1 else "calls"
        lines.append(f"{HEAD}{where}: {sum(ns)} {calls} left the fused path: {why}")
    return lines
