"""The pattern interface: recognise a block, say why not, build its fused replacement."""
from __future__ import annotations

import dis
import inspect
from dataclasses import dataclass
from typing import Callable, ClassVar

from torch import nn

from torchfuser.modules import decode
from torchfuser.modules.base import FusedModule, hand_back


@dataclass(frozen=True)
class Skip:
    """A candidate block that will not be fused, and why."""

    reason: str


@dataclass
class Applied:
    """A swap that happened: what replaced the block, and how to undo it."""

    fused_type: str
    undo: Callable[[], None]


@dataclass
class _PutBack:
    """Undo of a swap: the original back in its parent, holding what the fused module now holds.
    An object, not a closure, so that a model saved whole (torch.save) keeps its undo."""

    parent: nn.Module
    attr: str
    fused: nn.Module
    original: nn.Module

    def __call__(self) -> None:
        hand_back(self.fused, self.original)
        decode.unshare(self.fused, self.original)
        self.parent._modules[self.attr] = self.original


def _reads(code, name: str) -> bool:
    """Whether ``code`` reads its local ``name`` (or a nested function captures it)."""
    if name in code.co_cellvars:
        return True
    for ins in dis.get_instructions(code):
        if ins.opname.startswith("LOAD_FAST") and name in (ins.argval if isinstance(ins.argval, tuple) else (ins.argval,)):
            return True
    return False


def further_inputs(module: nn.Module) -> list[str]:
    """The arguments of ``module``'s forward after its first that the forward requires or reads
    (a gated norm's ``gate``): a block called with more than x computes more than a function of x,
    so a fused module of x alone would fail or be wrong. Unreadable code counts every argument."""
    forward = module.forward
    try:
        params = list(inspect.signature(forward).parameters.values())[1:]
    except (TypeError, ValueError):
        return []
    code = getattr(inspect.unwrap(getattr(forward, "__func__", forward)), "__code__", None)

    def needed(p: inspect.Parameter) -> bool:
        required = p.default is p.empty and p.kind not in (p.VAR_POSITIONAL, p.VAR_KEYWORD)
        return required or code is None or _reads(code, p.name)

    return [p.name for p in params if needed(p)]


class Pattern:
    """Recognises one kind of block by structure and math, and builds its fused replacement.
    The public interface for a pattern of one's own (``torchfuser.register_pattern``;
    docs/extending.md):

    - ``name``: how the report and ``optimize(patterns=, exclude=)`` call it.
    - ``match(module)``: None for a module that is no candidate at all (the next pattern is asked),
      a ``Skip(reason)`` for a candidate it will not fuse, or a frozen spec (a dataclass: what
      ``build`` needs) for one it will. Called on every module, on whatever device (``meta`` too):
      read structure and attributes, and check the math on small copies, never the model's tensors.
    - ``build(module, spec, backend)``: the fused module; by default ``fused(module, spec, backend)``.
      It must hold the original's parameters (``adopt``), not copies.
    - ``parameters_used(module)``: (name, parameter) pairs the fused module computes with; a
      candidate whose are not plain tensors (DTensor, quantized) is skipped with that reason.
    """

    name: ClassVar[str] = ""
    description: ClassVar[str] = ""
    fused: ClassVar[type] = None  # what build() makes: fused(module, spec, backend)

    def match(self, module: nn.Module):
        raise NotImplementedError

    def parameters_used(self, module: nn.Module):
        """The parameters the fused module would compute with (all of ``module``'s by default)."""
        return module.named_parameters()

    def build(self, module: nn.Module, spec, backend: str) -> FusedModule:
        fused = self.fused(module, spec, backend)
        if isinstance(fused, FusedModule):  # answers the attribute reads the original answered
            fused.__dict__.setdefault("_original", module)
        return fused

    def apply(self, root: nn.Module, qualname: str, module: nn.Module, spec, backend: str) -> Applied:
        """Swap ``module`` (at ``qualname`` under ``root``) for its fused module, in place."""
        if not qualname:
            raise ValueError("the root module itself cannot be replaced; optimize the model that contains it")
        parent_name, _, attr = qualname.rpartition(".")
        parent = root.get_submodule(parent_name)
        fused = self.build(module, spec, backend)
        _check_holds_originals(self, fused, module)
        if isinstance(fused, FusedModule) and fused.__dict__.get("_original") is module:
            decode.share(fused, module)  # a decode step runs the original on what the fused module holds now
        fused.train(module.training)
        parent._modules[attr] = fused
        return Applied(type(fused).__name__, _PutBack(parent, attr, fused, module))


def _check_holds_originals(pattern: Pattern, fused: nn.Module, module: nn.Module) -> None:
    """A fused module with parameters of its own would train weights no checkpoint of the model
    holds, and ``restore`` would hand them to the original: refuse it before the swap."""
    if not isinstance(fused, nn.Module):
        raise TypeError(f"{type(pattern).__name__}.build returned a {type(fused).__name__}, not an nn.Module")
    mine = {id(p) for p in module.parameters()}
    new = [n for n, p in fused.named_parameters() if id(p) not in mine]
    if new:
        raise ValueError(f"{type(pattern).__name__}.build made a {type(fused).__name__} with parameters the "
                         f"{type(module).__name__} does not hold ({', '.join(new)}): a fused module must hold the "
                         "original parameter objects (torchfuser.adopt), not copies")
