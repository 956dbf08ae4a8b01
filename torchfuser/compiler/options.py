"""What one compilation is asked to do, parsed once from the keyword arguments that
``torch.compile(..., backend="torchfuser", options={...})`` or ``torchfuser.jit(...)`` pass."""
from __future__ import annotations

from dataclasses import dataclass, fields

# backend: where the parts of the graph that are not rewritten to fused ops go.
#   auto     → inductor on CUDA/ROCm, mlir on the CPU (the MLIR regions fall back to eager
#              per region while torchfuser.backends.mlir.compile_graph is missing)
#   mlir     → partition into pointwise/reduction regions compiled by the MLIR backend (CPU)
#   inductor → the rewritten graph goes to Inductor, on any device
#   eager    → the rewritten graph runs op by op (a debugging baseline)
GRAPH_BACKENDS = ("auto", "mlir", "inductor", "eager")

# rewrite: replace subgraphs that compute a known op by the torchfuser custom op.
#   "auto" → only where the op has a compiled (non-reference) kernel for the device,
#            because a reference kernel inside a compiled graph is slower than not rewriting
#   True   → always (the reference kernel serves devices without a compiled one)
#   False  → never
REWRITE_CHOICES = ("auto", True, False)


@dataclass(frozen=True)
class CompileOptions:
    backend: str = "auto"
    rewrite: object = "auto"
    dynamic: bool | None = None
    # kernel backend baked into rewritten custom ops ("auto" picks per device, like optimize)
    kernels: str = "auto"

    def __post_init__(self):
        if self.backend not in GRAPH_BACKENDS:
            raise ValueError(f"torchfuser: unknown graph backend {self.backend!r}; valid: {', '.join(GRAPH_BACKENDS)}")
        if self.rewrite not in REWRITE_CHOICES:
            raise ValueError(f"torchfuser: rewrite must be 'auto', True or False, got {self.rewrite!r}")

    def graph_backend(self, device_type: str) -> str:
        if self.backend != "auto":
            return self.backend
        return "mlir" if device_type == "cpu" else "inductor"


def parse(options: dict | None = None, **kwargs) -> CompileOptions:
    """Merge ``options`` (torch.compile's dict) and keyword arguments; unknown keys raise."""
    merged = dict(options or {})
    # torch.compile passes mode=... to backends that accept it; it has no meaning here.
    kwargs.pop("mode", None)
    merged.update(kwargs)
    known = {f.name for f in fields(CompileOptions)}
    unknown = sorted(set(merged) - known)
    if unknown:
        raise TypeError(f"torchfuser: unknown compile option(s) {unknown}; valid options are {sorted(known)}")
    return CompileOptions(**merged)
