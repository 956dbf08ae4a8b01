"""``compile_graph``: an FX graph of ATen pointwise ops and reductions through the same pipeline."""
from __future__ import annotations

from typing import Sequence

import torch

from .capture import BCAST, ROW, ArgSpec
from .compile import kernel_for
from .ops import SUPPORTED


def compile_graph(gm: torch.fx.GraphModule, example_inputs: Sequence[torch.Tensor], *, dynamic: bool):
    """Compile ``gm`` (ATen pointwise ops and reductions, no matmuls) to a CPU kernel.

    Contract:
    - ``example_inputs``: real CPU tensors, float32/bfloat16/float16 (or integer/bool); no
      SymInts. ``gm`` must be re-traceable by ``make_fx`` at other leading sizes when
      ``dynamic=True`` (no sizes baked into view/expand arguments).
    - Dim 0 of the first input is the *row* dim. Every input of rank ≥ 1 whose dim 0 has that
      size is a row input; others are broadcast inputs (same shape at every call).
    - Every output must be either per-row (dim 0 = rows, each row computed from the same row
      of the row inputs) or a sum over rows (e.g. a weight gradient). Anything else (a mean
      over rows, a cross-row op) raises ``NotImplementedError`` at compile time.
    - ``dynamic=True``: the returned callable takes any number of rows. ``dynamic=False``:
      same kernel, but calls with another row count are rejected (ValueError).
    - The callable takes torch tensors in ``example_inputs`` order (any strides; inner stride
      1 avoids a copy) and returns a tuple of contiguous torch tensors, in ``gm``'s output
      order, dtypes as ``gm`` would give. Kernels are cached like the op kernels (key: the
      graph's code, the argument specs).
    """
    if not example_inputs or example_inputs[0].dim() == 0:
        raise NotImplementedError("compile_graph: the first input must have a leading (row) dim")
    n = example_inputs[0].shape[0]
    args = []
    for t in example_inputs:
        if t.is_floating_point() and t.dtype not in SUPPORTED:
            raise TypeError(f"compile_graph: {t.dtype} is not supported by the mlir backend")
        if t.dim() >= 1 and t.shape[0] == n:
            args.append(ArgSpec(ROW, tuple(t.shape[1:]), t.dtype))
        else:
            args.append(ArgSpec(BCAST, tuple(t.shape), t.dtype))

    def fn(*xs):
        out = gm(*xs)
        return tuple(out) if isinstance(out, (tuple, list)) else (out,)

    _check_row_contract(fn, example_inputs, args, n)
    kernel = kernel_for("graph", {"code": gm.code}, fn, args)

    def run(*xs):
        if not dynamic and xs[0].shape[0] != n:
            raise ValueError(f"compile_graph(dynamic=False) kernel compiled for {n} rows, got {xs[0].shape[0]}")
        return tuple(kernel(*xs))

    run.kernel = kernel
    return run


def _check_row_contract(fn, inputs, args, n: int) -> None:
    """The kernel runs the graph chunk by chunk of rows: each output must be per-row (the chunks'
    outputs stacked) or a sum over rows (the chunks' outputs added). Check that on the example
    inputs, split in two, so that any other output raises here instead of coming out wrong."""
    from torch._subclasses.fake_tensor import unset_fake_temporarily

    # Under torch.compile a fake-tensor mode is active; this check runs on the real examples.
    with torch.no_grad(), unset_fake_temporarily():
        full = fn(*inputs)
        if n < 2:
            if any(o.dim() == 0 or o.shape[0] != n for o in full):
                raise NotImplementedError("compile_graph: needs at least 2 example rows to check its outputs are per-row or sums over rows")
            return
        halves = [fn(*[t[rows] if a.role == ROW else t for t, a in zip(inputs, args)]) for rows in (slice(0, n // 2), slice(n // 2, n))]
        for i, (out, a, b) in enumerate(zip(full, *halves)):
            ref, a, b = out.double(), a.double(), b.double()
            tol = 1e-3 * (ref.abs().max().item() + 1.0)
            stacked = out.dim() >= 1 and torch.cat([a, b]).shape == out.shape
            if stacked and (torch.cat([a, b]) - ref).abs().max().item() <= tol:
                continue
            if a.shape == out.shape and (a + b - ref).abs().max().item() <= tol:
                continue
            raise NotImplementedError(
                f"compile_graph: output {i} (shape {tuple(out.shape)}) is neither per-row nor a sum over rows; "
                "keep this region in ATen"
            )
