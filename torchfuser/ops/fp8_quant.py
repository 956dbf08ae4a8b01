"""FP8 quantisation of a GEMM operand (``torchfuser::fp8_quantize``): (q e4m3 row-major, fp32 scale)
of s = t or, with ``transpose``, s = tᵀ, scaled per row of s or, ``tensorwise``, once; and of an
operand two GEMMs need, one row-scaled and one column-scaled (``torchfuser::fp8_quantize_both``:
both of those at once, t read twice in all instead of three or four times). The formula is
backends/reference/fp8_quant.py's; the Triton kernels give its bits exactly. Not differentiated: the
FP8 GEMMs' autograd (modules/fp8.py) calls it on detached operands.

Which code runs:
- CUDA (Triton installed): the Triton kernels, through the custom op (eagerly, straight to them).
- Elsewhere (the CPU, tests): the reference PyTorch code.
- Inside torch.compile on CUDA: by default the reference PyTorch code, traced into the graph, so
  Inductor fuses the amax, the scale and the cast with the kernel that produces the operand (the
  norm, which also reaches Inductor as its definition, or the activation) and the transposition
  into its own generated kernel: the producer fusion issue 23 asks for, which an opaque kernel
  forbids. ``TORCHFUSER_COMPILED_ELEMENTWISE=kernels`` (or any policy that does not name
  ``fp8_quantize``, e.g. ``inductor:rms_norm``) keeps the custom op, whose fake impl traces. The
  policy's name ``fp8_quantize`` covers ``fp8_quantize_both`` too (one switch for the FP8 operands).
"""
from __future__ import annotations

import os

import torch
from torch import Tensor

from torchfuser.backends import _INSTALLED
from torchfuser.backends.reference import fp8_quant as _reference

from ._call import _POLICY, inductor_fuses, kernel, run

E4M3 = _reference.E4M3
_TRITON = _INSTALLED["triton"]


@torch.library.custom_op("torchfuser::fp8_quantize", mutates_args=())
def fp8_quantize(t: Tensor, tensorwise: bool, transpose: bool, backend: str) -> tuple[Tensor, Tensor]:
    if backend == "reference":  # not in the reference package's table: this op is called from here only
        return _reference.fp8_quantize(t, tensorwise, transpose)
    return kernel(backend, "fp8_quantize")(t, tensorwise, transpose)


@fp8_quantize.register_fake
def _(t, tensorwise, transpose, backend):
    rows, cols = (t.shape[1], t.shape[0]) if transpose else t.shape
    scale = t.new_empty((), dtype=torch.float32) if tensorwise else t.new_empty((rows, 1), dtype=torch.float32)
    return t.new_empty((rows, cols), dtype=E4M3), scale


@torch.library.custom_op("torchfuser::fp8_quantize_both", mutates_args=())
def fp8_quantize_both(t: Tensor, tensorwise: bool, backend: str) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    if backend == "reference":
        (q, s), (qt, st) = _reference.fp8_quantize_both(t, tensorwise)
    else:
        (q, s), (qt, st) = kernel(backend, "fp8_quantize_both")(t, tensorwise)
    return q, s, qt, st


@fp8_quantize_both.register_fake
def _(t, tensorwise, backend):
    rows, cols = t.shape
    s, st = (t.new_empty((), dtype=torch.float32) for _ in range(2)) if tensorwise else \
        (t.new_empty((rows, 1), dtype=torch.float32), t.new_empty((cols, 1), dtype=torch.float32))
    return t.new_empty((rows, cols), dtype=E4M3), s, t.new_empty((cols, rows), dtype=E4M3), st


def _compiled_as_definition() -> bool:
    """Under torch.compile: the PyTorch definition (Inductor fuses it), unless the policy asks for kernels."""
    if os.environ.get(_POLICY, "auto") == "auto":
        return True
    return inductor_fuses("triton", "fp8_quantize")


def quantize(t: Tensor, tensorwise: bool, transpose: bool = False) -> tuple[Tensor, Tensor]:
    """(e4m3 values, fp32 scale) of a 2-D ``t`` (``tᵀ`` with ``transpose``): see the module doc."""
    if not (t.is_cuda and _TRITON) or t.numel() == 0:
        return _reference.fp8_quantize(t, tensorwise, transpose)
    if torch.compiler.is_compiling() and _compiled_as_definition():
        return _reference.fp8_quantize(t, tensorwise, transpose)
    return run(fp8_quantize, t, tensorwise, transpose, "triton")


def quantize_both(t: Tensor, tensorwise: bool) -> tuple[tuple[Tensor, Tensor], tuple[Tensor, Tensor]]:
    """(``quantize(t, tensorwise)``, ``quantize(t, tensorwise, True)``) bit for bit, in one call: on CUDA the
    Triton kernels' fastest measured way (backends/triton/fp8_quant.py's ``fp8_quantize_both``)."""
    if not (t.is_cuda and _TRITON) or t.numel() == 0 or (
            torch.compiler.is_compiling() and _compiled_as_definition()):
        return _reference.fp8_quantize_both(t, tensorwise)
    q, s, qt, st = run(fp8_quantize_both, t, tensorwise, "triton")
    return (q, s), (qt, st)
