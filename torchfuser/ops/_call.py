"""Look up a backend kernel from inside a custom op's implementation.

When a ``TorchDispatchMode`` is active (torch.compile's AOT runtime runs the first call of every
compiled graph under one that checks custom-op aliasing; FlopCounterMode and debug modes do the
same), PyTorch redispatches the op to its implementation with every dispatch key above Python
excluded, functorch's and ADInplaceOrView's included. A kernel that differentiates with
``torch.func`` (the reference backend derives its backward that way) then fails with "Cannot
access storage of TensorWrapper". Those keys are restored for the kernel's duration; autocast
stays excluded, as it is for any custom-op implementation. Outside a mode this is one TLS read.
"""
from __future__ import annotations

import torch

from torchfuser.backends import kernel as _backend_kernel

_C = torch._C
_DK = _C.DispatchKey
_ABOVE_PYTHON = _C._dispatch_keyset_full() - _C._dispatch_keyset_full_after(_DK.Python)
_REENABLE = _ABOVE_PYTHON - _C.DispatchKeySet(_DK.Python)
for _name in dir(_DK):
    if _name.startswith("Autocast"):
        _REENABLE = _REENABLE - _C.DispatchKeySet(getattr(_DK, _name))


def _with_keys(fn, *args):
    excluded = _C._dispatch_tls_local_exclude_set()
    with _C._ForceDispatchKeyGuard(_C._dispatch_tls_local_include_set(), excluded - _REENABLE):
        return fn(*args)


def kernel(backend: str, name: str):
    fn = _backend_kernel(backend, name)
    if not _C._dispatch_tls_local_exclude_set().has(_DK.FuncTorchDynamicLayerFrontMode):
        return fn
    return lambda *args: _with_keys(fn, *args)
