"""The 4-bit dequantising GEMM (backends/triton/dequant_matmul_4bit.py) as dequantise-then-matmul in PyTorch:

    forward:  y = x · Ŵᵀ,   backward: dx = dy · Ŵ,   Ŵ = dequantize_4bit(P, absmax, C) in the weight's dtype

what the fused QLoRA path computes without the fused kernel, and the oracle of its tests.
"""
from __future__ import annotations

import torch
from torch import Tensor

from .dequant_4bit import dequantize_4bit_fwd


def dequant_matmul_4bit_fwd(x: Tensor, packed: Tensor, absmax: Tensor, code: Tensor, blocksize: int, rows: int,
                            cols: int, w_dtype: torch.dtype) -> Tensor:
    return x @ dequantize_4bit_fwd(packed, absmax, code, blocksize, rows, cols, w_dtype).t()


def dequant_matmul_4bit_bwd(dy: Tensor, packed: Tensor, absmax: Tensor, code: Tensor, blocksize: int, rows: int,
                            cols: int, w_dtype: torch.dtype) -> Tensor:
    return dy @ dequantize_4bit_fwd(packed, absmax, code, blocksize, rows, cols, w_dtype)
