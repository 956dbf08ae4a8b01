"""Stage ``jit``: the LLVM-dialect module → machine code with MLIR's ExecutionEngine.

The kernel is called through the engine's packed ABI (``_mlir_kernel(void **args)``, one
pointer per scalar of the exploded signature; every memref argument is ``(allocated ptr,
aligned ptr, offset, sizes..., strides...)``). The scalars are integers taken from
``Tensor.data_ptr()``/``stride()``, stored in a small int64 tensor; the pointer array is a
second int64 tensor. Nothing is copied and no descriptor objects are built. The one call goes
through a ``ctypes.CFUNCTYPE`` prototype, which releases the GIL, so row blocks run in
parallel from Python threads.
"""
from __future__ import annotations

import ctypes
from dataclasses import dataclass

OPT_LEVEL = 3


@dataclass
class Loaded:
    fn: object          # ctypes function
    keepalive: object   # engine (or shared library) that owns the code


PACKED = ctypes.CFUNCTYPE(None, ctypes.c_void_p)


def prototype(ranks: list[int]):
    return PACKED


def jit(llvm_ir: str, ranks: list[int], *, pic: bool = False) -> tuple[Loaded, object]:
    """JIT-compile; returns the loaded kernel and the engine (to dump an object file from)."""
    from torch_mlir import ir
    from torch_mlir.execution_engine import ExecutionEngine

    from .importer import context

    ctx = context()
    with ctx:
        module = ir.Module.parse(llvm_ir)
        engine = ExecutionEngine(module, opt_level=OPT_LEVEL, enable_object_dump=pic, enable_pic=pic)
        engine.initialize()
        addr = engine.raw_lookup("kernel")
    if not addr:
        raise RuntimeError("torchfuser mlir: the JIT-compiled module has no @kernel")
    return Loaded(prototype(ranks)(addr), (engine, ctx, module)), engine


def load_shared(path: str, ranks: list[int]) -> Loaded:
    """A kernel from the on-disk cache (a shared object linked from the JIT's object file)."""
    lib = ctypes.CDLL(path)
    fn = PACKED(ctypes.cast(lib._mlir_kernel, ctypes.c_void_p).value)
    return Loaded(fn, lib)
