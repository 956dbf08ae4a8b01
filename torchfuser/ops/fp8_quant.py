"""FP8 quantisation of a GEMM operand (``torchfuser::fp8_quantize``): (q e4m3 row-major, fp32 scale)
of s = t or, with ``transpose``, s = tᵀ, scaled per row of s or, ``tensorwise``, once; and of an
operand two GEMMs need, one row-scaled and one column-scaled (``torchfuser::fp8_quantize_both``:
both of those at once, t read twice in all instead of three or four times). The formula is
backends/reference/fp8_quant.py's; the Triton kernels give its bits exactly. Not differentiated: the
FP8 GEMMs' autograd (modules/fp8/__init__.py) calls it on detached operands.

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

Producers (``attach_amax``): a kernel of ours that writes a GEMM operand (SwiGLU, its backward) may take
the operand's row and column maxima as it writes it, and hand them on with the tensor; ``quantize_both``
then runs the both-ways writer alone (one read, no amax pass). Eager only: nothing is attached under
torch.compile, where Inductor fuses the reference code with the producer instead.

Blockwise (``fp8="blockwise"``: a scale per 128 elements along each GEMM's inner dimension, per 128 × 128
block of a weight; backends/reference/fp8_blocks.py): ``torchfuser::fp8_quantize_blocks`` (an activation,
either or both ways, from one read) and ``torchfuser::fp8_quantize_weight_blocks`` (a weight, both copies
from one read), the same three paths; the policy's ``fp8_quantize`` covers them too.
"""
from __future__ import annotations

import os

import torch
from torch import Tensor

from torchfuser.backends import _INSTALLED
from torchfuser.backends.reference import fp8_blocks as _blocks, fp8_quant as _reference

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


def _kernels(t: Tensor) -> bool:
    """Whether ``t`` is quantised by the Triton kernels here (else the reference code: the CPU, and traced
    under torch.compile unless the policy asks for the kernels)."""
    return t.is_cuda and _TRITON and t.numel() > 0 and not (torch.compiler.is_compiling() and _compiled_as_definition())


def quantize(t: Tensor, tensorwise: bool, transpose: bool = False) -> tuple[Tensor, Tensor]:
    """(e4m3 values, fp32 scale) of a 2-D ``t`` (``tᵀ`` with ``transpose``): see the module doc."""
    if not _kernels(t):
        return _reference.fp8_quantize(t, tensorwise, transpose)
    return run(fp8_quantize, t, tensorwise, transpose, "triton")


_AMAX = "_torchfuser_fp8_amax"
amax_both = _reference.fp8_amax_both


def attach_amax(t: Tensor, amax: Tensor | None) -> Tensor:
    """``t``, carrying its maxima both ways (int32 bit patterns, ``fp8_amax_both``'s) to the FP8 GEMM that
    takes it (None: none to carry). Kept on the tensor object with its version: any in-place change to t or
    a view of it voids them, and a different tensor (a reshape, an accumulated gradient) has none."""
    if amax is not None:
        setattr(t, _AMAX, (t._version, amax))
    return t


def producer(backend: str, name: str, out: int = 0):
    """Backend kernel ``name`` (e.g. ``"rms_norm_fwd"``) as the producer of an FP8 GEMM's operand: its
    outputs, then the maxima of output ``out`` (``fp8_amax_both``'s; None where the kernel takes none). The
    Triton twin that takes them as it writes (``rms_norm_fp8_fwd``); elsewhere the plain kernel, then the
    maxima in PyTorch (the CPU: tests)."""
    if backend == "triton":
        return kernel(backend, f"{name[:-4]}_fp8{name[-4:]}")
    plain = kernel(backend, name)

    def composed(*args):
        outs = plain(*args)
        outs = outs if isinstance(outs, tuple) else (outs,)
        t = outs[out]
        return (*outs, amax_both(t.reshape(-1, t.shape[-1])))

    return composed


def attached_amax(t: Tensor) -> Tensor | None:
    """The maxima ``attach_amax`` left on ``t``, if t has not changed since; else None."""
    got = getattr(t, _AMAX, None)
    return got[1] if got is not None and got[0] == t._version else None


def quantize_both(t: Tensor, tensorwise: bool, amax: Tensor | None = None) -> tuple[tuple[Tensor, Tensor], tuple[Tensor, Tensor]]:
    """(``quantize(t, tensorwise)``, ``quantize(t, tensorwise, True)``) bit for bit, in one call: on CUDA the
    Triton kernels' fastest measured way (backends/triton/fp8_quant.py's ``fp8_quantize_both``); rowwise with
    t's ``amax`` (a producer's, ``attached_amax``) the both-ways writer alone."""
    if amax is not None and not tensorwise:
        if t.is_cuda and _TRITON and not torch.compiler.is_compiling():
            return kernel("triton", "fp8_quantize_both_amax")(t, amax)
        return _reference.fp8_quantize_both_amax(t, amax)
    if not _kernels(t):
        return _reference.fp8_quantize_both(t, tensorwise)
    q, s, qt, st = run(fp8_quantize_both, t, tensorwise, "triton")
    return (q, s), (qt, st)


def _column_major(t: Tensor, rows: int, cols: int) -> Tensor:
    return t.new_empty((cols, rows), dtype=torch.float32).t()


@torch.library.custom_op("torchfuser::fp8_quantize_blocks", mutates_args=())
def fp8_quantize_blocks(t: Tensor, rows: bool, cols: bool, backend: str) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    if backend == "reference":
        return _blocks.fp8_quantize_blocks(t, rows, cols)
    return kernel(backend, "fp8_quantize_blocks")(t, rows, cols)


@fp8_quantize_blocks.register_fake
def _(t, rows, cols, backend):
    m, k = t.shape
    empty = t.new_empty(0, dtype=E4M3), t.new_empty(0, dtype=torch.float32)
    q, s = (t.new_empty((m, k), dtype=E4M3), _column_major(t, m, k // 128)) if rows else empty
    qt, st = (t.new_empty((k, m), dtype=E4M3), _column_major(t, k, m // 128)) if cols else (x.clone() for x in empty)
    return q, s, qt, st


@torch.library.custom_op("torchfuser::fp8_quantize_weight_blocks", mutates_args=())
def fp8_quantize_weight_blocks(w: Tensor, backend: str) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    if backend == "reference":
        return _blocks.fp8_quantize_weight_blocks(w)
    return kernel(backend, "fp8_quantize_weight_blocks")(w)


@fp8_quantize_weight_blocks.register_fake
def _(w, backend):
    n, k = w.shape
    nb, kb = n // 128, k // 128
    padded = lambda r, c: w.new_empty((r, -(-c // 4) * 4), dtype=torch.float32).t()  # noqa: E731
    return w.new_empty((n, k), dtype=E4M3), padded(nb, kb), w.new_empty((k, n), dtype=E4M3), padded(kb, nb)


def quantize_blocks(t: Tensor, rows: bool, cols: bool) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """(q, s, qt, st) of an activation, blockwise (backends/reference/fp8_blocks.py)."""
    if not _kernels(t):
        return _blocks.fp8_quantize_blocks(t, rows, cols)
    return run(fp8_quantize_blocks, t, rows, cols, "triton")


def quantize_weight_blocks(w: Tensor) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """(q, s_fwd, qt, s_bwd) of a weight, blockwise (backends/reference/fp8_blocks.py)."""
    if not _kernels(w):
        return _blocks.fp8_quantize_weight_blocks(w)
    return run(fp8_quantize_weight_blocks, w, "triton")
