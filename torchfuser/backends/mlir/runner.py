"""Calls a compiled kernel on PyTorch tensors: allocation of outputs, row blocks, threads.

Row inputs and outputs are viewed as (rows, *row_shape) without copies when their inner
stride is 1 (any other stride is fine); only an input whose last dim is strided is made
contiguous first. Outputs are allocated here by PyTorch, contiguous, and written in place
by the kernel. Rows are split into contiguous blocks that worker threads take one at a time
(the ctypes call releases the GIL); every block's fp32 sum outputs land in its own row of a
(blocks, ...) buffer that is added up at the end.
"""
from __future__ import annotations

import itertools
import os
import threading
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

import torch

from .capture import ROW

# Below this many elements per worker, handing a block to a thread costs more than it saves
# (≈0.1 ms on a loaded 2-core machine; NOTES-mlir.md).
MIN_BLOCK_ELEMS = 1 << 18
# Dynamic blocks: about this many elements each (4 MiB of fp32 per row tensor), at most
# MAX_BLOCKS_PER_THREAD per worker (each block is one ctypes call, ~10–20 µs).
BLOCK_ELEMS = 1 << 20
MAX_BLOCKS_PER_THREAD = 8

_pool: ThreadPoolExecutor | None = None
_pool_lock = threading.Lock()


def num_threads() -> int:
    env = os.environ.get("TORCHFUSER_MLIR_THREADS")
    return max(1, int(env)) if env else max(1, torch.get_num_threads())


def _executor(n: int) -> ThreadPoolExecutor:
    global _pool
    with _pool_lock:
        if _pool is None or _pool._max_workers < n:
            _pool = ThreadPoolExecutor(max_workers=n, thread_name_prefix="torchfuser-mlir")
        return _pool


def _memref_args(t: torch.Tensor, row0: int | None = None, rows: int | None = None) -> list[int]:
    """Exploded memref descriptor of ``t`` (or of rows row0:row0+rows of it): pointers and ints."""
    ptr = t.data_ptr()
    sizes = list(t.shape)
    strides = list(t.stride())
    if row0 is not None:
        ptr += row0 * strides[0] * t.element_size()
        sizes[0] = rows
    return [ptr, ptr, 0, *sizes, *strides]


def as_rows(t: torch.Tensor, row_shape: tuple[int, ...]) -> torch.Tensor:
    """(…, *row_shape) → (rows, *row_shape), a view whenever the layout allows."""
    if row_shape and t.stride(-1) != 1:
        t = t.contiguous()
    if not row_shape and t.dim() and t.stride(-1) != 1:
        t = t.contiguous()
    k = len(row_shape)
    lead = t.shape[: t.dim() - k]
    n = 1
    for d in lead:
        n *= d
    try:
        return t.view(n, *row_shape)
    except RuntimeError:
        return t.reshape(n, *row_shape)


def call_packed(fn, args: list[int]) -> None:
    """``fn(void **)`` with one pointer per scalar; the scalars live in an int64 tensor."""
    vals = torch.tensor(args, dtype=torch.int64)
    ptrs = torch.arange(0, 8 * len(args), 8, dtype=torch.int64).add_(vals.data_ptr())
    fn(ptrs.data_ptr())


@dataclass
class Call:
    fn: object
    roles: tuple[str, ...]          # per kernel arg after n: ROW / bcast for inputs, ROW / sum for outputs
    n_inputs: int


def run(kernel: Call, n: int, inputs: list[torch.Tensor], outputs: list[torch.Tensor], plan: "Plan") -> None:
    """Run rows [0, n) as ``plan.blocks`` row blocks on ``plan.threads`` workers.

    Workers (the calling thread and pool threads) take the next block from a shared counter
    until none is left: a worker that the OS schedules less (a loaded machine) simply runs
    fewer blocks. Block ``i`` writes its sums into row ``i`` of each (blocks, ...) sum buffer.
    """
    blocks = plan.blocks
    bounds = [(n * i) // blocks for i in range(blocks + 1)]

    def block(i: int) -> None:
        r0, r1 = bounds[i], bounds[i + 1]
        args = [r1 - r0]
        for t, role in zip(inputs + outputs, kernel.roles):
            if role == ROW:
                args += _memref_args(t, r0, r1 - r0)
            elif role == "sum":
                args += _memref_args(t[i])
            else:
                args += _memref_args(t)
        call_packed(kernel.fn, args)

    if plan.threads == 1:
        for i in range(blocks):
            block(i)
        return
    counter = itertools.count()   # next() is atomic under the GIL

    def worker() -> None:
        while (i := next(counter)) < blocks:
            block(i)

    futures = [_executor(plan.threads - 1).submit(worker) for _ in range(plan.threads - 1)]
    worker()
    for f in futures:
        f.result()


@dataclass(frozen=True)
class Plan:
    threads: int
    blocks: int


def plan(n: int, row_elems: int) -> Plan:
    """Workers and row blocks for n rows of row_elems elements each: about ``BLOCK_ELEMS``
    per block (several per worker, so that the counter can balance), at least
    ``MIN_BLOCK_ELEMS`` per worker."""
    want = num_threads()
    total = n * max(row_elems, 1)
    threads = max(1, min(want, total // MIN_BLOCK_ELEMS, n))
    if threads == 1:
        return Plan(1, 1)
    blocks = max(threads, min(n, total // BLOCK_ELEMS, threads * MAX_BLOCKS_PER_THREAD))
    return Plan(threads, blocks)
