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


@torch.library.custom_op("torchfuser::dequantize_4bit_into", mutates_args=("out",))
def dequantize_4bit_into_fwd(packed: Tensor, absmax: Tensor, code: Tensor, blocksize: int, out: Tensor,
                             backend: str) -> None:
    kernel(backend, "dequantize_4bit_into")(packed, absmax, code, blocksize, out)


def dequantize_4bit_into(packed: Tensor, absmax: Tensor, code: Tensor, blocksize: int, out: Tensor,
                         backend: str) -> None:
    """``dequantize_4bit`` written into ``out`` (contiguous [rows × cols]: e.g. one base's rows of a joint operand,
    so the bases of q/k/v or gate/up need no concatenation of their bytes first)."""
    backend = "reference" if backend == "mlir" else backend
    run(dequantize_4bit_into_fwd, packed, absmax, code, blocksize, out, backend)


@torch.library.custom_op("torchfuser::dequantize_scales", mutates_args=())
def dequantize_scales_fwd(q: Tensor, absmax2: Tensor, code2: Tensor, blocksize2: int, offset: Tensor,
                          backend: str) -> Tensor:
    return kernel(backend, "dequantize_scales_fwd")(q, absmax2, code2, blocksize2, offset)


@dequantize_scales_fwd.register_fake
def _(q, absmax2, code2, blocksize2, offset, backend):
    return q.new_empty((q.numel(),), dtype=torch.float32)


def dequantize_scales(q: Tensor, absmax2: Tensor, code2: Tensor, blocksize2: int, offset, backend: str) -> Tensor:
    """The fp32 block scales of a double-quantised 4-bit weight (bitsandbytes' ``nested`` quant state): one launch
    on the Triton backend, where the offset is a tensor on q's device (else the reference kernel)."""
    if backend == "mlir" or not (isinstance(offset, Tensor) and offset.device == q.device):
        backend = "reference"
    if not isinstance(offset, Tensor):
        offset = torch.tensor(float(offset), dtype=torch.float32)
    return run(dequantize_scales_fwd, q, absmax2, code2, blocksize2, offset, backend)
