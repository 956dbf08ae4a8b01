"""What differs between the torch releases TorchFuser runs on (2.11 on the GPU machine, 2.13 here)."""
from __future__ import annotations

try:  # torch ≥ 2.13
    from torch.fx.experimental.symbolic_shapes import optimization_hint as size_hint
except ImportError:  # torch 2.11/2.12
    from torch.fx.experimental.symbolic_shapes import hint_int as size_hint

__all__ = ["size_hint"]
