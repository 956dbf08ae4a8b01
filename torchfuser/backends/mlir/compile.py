"""Kernel factory: (op, spec, reference fn, argument specs) → a cached, loaded ``Kernel``."""
from __future__ import annotations

import os
import tempfile
import time
from typing import Callable, Sequence

import torch

from . import cache, jit, pipeline
from .capture import ArgSpec, Captured, capture
from .kernel import Kernel

# Chunk rows: about this many elements per row-chunk of one input (fits L2 with the temporaries).
CHUNK_ELEMS = 32768


def default_rows(args: Sequence[ArgSpec]) -> int:
    row = next((a for a in args if a.role == "row"), None)
    elems = 1
    for d in row.shape if row else ():
        elems *= d
    return max(2, min(64, CHUNK_ELEMS // max(elems, 1)))


def _dtype(name: str) -> torch.dtype:
    return getattr(torch, name.split(".", 1)[1])


def _meta(cap: Captured) -> dict:
    return {
        "name": cap.name,
        "rows": cap.rows,
        "args": [[a.role, list(a.shape), str(a.dtype)] for a in cap.args],
        "out_roles": list(cap.out_roles),
        "out_shapes": [list(s) for s in cap.out_shapes],
        "out_dtypes": [str(d) for d in cap.out_dtypes],
        "final_dtypes": [str(d) for d in cap.final_dtypes],
    }


def _captured(meta: dict) -> Captured:
    return Captured(
        name=meta["name"],
        args=tuple(ArgSpec(r, tuple(s), _dtype(d)) for r, s, d in meta["args"]),
        rows=meta["rows"],
        graphs={},
        out_roles=tuple(meta["out_roles"]),
        out_shapes=tuple(tuple(s) for s in meta["out_shapes"]),
        out_dtypes=tuple(_dtype(d) for d in meta["out_dtypes"]),
        final_dtypes=tuple(_dtype(d) for d in meta["final_dtypes"]),
    )


def _load(directory: str, meta: dict) -> Kernel:
    cap = _captured(meta)
    key = meta["key"]
    if meta.get("artifact") == "so":
        loaded = jit.load_shared(os.path.join(directory, key + ".so"), [])
    else:
        with open(os.path.join(directory, key + ".mlir")) as f:
            loaded, _ = jit.jit(f.read(), [])
    return Kernel(cap, loaded, {"source": "disk"})


def _build(directory, key, op: str, fn: Callable, args, rows: int) -> Kernel:
    t0 = time.perf_counter()
    cap = capture(op, fn, args, rows)
    t1 = time.perf_counter()
    art = pipeline.compile_captured(cap)
    t2 = time.perf_counter()
    meta = dict(_meta(cap), key=key)
    want_so = directory is not None and cache.compiler() is not None
    loaded, engine = jit.jit(art.llvm_ir, [], pic=want_so)
    t3 = time.perf_counter()
    if directory is not None:
        if want_so:
            with tempfile.TemporaryDirectory() as tmp:
                obj = os.path.join(tmp, "kernel.o")
                engine.dump_to_object_file(obj)
                cache.store(directory, key, meta, so_from_obj=obj, mlir_text=art.llvm_ir)
        else:
            cache.store(directory, key, meta, mlir_text=art.llvm_ir)
    timings = {"capture": t1 - t0, **art.timings, "jit": t3 - t2, "store": time.perf_counter() - t3}
    return Kernel(cap, loaded, {"source": "compile", "timings": timings})


# (op, spec, args, rows) → cache key: hashing the key's json costs more than a small kernel.
_keys: dict[tuple, str] = {}


def kernel_for(op: str, spec: dict, fn: Callable, args: Sequence[ArgSpec], rows: int | None = None) -> Kernel:
    """The compiled kernel of ``fn`` (a function of the tensors described by ``args``)."""
    args = tuple(args)
    empty = [a.shape for a in args if 0 in a.shape]
    if empty:  # MLIR has no zero-size memref to compile for: say so before the parser does
        raise ValueError(f"{op}: the mlir backend compiles no kernel for zero-size rows (shapes {empty}); "
                         "torchfuser.functional runs empty tensors on the reference backend")
    rows = rows or default_rows(args)
    try:
        fast = (op, tuple(sorted(spec.items())), args, rows)
        key = _keys.get(fast)
    except TypeError:  # an unhashable spec value
        fast, key = None, None
    if key is None:
        key = cache.make_key(op, spec, list(args), rows)
        if fast is not None and len(_keys) < 4096:
            _keys[fast] = key
    return cache.get(key, _load, lambda d, k: _build(d, k, op, fn, args, rows))


def stage_ir(op: str, fn: Callable, args: Sequence[ArgSpec], rows: int | None = None) -> dict[str, str]:
    """The IR after each pipeline stage for ``fn`` over ``args``, compiled afresh (not cached, not
    loaded): what ``torchfuser.jit(...).explain`` shows for a region."""
    args = tuple(args)
    cap = capture(op, fn, args, rows or default_rows(args))
    return pipeline.compile_captured(cap, dump=("all",), out=None).ir
