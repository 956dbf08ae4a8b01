"""The GEMM whose weight operand is a 4-bit base dequantised tile by tile (QLoRA: modules/adapters/quantized_base.py)
as a custom op: x·Ŵᵀ (``transpose_w``, the forward) or dy·Ŵ (the input's gradient), in the weight's dtype.
No autograd: the base is frozen and the LoRA node calls both directions itself. Backends: triton (the fused
kernel) and reference (dequantise, then matmul: what the node runs without the kernel)."""
from __future__ import annotations

import torch
from torch import Tensor

from ._call import kernel, run


@torch.library.custom_op("torchfuser::dequant_matmul_4bit", mutates_args=())
def dequant_matmul_4bit_op(a: Tensor, packed: Tensor, absmax: Tensor, code: Tensor, blocksize: int, rows: int,
                           cols: int, w_dtype: torch.dtype, transpose_w: bool, backend: str) -> Tensor:
    name = "dequant_matmul_4bit_fwd" if transpose_w else "dequant_matmul_4bit_bwd"
    return kernel(backend, name)(a, packed, absmax, code, blocksize, rows, cols, w_dtype)


@dequant_matmul_4bit_op.register_fake
def _(a, packed, absmax, code, blocksize, rows, cols, w_dtype, transpose_w, backend):
    return a.new_empty((*a.shape[:-1], rows if transpose_w else cols), dtype=w_dtype)


def dequant_matmul_4bit(a: Tensor, packed: Tensor, absmax: Tensor, code: Tensor, blocksize: int, rows: int, cols: int,
                        w_dtype: torch.dtype, transpose_w: bool, backend: str) -> Tensor:
    backend = "reference" if backend == "mlir" else backend
    return run(dequant_matmul_4bit_op, a, packed, absmax, code, blocksize, rows, cols, w_dtype, transpose_w, backend)
