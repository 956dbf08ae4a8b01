"""4-bit blockwise dequantisation (bitsandbytes' NF4 / FP4 layout) as a custom op: the transient base
weight of a QLoRA projection (modules/adapters/quantized_base.py). No autograd: the base is frozen. Backends:
reference (PyTorch; also what ``mlir`` runs: a gather and a product leave nothing to fuse) and triton."""
from __future__ import annotations

import torch
from torch import Tensor

from ._call import kernel, run


@torch.library.custom_op("torchfuser::dequantize_4bit", mutates_args=())
def dequantize_4bit_fwd(packed: Tensor, absmax: Tensor, code: Tensor, blocksize: int, rows: int, cols: int,
                        dtype: torch.dtype, backend: str) -> Tensor:
    return kernel(backend, "dequantize_4bit_fwd")(packed, absmax, code, blocksize, rows, cols, dtype)


@dequantize_4bit_fwd.register_fake
def _(packed, absmax, code, blocksize, rows, cols, dtype, backend):
    return packed.new_empty((rows, cols), dtype=dtype)


def dequantize_4bit(packed: Tensor, absmax: Tensor, code: Tensor, blocksize: int, rows: int, cols: int,
                    dtype: torch.dtype, backend: str) -> Tensor:
    backend = "reference" if backend == "mlir" else backend
    return run(dequantize_4bit_fwd, packed, absmax, code, blocksize, rows, cols, dtype, backend)
