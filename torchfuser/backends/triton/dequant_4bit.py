"""4-bit blockwise dequantisation (bitsandbytes' NF4 / FP4 layout) in Triton.

For the packed bytes P (two codes a byte, the first element in the high nibble), the 16-entry code
table C (fp32) and one fp32 scale per block of ``blocksize`` elements:

    W[2i]   = dtype(C[P[i] >> 4] · absmax[2i // blocksize])
    W[2i+1] = dtype(C[P[i] & 15] · absmax[(2i+1) // blocksize])

The product in fp32, rounded once to ``dtype`` (round to nearest even): bitsandbytes' own kernels
compute the same, so the result is theirs bit for bit. Nothing is saved (a frozen weight, no backward).
One program per BLOCK bytes (2·BLOCK elements): the code table is 64 bytes, read from L1; each output
element is written once, the pair of a byte as one contiguous [BLOCK, 2] tile. The block size is a
compile-time constant (bitsandbytes uses 64 for 4-bit weights: a shift) and the offsets 32-bit below 2^31
elements: the H200's profile of the 8B QLoRA step (2026-12-05) had this kernel at ≈ 4× its memory time
with a runtime 64-bit division per element.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from ._common import Launcher, cdiv, target_of, warps_as_threads

_BLOCK = 1024  # bytes a program: 2048 elements, 4 KiB of bf16 out
_WARPS = 4  # on NVIDIA's 32-wide warps: 16 elements a thread


@triton.jit
def _dequantize_4bit_fwd_kernel(P, ABSMAX, CODE, OUT, n, n_bytes, BLOCKSIZE: tl.constexpr, BLOCK: tl.constexpr,
                                WIDE: tl.constexpr):
    pid = tl.program_id(0)
    if WIDE:  # 2^31 elements or more: 64-bit offsets
        pid = pid.to(tl.int64)
    i = pid * BLOCK + tl.arange(0, BLOCK)
    byte = tl.load(P + i, mask=i < n_bytes, other=0).to(tl.int32)
    hi = tl.load(CODE + (byte >> 4))
    lo = tl.load(CODE + (byte & 15))
    e = tl.join(2 * i, 2 * i + 1)  # [BLOCK, 2]: each byte's two elements side by side, as in memory
    v = tl.join(hi, lo)
    m = e < n
    scale = tl.load(ABSMAX + e // BLOCKSIZE, mask=m, other=0.0)  # a constant block size: a shift, not a division
    tl.store(OUT + e, (v * scale).to(OUT.dtype.element_ty), mask=m)


@triton.jit
def _dequantize_scales_kernel(Q, ABSMAX2, CODE2, OFFSET, OUT, n, BLOCKSIZE2: tl.constexpr, BLOCK: tl.constexpr):
    i = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    m = i < n
    q = tl.load(Q + i, mask=m, other=0).to(tl.int32)
    v = tl.load(CODE2 + q) * tl.load(ABSMAX2 + i // BLOCKSIZE2, mask=m, other=0.0)
    tl.store(OUT + i, v + tl.load(OFFSET), mask=m)  # (launched without fp fusion: two roundings, as bitsandbytes)


_launch = Launcher(_dequantize_4bit_fwd_kernel)
_launch_scales = Launcher(_dequantize_scales_kernel)
_SCALES_BLOCK = 1024


def dequantize_4bit_fwd(packed: torch.Tensor, absmax: torch.Tensor, code: torch.Tensor, blocksize: int, rows: int,
                        cols: int, dtype: torch.dtype) -> torch.Tensor:
    """[rows × cols] in ``dtype`` (the reference backend's twin: backends/reference/dequant_4bit.py)."""
    out = torch.empty((rows, cols), dtype=dtype, device=packed.device)
    dequantize_4bit_into(packed, absmax, code, blocksize, out)
    return out


def dequantize_4bit_into(packed: torch.Tensor, absmax: torch.Tensor, code: torch.Tensor, blocksize: int,
                         out: torch.Tensor) -> None:
    """``dequantize_4bit_fwd`` written into ``out`` (contiguous: one base's rows of a joint operand)."""
    if not out.is_contiguous():
        raise ValueError("dequantize_4bit_into: out must be contiguous (a block of whole rows)")
    n = out.numel()
    if n == 0:
        return
    p = packed.reshape(-1).view(torch.uint8)
    n_bytes = (n + 1) // 2
    _launch((cdiv(n_bytes, _BLOCK),), p, absmax.float().contiguous(), code.float().contiguous(), out, n, n_bytes,
            BLOCKSIZE=blocksize, BLOCK=_BLOCK, WIDE=n + 2 * _BLOCK >= 2 ** 31,
            num_warps=warps_as_threads(_WARPS, target_of(p)))


def dequantize_scales_fwd(q: torch.Tensor, absmax2: torch.Tensor, code2: torch.Tensor, blocksize2: int,
                          offset: torch.Tensor) -> torch.Tensor:
    """Double quantisation's fp32 block scales, code2[q]·absmax2[i // blocksize2] + offset: the product rounded,
    then the sum (launched with ``enable_fp_fusion=False``, so no FMA joins them), as bitsandbytes computes them."""
    flat = q.reshape(-1).view(torch.uint8)
    out = torch.empty(flat.numel(), dtype=torch.float32, device=flat.device)
    if out.numel():
        _launch_scales((cdiv(out.numel(), _SCALES_BLOCK),), flat, absmax2.float().contiguous(), code2.float().contiguous(),
                       offset.float().reshape(1), out, out.numel(), BLOCKSIZE2=blocksize2, BLOCK=_SCALES_BLOCK,
                       num_warps=warps_as_threads(_WARPS, target_of(flat)), enable_fp_fusion=False)
    return out
