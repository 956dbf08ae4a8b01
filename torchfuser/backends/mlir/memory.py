"""Output allocation: PyTorch-owned tensors whose large interiors are backed by huge pages.

Why: a fresh 64 MiB output is a fresh ``mmap`` (glibc serves anything above 32 MiB that way),
and the kernel's first write to each 4 KiB page faults. On the 2-core benchmark machine those
16,384 faults cost 30–50 ms per 4096×4096 fp32 output, several times the kernel's own time
(NOTES-mlir.md). ``madvise(MADV_HUGEPAGE)`` on the 2 MiB-aligned interior of the new, not yet
touched buffer makes the kernel fault 2 MiB pages instead (512× fewer faults; the zeroing
remains). The tensor is a plain ``torch.empty``: PyTorch owns and frees it; only the advice
is ours. Where THP is off or ``madvise`` is missing this is a no-op.
"""
from __future__ import annotations

import ctypes
import os

import torch

HUGE = 2 << 20
MADV_HUGEPAGE = 14
MIN_BYTES = 4 * HUGE   # below this, a huge page would cover too little of the buffer to matter

_madvise = None


def _libc_madvise():
    global _madvise
    if _madvise is None:
        try:
            libc = ctypes.CDLL(None, use_errno=True)
            fn = libc.madvise
            fn.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
            fn.restype = ctypes.c_int
            _madvise = fn
        except (OSError, AttributeError):
            _madvise = False
    return _madvise


def enabled() -> bool:
    return os.environ.get("TORCHFUSER_MLIR_HUGEPAGES", "1") != "0" and bool(_libc_madvise())


def advise_huge(t: torch.Tensor) -> torch.Tensor:
    """Ask for huge pages under the 2 MiB-aligned interior of ``t`` (call before first touch)."""
    nbytes = t.numel() * t.element_size()
    if nbytes < MIN_BYTES or not enabled():
        return t
    start = t.data_ptr()
    lo = (start + HUGE - 1) & ~(HUGE - 1)
    hi = (start + nbytes) & ~(HUGE - 1)
    if hi > lo:
        _libc_madvise()(lo, hi - lo, MADV_HUGEPAGE)
    return t


def empty(shape, dtype: torch.dtype) -> torch.Tensor:
    return advise_huge(torch.empty(shape, dtype=dtype))
