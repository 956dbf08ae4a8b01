"""What every fused module shares: the spec it was built from and the backend it asks for."""
from __future__ import annotations

from torch import nn


class FusedModule(nn.Module):
    """Base of every module TorchFuser swaps in. Holds the original parameters and submodules
    under their original names, so ``state_dict`` keys and values do not change."""

    def __init__(self, spec, backend: str):
        super().__init__()
        self.spec = spec
        self.backend = None if backend == "auto" else backend

    def extra_repr(self) -> str:
        return f"spec={self.spec}, backend={self.backend or 'auto'}"


def adopt(fused: nn.Module, original: nn.Module, names) -> None:
    """Register ``original``'s parameters, buffers and submodules ``names`` on ``fused`` as the
    same objects under the same names (no copies)."""
    for name in names:
        if name in original._parameters:
            fused.register_parameter(name, original._parameters[name])
        elif name in original._buffers:
            persistent = name not in original._non_persistent_buffers_set
            fused.register_buffer(name, original._buffers[name], persistent=persistent)
        elif name in original._modules:
            fused.add_module(name, original._modules[name])
        else:
            raise AttributeError(f"{type(original).__name__} has no parameter, buffer or submodule {name!r}")
