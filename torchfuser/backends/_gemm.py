"""Whether cuBLAS writes a GEMM's fp32 accumulator out as fp32 from bf16/fp16 operands on a device
(``torch.mm(..., out_dtype=torch.float32)``, ``aten::mm.dtype``): one rounding where the
operands' dtype would take two. Shared by the fused projections and the Triton LCE."""
from __future__ import annotations

import torch

_OUT_DTYPE: dict[torch.device, bool] = {}


def fp32_out_ok(device: torch.device) -> bool:
    """Whether ``torch.mm(bf16, bf16, out_dtype=float32)`` (and ``addmm`` with an fp32 addend) runs on
    ``device``: asked once, by trying (where the overload exists, CUDA has a kernel for it and the
    CPU has none)."""
    ok = _OUT_DTYPE.get(device)
    if ok is None:
        try:
            one = torch.ones(1, 1, device=device, dtype=torch.bfloat16)
            ok = torch.mm(one, one, out_dtype=torch.float32).dtype == torch.float32
            ok = ok and torch.addmm(one.float(), one, one, out_dtype=torch.float32).dtype == torch.float32
        except (RuntimeError, TypeError, NotImplementedError):
            ok = False
        _OUT_DTYPE[device] = ok
    return ok
