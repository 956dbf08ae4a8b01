"""An fp32 tensor as two bf16 parts in one launch: the fused LoRA node's operand split
(modules/adapters/lora_node.py, ``_hilo``; the reference twin: backends/reference/hilo_split.py).

For a 2-D t (fp32, or bf16: then lo = 0) and an optional scale s, every step in fp32:
    u  = t · s                  (one IEEE multiply; none without a scale)
    hi = bf16(u)                (round to nearest even)
    lo = bf16(u − fp32(hi))     (u − hi is exact in fp32; rounded once)
and the result is the parts ``parts`` names ("hl", "hlh", "hhl": h = hi, l = lo) concatenated along
``dim`` (0: stacked rows, 1: side by side columns), in a fresh contiguous bf16 tensor. Nothing is
saved (the split is a cast, not differentiated). Bit for bit the torch spelling it replaces
(``new_empty``, ``chunk``, ``copy_`` per hi part, ``sub`` into the lo part, and a multiply before it
for a scale: 3–5 launches): t is read once, each part written once. FP contraction is off for this
kernel: u − hi fused into fma(t, s, −hi) would skip u's rounding and differ from torch's two ops.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from ._common import Launcher, cdiv, target_of, warps_as_threads

_BLOCK_M, _BLOCK_N = 32, 64  # 2048 elements a program: 8 KiB of fp32 read
_WARPS = 4


@triton.jit
def _hilo_split_fwd_kernel(T, OUT, M, N, stride_m, stride_n, out_row, part_off, scale, PARTS: tl.constexpr,
                           LO: tl.constexpr, SCALED: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    rm = (tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)).to(tl.int64)
    rn = (tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)).to(tl.int64)
    mask = (rm[:, None] < M) & (rn[None, :] < N)
    u = tl.load(T + rm[:, None] * stride_m + rn[None, :] * stride_n, mask=mask, other=0.0).to(tl.float32)
    if SCALED:
        u = u * scale
    hi = u.to(OUT.dtype.element_ty)
    lo = (u - hi.to(tl.float32)).to(OUT.dtype.element_ty)
    base = OUT + rm[:, None] * out_row + rn[None, :]
    for p in tl.static_range(PARTS):
        if (LO >> p) & 1:
            tl.store(base + p * part_off, lo, mask=mask)
        else:
            tl.store(base + p * part_off, hi, mask=mask)


_launch = Launcher(_hilo_split_fwd_kernel)


def hilo_split(t: torch.Tensor, parts: str, dim: int, dtype: torch.dtype, scale: float = 1.0) -> torch.Tensor:
    """The parts of (t·scale) along ``dim`` (module docstring); t 2-D, any strides."""
    if t.dim() != 2 or dim not in (0, 1) or set(parts) - {"h", "l"} or "h" not in parts or "l" not in parts:
        raise ValueError(f"hilo_split: a 2-D tensor, dim 0 or 1 and parts of 'h' and 'l' each, not {tuple(t.shape)}, "
                         f"{dim}, {parts!r}")
    m, n = t.shape
    p = len(parts)
    out = t.new_empty((p * m, n) if dim == 0 else (m, p * n), dtype=dtype)
    if t.numel() == 0:
        return out
    out_row, part_off = (n, m * n) if dim == 0 else (p * n, n)
    lo_mask = sum(1 << i for i, c in enumerate(parts) if c == "l")
    _launch((cdiv(m, _BLOCK_M), cdiv(n, _BLOCK_N)), t, out, m, n, t.stride(0), t.stride(1), out_row, part_off,
            float(scale), PARTS=p, LO=lo_mask, SCALED=scale != 1, BLOCK_M=_BLOCK_M, BLOCK_N=_BLOCK_N,
            num_warps=warps_as_threads(_WARPS, target_of(t)), enable_fp_fusion=False)
    return out
