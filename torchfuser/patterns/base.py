"""The pattern interface: recognise a block, say why not, build its fused replacement."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, ClassVar

from torch import nn

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
        self.parent._modules[self.attr] = self.original


class Pattern:
    """Recognises one kind of block by structure and math.

    ``match`` returns None for modules that are not candidates at all, a ``Skip`` for
    candidates it will not fuse (with the reason), or a frozen spec for blocks it will.
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
        return self.fused(module, spec, backend)

    def apply(self, root: nn.Module, qualname: str, module: nn.Module, spec, backend: str) -> Applied:
        """Swap ``module`` (at ``qualname`` under ``root``) for its fused module, in place."""
        if not qualname:
            raise ValueError("the root module itself cannot be replaced; optimize the model that contains it")
        parent_name, _, attr = qualname.rpartition(".")
        parent = root.get_submodule(parent_name)
        fused = self.build(module, spec, backend)
        fused.train(module.training)
        parent._modules[attr] = fused
        return Applied(type(fused).__name__, _PutBack(parent, attr, fused, module))
