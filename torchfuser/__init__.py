"""TorchFuser: swap standard transformer blocks for fused kernels, keeping every parameter."""
from torchfuser import functional

__version__ = "0.1.0"
__all__ = ["functional", "__version__"]
