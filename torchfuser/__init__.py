"""TorchFuser: swap standard transformer blocks for fused kernels, keeping every parameter.

    report = torchfuser.report(torchfuser.optimize(model))

``import torchfuser`` itself imports neither torch nor transformers (``torchfuser --version`` answers
at once): the first use of a public name loads the package as the eager import did (the API, the
functional ops and their ``torch.library`` registrations, the patterns).
"""
import sys as _sys
import types as _types

from torchfuser._version import __version__
from torchfuser.compiler import register as _register_dynamo_backend

_register_dynamo_backend()  # torch.compile(backend="torchfuser"); free when the entry point is installed
__all__ = ["optimize", "restore", "report", "functional", "FusionReport", "PATTERNS", "Pattern", "Skip", "register_pattern",
           "unregister_pattern", "TorchFuserCallback", "jit", "GraphOptions", "LogitsNotKept", "__version__"]

_EAGER = frozenset({"functional", "optimize", "report", "restore", "GraphOptions", "PATTERNS", "Pattern", "Skip",
                    "register_pattern", "unregister_pattern", "FusionReport", "LogitsNotKept"})
_loaded = False


def _load() -> None:
    """What ``import torchfuser`` imported before it was lazy, bound the same way (once; a submodule's own
    ``from torchfuser import x`` while this runs finds x by the import system, not here)."""
    global _loaded
    if _loaded:
        return
    _loaded = True
    try:
        from importlib import import_module

        api, patterns = import_module("torchfuser.api"), import_module("torchfuser.patterns")
        globals().update(
            functional=import_module("torchfuser.functional"), optimize=api.optimize, report=api.report,
            restore=api.restore, GraphOptions=import_module("torchfuser.cuda_graphs.buckets").GraphOptions,
            PATTERNS=patterns.PATTERNS, Pattern=patterns.Pattern, Skip=patterns.Skip,
            register_pattern=patterns.register_pattern, unregister_pattern=patterns.unregister_pattern,
            FusionReport=import_module("torchfuser.report").FusionReport,
            LogitsNotKept=import_module("torchfuser.modules.lm_head_output").LogitsNotKept)
    except BaseException:
        _loaded = False
        raise


def __getattr__(name):
    # Loaded only when asked: the callback imports transformers' trainer machinery, jit the compiler.
    if name == "jit":
        from torchfuser.compiler.jit import jit

        return jit
    if name == "TorchFuserCallback":
        from torchfuser.integrations.hf_trainer import TorchFuserCallback

        return TorchFuserCallback
    if not name.startswith("__"):
        _load()  # also binds the submodules it imports (api, walker, ...), as the eager import did
        if name in globals():
            return globals()[name]
    raise AttributeError(f"module 'torchfuser' has no attribute {name!r}")


class _Package(_types.ModuleType):
    """``torchfuser.report`` is the function, though a submodule of that name exists: importing the submodule
    first (``from torchfuser.report import ...``) binds the module there, so a public name loads the package
    (which binds the function) before it is read, not only when it is missing."""

    def __getattribute__(self, name):
        if name in _EAGER and not _loaded:
            _load()
        return super().__getattribute__(name)


_sys.modules[__name__].__class__ = _Package
