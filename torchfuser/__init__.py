"""TorchFuser: swap standard transformer blocks for fused kernels, keeping every parameter.

    report = torchfuser.report(torchfuser.optimize(model))
"""
from torchfuser import functional
from torchfuser._version import __version__
from torchfuser.api import optimize, report, restore
from torchfuser.cuda_graphs.buckets import GraphOptions
from torchfuser.compiler import register as _register_dynamo_backend
from torchfuser.patterns import PATTERNS, Pattern, Skip, register_pattern, unregister_pattern
from torchfuser.report import FusionReport

_register_dynamo_backend()  # torch.compile(backend="torchfuser"); free when the entry point is installed
__all__ = ["optimize", "restore", "report", "functional", "FusionReport", "PATTERNS", "Pattern", "Skip", "register_pattern",
           "unregister_pattern", "TorchFuserCallback", "jit", "GraphOptions", "__version__"]


def __getattr__(name):
    # Loaded only when asked: the callback imports transformers' trainer machinery, jit the compiler.
    if name == "jit":
        from torchfuser.compiler.jit import jit

        return jit
    if name == "TorchFuserCallback":
        from torchfuser.integrations.hf_trainer import TorchFuserCallback

        return TorchFuserCallback
    raise AttributeError(f"module 'torchfuser' has no attribute {name!r}")
