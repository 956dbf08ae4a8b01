"""GEMM helpers shared by the fused projections (``projections``) and the fused LoRA node
(``adapters.lora``): products written in fp32 from cuBLAS's accumulator where it supports that, column
sums, and parameters cast and concatenated. A leaf: it imports no other fused module."""
from __future__ import annotations

import torch
from torch import Tensor

from torchfuser.backends._gemm import fp32_out_ok

_SMALL_BYTES = 32 << 20


def column_sums(g: Tensor) -> Tensor:
    """Σ over the rows of g, in fp32: as a product with a row of ones where cuBLAS writes fp32 from
    low-precision operands (a bias gradient of 8192×1152 bf16 on an H200: 14 µs, against 22 µs for
    the column reduction kernel of ``sum``; the same fp32 accumulation of exact values), else ``sum``."""
    if g.dtype != torch.float32 and fp32_out_ok(g.device):
        return torch.mm(g.new_ones(1, g.shape[0]), g, out_dtype=torch.float32)[0]
    return g.sum(0, dtype=torch.float32)


def mm(a: Tensor, b: Tensor, dtype: torch.dtype) -> Tensor:
    """a·b in ``dtype``: written in fp32 by cuBLAS from its fp32 accumulator where supported (fp32
    is the one out_dtype it takes for bf16/fp16 operands), else rounded to the operands' dtype and
    then cast (autocast's numerics)."""
    if dtype == torch.float32 and a.dtype != dtype and fp32_out_ok(a.device):
        return torch.mm(a, b, out_dtype=dtype)
    out = torch.mm(a, b)
    return out if out.dtype == dtype else out.to(dtype)  # no ATen call for a cast that does nothing


def cast_cat(params: list[Tensor], dtype: torch.dtype) -> Tensor:
    """The parameters cast to ``dtype`` and concatenated. Small ones: concatenate, then cast (two
    launches, one cast back in the backward). Large ones: cast each into its rows of the result (fewer
    bytes: the fp32 concatenation of an MLP's 2 × 16M weights would move 268 MB more)."""
    if sum(p.numel() for p in params) * params[0].element_size() <= _SMALL_BYTES:
        return torch.cat(params).to(dtype)
    if torch.is_grad_enabled():
        return torch.cat([p.to(dtype) for p in params])
    # Without autograd to record it (inside _AutocastLinear): each cast written straight into its rows,
    # one read and one write per element instead of a cast and then a concatenation of the casts.
    out = params[0].new_empty((sum(p.shape[0] for p in params), *params[0].shape[1:]), dtype=dtype)
    for rows, p in zip(out.split([p.shape[0] for p in params]), params):
        rows.copy_(p)
    return out
