"""The compiler front door: ``@torchfuser.jit`` and ``torch.compile(..., backend="torchfuser")``.

One stage per file: ``capture`` (Dynamo graph → ATen), ``rewrite`` + ``rules`` (subgraphs →
``torchfuser::`` ops), ``partition`` (CPU regions → MLIR), ``backend`` (the Dynamo backend that
chains them), ``jit`` (the decorator), ``record`` (what each compilation did).
"""
from __future__ import annotations

__all__ = ["dynamo_backend", "jit", "register", "last_record", "CompileError"]


def dynamo_backend(gm, example_inputs, **options):
    # The entry point ``torchfuser.compiler:dynamo_backend`` must stay cheap to import.
    from torchfuser.compiler.backend import dynamo_backend as impl

    return impl(gm, example_inputs, **options)


def __getattr__(name):
    if name == "jit":
        from torchfuser.compiler.jit import jit

        return jit
    if name == "CompileError":
        from torchfuser.compiler.capture import CompileError

        return CompileError
    raise AttributeError(f"module 'torchfuser.compiler' has no attribute {name!r}")


def last_record():
    """The record of the most recent torchfuser compilation (None before any)."""
    from torchfuser.compiler.backend import RECENT

    return RECENT[-1] if RECENT else None


def _entry_point_declared() -> bool:
    from importlib.metadata import entry_points

    return any(ep.value == "torchfuser.compiler:dynamo_backend" for ep in entry_points(group="torch_dynamo_backends"))


def register(force: bool = False) -> None:
    """Register the backend name ``"torchfuser"`` with Dynamo.

    When the package is installed, the ``torch_dynamo_backends`` entry point already makes the
    name resolvable and Dynamo loads it lazily, so nothing is imported here (importing
    ``torch._dynamo`` costs over a second); otherwise register now.
    """
    if not force and _entry_point_declared():
        return
    from torch._dynamo.backends.registry import _BACKENDS, register_backend

    if "torchfuser" not in _BACKENDS or _BACKENDS["torchfuser"] is not dynamo_backend:
        _BACKENDS.pop("torchfuser", None)
        register_backend(dynamo_backend, name="torchfuser")
