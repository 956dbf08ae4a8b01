"""The dispatch table: which backend runs an op for a given device.

Backends see raw tensors only. Each backend package exposes ``<op>_fwd`` / ``<op>_bwd``
functions; this module decides which package serves a call and imports it lazily, so the
GPU path never imports torch-mlir and the CPU path never needs a GPU.
"""
from __future__ import annotations

import importlib
import importlib.util
import os
from types import ModuleType

import torch

BACKENDS = ("reference", "triton", "mlir")
VALID_BACKENDS = ("auto",) + BACKENDS

# Preferred backend per device type; anything not listed runs the reference backend.
_PREFERRED = {"cuda": "triton", "cpu": "mlir"}


class BackendUnavailable(RuntimeError):
    """The requested backend cannot run on this machine or device."""


def check_name(name: str | None) -> str:
    name = "auto" if name is None else name
    if name not in VALID_BACKENDS:
        raise ValueError(f"unknown backend {name!r}; valid backends are {', '.join(VALID_BACKENDS)}")
    return name


def _triton_interpret() -> bool:
    return os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")


# Looked up once (find_spec does not import): resolve() stays a plain dict read, which
# torch.compile traces without a cache wrapper or an import machinery call in the graph.
_INSTALLED = {m: importlib.util.find_spec(m) is not None for m in ("triton", "torch_mlir")}


def _has_module(module: str) -> bool:
    return _INSTALLED[module]


def unavailable_reason(name: str, device_type: str) -> str | None:
    """Why backend ``name`` cannot run on ``device_type``; None when it can."""
    if name == "reference":
        return None
    if name == "triton":
        if not _has_module("triton"):
            return "the triton package is not installed"
        if device_type == "cuda":
            return None
        if device_type == "cpu" and _triton_interpret():
            return None
        if device_type == "cpu":
            return "Triton kernels need a CUDA/ROCm device (set TRITON_INTERPRET=1 to run them on the CPU, slowly)"
        return f"Triton kernels do not run on {device_type!r} tensors"
    if name == "mlir":
        if device_type != "cpu":
            return f"the MLIR backend runs on CPU tensors only, not {device_type!r}"
        if not _has_module("torch_mlir"):
            return ('torch-mlir is not installed: the mlir extra brings it (pip install ".[mlir]" in the repository; '
                    'it pins torch 2.13)')
        return None
    raise ValueError(f"unknown backend {name!r}")


def resolve(name: str | None, device: torch.device | str) -> str:
    """Turn ``None``/``"auto"``/a backend name into the concrete backend for ``device``.

    ``auto`` falls back to ``reference`` when the preferred backend is unavailable (the
    report says so); an explicitly named backend that cannot run raises.
    """
    name = check_name(name)
    device_type = torch.device(device).type
    if name == "auto":
        preferred = _PREFERRED.get(device_type, "reference")
        return preferred if unavailable_reason(preferred, device_type) is None else "reference"
    reason = unavailable_reason(name, device_type)
    if reason is not None:
        raise BackendUnavailable(f"backend {name!r} cannot run here: {reason}")
    return name


def auto_fallback_reason(device: torch.device | str) -> str | None:
    """Why ``auto`` on ``device`` does not get its preferred backend (None if it does)."""
    device_type = torch.device(device).type
    preferred = _PREFERRED.get(device_type)
    return _NO_KERNELS.get(device_type) if preferred is None else unavailable_reason(preferred, device_type)


# Devices with no kernels of ours, where ``auto`` runs the reference backend on purpose.
_NO_KERNELS = {
    "mps": "no TorchFuser kernels for Apple GPUs ('mps'): the reference backend's plain PyTorch runs (docs/hardware.md)",
}


def kernels(name: str) -> ModuleType:
    """The backend package ``name`` (imported on first use)."""
    if name not in BACKENDS:
        raise ValueError(f"unknown backend {name!r}; valid backends are {', '.join(BACKENDS)}")
    return importlib.import_module(f"torchfuser.backends.{name}")


_KERNELS: dict[tuple[str, str], object] = {}


def kernel(name: str, fn: str):
    """The function ``fn`` (e.g. ``"rms_norm_fwd"``) of backend ``name``. Remembered after the first
    lookup: every fused-op call asks, and ``import_module`` is a few µs of host time each."""
    impl = _KERNELS.get((name, fn))
    if impl is not None:
        return impl
    impl = getattr(kernels(name), fn, None)
    if impl is None:
        raise NotImplementedError(f"backend {name!r} has no kernel {fn!r} yet; use backend='reference'")
    _KERNELS[(name, fn)] = impl
    return impl
