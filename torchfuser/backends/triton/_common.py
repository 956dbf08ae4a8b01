"""Helpers shared by the Triton launchers: dtype checks, 2-D row views, cached launch configs."""
from __future__ import annotations

from functools import lru_cache

import torch

SUPPORTED = (torch.float32, torch.bfloat16, torch.float16)


def check_dtypes(op: str, **tensors: torch.Tensor | None) -> None:
    for name, t in tensors.items():
        if t is not None and t.dtype not in SUPPORTED:
            raise TypeError(
                f"{op}: the triton backend supports float32, bfloat16 and float16, but {name} is {t.dtype}; "
                "use backend='reference' for other dtypes (float64 is the test oracle's dtype, not a kernel's)"
            )


def rows_view(t: torch.Tensor, n: int) -> torch.Tensor:
    """``t`` as an M×n matrix whose rows may be strided but whose last dim is dense.

    A view when possible (a transposed or sliced activation keeps its row stride), a copy only
    when the last dim itself is strided (e.g. an expanded gradient of stride 0). Rows that alias
    (row stride 0) are fine: kernels only read their inputs.
    """
    t2 = t.reshape(-1, n)
    if t2.stride(-1) != 1:
        t2 = t2.contiguous()
    return t2


def next_pow2(n: int) -> int:
    return 1 << max(0, int(n) - 1).bit_length()


@lru_cache(maxsize=None)
def num_programs_cap(device_index: int | None) -> int:
    """Persistent-grid size for the norm backwards: 2 programs per SM. Measured on an H200
    (benchmarks/results/NOTES-triton.md): 8 per SM sped up rms_norm's backward at 32768×4096
    by 12% but slowed layer_norm's by 30% (4× the fp32 partial dw/db rows to write and sum)
    and both at 8192×2048 under CUDA graphs, so 2 stays."""
    if device_index is None:  # CPU under TRITON_INTERPRET: each program runs in Python, keep it few
        return 4
    return 2 * torch.cuda.get_device_properties(device_index).multi_processor_count


def device_key(t: torch.Tensor) -> int | None:
    return t.device.index if t.device.type == "cuda" else None


def warps_for(elements: int, lo: int = 1, hi: int = 16) -> int:
    """About 8–16 fp32 values in registers per thread: enough loads in flight, no spills."""
    w = next_pow2(max(1, elements // 512))
    return max(lo, min(hi, w))
