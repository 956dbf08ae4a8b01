"""4-bit blockwise dequantisation (bitsandbytes' NF4 / FP4 layout) in plain PyTorch.

For the packed bytes P (two codes a byte, the first element in the high nibble), the 16-entry code
table C (fp32) and one fp32 scale per block of ``blocksize`` elements:

    W[e] = dtype(C[nibble(P, e)] · absmax[e // blocksize]),  nibble(P, e) = P[e//2] >> 4 if e even else P[e//2] & 15

The product is taken in fp32 and rounded once to ``dtype``: bitsandbytes' kernels (CUDA, CPU and its
PyTorch default) compute the same, so the result is theirs bit for bit (tests/test_qlora_fused.py).
Nothing is saved: the weight is frozen, the op has no backward.
"""
from __future__ import annotations

import torch
from torch import Tensor


def dequantize_4bit_fwd(packed: Tensor, absmax: Tensor, code: Tensor, blocksize: int, rows: int, cols: int,
                        dtype: torch.dtype) -> Tensor:
    """[rows × cols] in ``dtype`` from ``packed`` (uint8, ⌈rows·cols/2⌉ bytes, any shape), ``absmax``
    (fp32, one per block of the row-major flattened weight) and ``code`` (16 fp32 values)."""
    n = rows * cols
    p = packed.reshape(-1).view(torch.uint8)
    idx = torch.stack(((p >> 4), (p & 15)), dim=1).reshape(-1)[:n].long()
    vals = code.float()[idx]
    blocks = torch.arange(n, device=p.device) // blocksize
    return (vals * absmax.float()[blocks]).to(dtype).view(rows, cols)


def dequantize_4bit_into(packed: Tensor, absmax: Tensor, code: Tensor, blocksize: int, out: Tensor) -> None:
    """``dequantize_4bit_fwd`` written into ``out`` ([rows × cols], its dtype)."""
    out.copy_(dequantize_4bit_fwd(packed, absmax, code, blocksize, out.shape[0], out.shape[1], out.dtype))


def dequantize_blockwise_8bit_fwd(q: Tensor, absmax: Tensor, code: Tensor, blocksize: int) -> Tensor:
    """fp32 ``code[q[i]] · absmax[i // blocksize]``: bitsandbytes' 8-bit blockwise dequantisation, the
    nested ("double") quantisation of the 4-bit scales."""
    flat = q.reshape(-1)
    blocks = torch.arange(flat.numel(), device=flat.device) // blocksize
    return code.float()[flat.long()] * absmax.float()[blocks]


def dequantize_scales_fwd(q: Tensor, absmax2: Tensor, code2: Tensor, blocksize2: int, offset: Tensor) -> Tensor:
    """Double quantisation's fp32 block scales: the 8-bit blockwise codes dequantised, plus the offset."""
    return dequantize_blockwise_8bit_fwd(q, absmax2, code2, blocksize2) + offset
