"""``compile_graph``: an FX graph of ATen pointwise ops and reductions through the same pipeline."""
from __future__ import annotations

import functools
import hashlib
from typing import Sequence

import torch
from torch import nn

from .capture import BCAST, ROW, ArgSpec
from .compile import kernel_for, stage_ir
from .mathlib import TRIG_BOUND
from .ops import SUPPORTED

_TRIG = (torch.ops.aten.sin.default, torch.ops.aten.cos.default)


def compile_graph(gm: torch.fx.GraphModule, example_inputs: Sequence[torch.Tensor], *, dynamic: bool):
    """Compile ``gm`` (ATen pointwise ops and reductions, no matmuls) to a CPU kernel.

    Contract:
    - ``example_inputs``: real CPU tensors, float32/bfloat16/float16 (or integer/bool); no
      SymInts. ``gm`` must be re-traceable by ``make_fx`` at other leading sizes when
      ``dynamic=True`` (no sizes baked into view/expand arguments).
    - Dim 0 of the first input is the *row* dim, or, where that breaks the row contract below,
      dim 0 of the input of the highest rank (``b[m] + x[n, m]`` traces with b first). An input
      whose dim 0 has that size and whose rank is at least the reference's is a row input; one of
      lower rank is a row input or a broadcast input, whichever keeps the row contract
      (``_row_args``: a bias ``b[n]`` added to ``x[n, n]`` is broadcast); others are broadcast
      inputs (same shape at every call).
    - Every output must be either per-row (dim 0 = rows, each row computed from the same row
      of the row inputs) or a sum over rows (e.g. a weight gradient). Anything else (a mean
      over rows, a cross-row op) raises ``NotImplementedError`` at compile time.
    - ``dynamic=True``: the returned callable takes any number of rows. ``dynamic=False``:
      same kernel, but calls with another row count are rejected (ValueError).
    - The callable takes torch tensors in ``example_inputs`` order (any strides; inner stride
      1 avoids a copy) and returns a tuple of contiguous torch tensors, in ``gm``'s output
      order, dtypes as ``gm`` would give. Kernels are cached like the op kernels (key: the
      graph's code and the values of the constants it reads, the argument specs).
    """
    if not any(t.dim() >= 1 for t in example_inputs):
        raise NotImplementedError("compile_graph: no input has a leading (row) dim")
    for t in example_inputs:
        if t.is_floating_point() and t.dtype not in SUPPORTED:
            raise TypeError(f"compile_graph: {t.dtype} is not supported by the mlir backend")

    def fn(*xs):
        out = gm(*xs)
        return tuple(out) if isinstance(out, (tuple, list)) else (out,)

    # sin/cos compile to a vectorised polynomial that is exact only for |x| < TRIG_BOUND
    # (mathlib.py): the kernel also returns, per sin/cos, a per-row count of arguments beyond
    # it; if any is non-zero the call is recomputed by ATen (libm's exact reduction).
    guarded = any(n.op == "call_function" and n.target in _TRIG for n in gm.graph.nodes)
    kernel_fn = _with_trig_counts(gm) if guarded else fn
    args, ref = _row_args(fn, example_inputs)
    n = example_inputs[ref].shape[0]
    spec = {"code": gm.code, "constants": constants_digest(gm), "trig_bound": TRIG_BOUND if guarded else None}
    kernel = kernel_for("graph", spec, kernel_fn, args)
    n_out = len(kernel.cap.out_roles)

    def run(*xs):
        if not dynamic and xs[ref].shape[0] != n:
            raise ValueError(f"compile_graph(dynamic=False) kernel compiled for {n} rows, got {xs[ref].shape[0]}")
        outs = kernel(*xs)
        if not guarded:
            return tuple(outs)
        counts = outs[n_out - kernel_fn.n_counts:]
        if any(bool(c.any()) for c in counts):
            with torch.no_grad():
                return fn(*xs)
        return tuple(outs[: n_out - kernel_fn.n_counts])

    run.kernel = kernel
    run.stage_ir = functools.cache(lambda: stage_ir("graph", kernel_fn, args))  # for explain, on demand
    return run


def constants_digest(gm: torch.fx.GraphModule) -> str:
    """A hash of what ``gm.code`` reads from ``gm`` (constants, parameters, buffers, submodules): the
    capture bakes those values into the kernel, so two graphs of one code with other constants
    must not share a cache entry."""
    from torch._subclasses.fake_tensor import unset_fake_temporarily

    h = hashlib.sha256()
    with unset_fake_temporarily():
        for node in gm.graph.nodes:
            if node.op not in ("get_attr", "call_module"):
                continue
            value = gm.get_submodule(node.target) if node.op == "call_module" else _attr(gm, node.target)
            if isinstance(value, torch.Tensor):
                tensors, text = [value], ""
            else:
                tensors, text = list(value.state_dict().values()) if isinstance(value, nn.Module) else [], repr(value)
            h.update(f"{node.op}:{node.target}:{text}".encode())
            for t in tensors:
                t = t.detach().cpu().contiguous().reshape(-1)
                h.update(f"{t.dtype}{tuple(t.shape)}".encode() + t.view(torch.uint8).numpy().tobytes())
    return h.hexdigest()[:24]


def _attr(gm: torch.fx.GraphModule, target: str):
    value = gm
    for part in target.split("."):
        value = getattr(value, part)
    return value


def _with_trig_counts(gm: torch.fx.GraphModule):
    """``gm``'s outputs followed by, for every sin/cos, Σ(|arg| ≥ TRIG_BOUND) over all but dim 0
    (a per-row output; a 0-d argument gives a 0-d count)."""

    class Counting(torch.fx.Interpreter):
        def call_function(self, target, a, kw):
            if target in _TRIG:
                x = a[0]
                big = (x.abs() >= TRIG_BOUND).to(torch.float32)
                self.counts.append(big.sum(dim=tuple(range(1, x.dim()))) if x.dim() > 1 else big)
            return super().call_function(target, a, kw)

    def fn(*xs):
        it = Counting(gm)
        it.counts = []
        out = it.run(*xs)
        out = tuple(out) if isinstance(out, (tuple, list)) else (out,)
        fn.n_counts = len(it.counts)
        return out + tuple(it.counts)

    fn.n_counts = sum(1 for n in gm.graph.nodes if n.op == "call_function" and n.target in _TRIG)
    return fn


def _roles(inputs, rows: set[int]) -> list[ArgSpec]:
    return [ArgSpec(ROW, tuple(t.shape[1:]), t.dtype) if i in rows else ArgSpec(BCAST, tuple(t.shape), t.dtype)
            for i, t in enumerate(inputs)]


def _row_args(fn, inputs) -> tuple[list[ArgSpec], int]:
    """Each input's role, checked by ``_check_row_contract``, and the input whose dim 0 is the row dim.

    A dim 0 of the row count alone does not make a row input: broadcasting aligns dims from the
    right, so in ``x[n, n] + b[n]`` b's dim 0 meets x's *last* dim and b is a broadcast input.
    (Taking every such input per row was issue 35's bug: the region's row-contract check split b
    with the rows and the region ran eagerly; at n = the chunk rows the kernel had traced, right by
    coincidence.) An input of the reference's rank or more with dim 0 = n is a row input; one of
    lower rank may be either (``x.sum(-1) * w[n]``: w is one value per row), so labelings are tried
    in turn — lower-rank candidates as rows, all as broadcast inputs, then each alone as broadcast —
    first with the first input as the reference, then with the input of the highest rank (largest
    dim 0 among those); the first labeling that keeps the row contract is taken. If none does, the
    first one's error is raised."""
    refs = [0] if inputs[0].dim() >= 1 else []
    top = max(range(len(inputs)), key=lambda i: (inputs[i].dim(), inputs[i].shape[0] if inputs[i].dim() else 0, -i))
    refs += [top] if top not in refs else []
    from torch._subclasses.fake_tensor import unset_fake_temporarily

    with torch.no_grad(), unset_fake_temporarily():
        full = fn(*inputs)  # once: the examples can be large (a region's own sizes)
    first_error = None
    for ref in refs:
        n, rank = inputs[ref].shape[0], inputs[ref].dim()
        cands = [i for i, t in enumerate(inputs) if t.dim() >= 1 and t.shape[0] == n]
        fixed = {i for i in cands if inputs[i].dim() >= rank}
        loose = [i for i in cands if i not in fixed]
        tries = [set(loose)] + ([set()] if loose else []) + [set(loose) - {i} for i in loose if len(loose) > 1]
        for extra in tries[:8]:
            args = _roles(inputs, fixed | extra)
            try:
                _check_row_contract(fn, inputs, args, n, full)
                return args, ref
            except (NotImplementedError, RuntimeError) as e:  # RuntimeError: the halves do not broadcast
                first_error = first_error or e
    raise first_error


def _check_row_contract(fn, inputs, args, n: int, full=None) -> None:
    """The kernel runs the graph chunk by chunk of rows: each output must be per-row (the chunks'
    outputs stacked) or a sum over rows (the chunks' outputs added). Check that on the example
    inputs, split in two, so that any other output raises here instead of coming out wrong."""
    from torch._subclasses.fake_tensor import unset_fake_temporarily

    # Under torch.compile a fake-tensor mode is active; this check runs on the real examples.
    with torch.no_grad(), unset_fake_temporarily():
        full = fn(*inputs) if full is None else full
        if n < 2:
            if any(o.dim() == 0 or o.shape[0] != n for o in full):
                raise NotImplementedError("compile_graph: an output is neither per-row nor a sum over rows that one example "
                                          "row can show (it needs at least 2 example rows to check); keep this region in ATen")
            return
        halves = [fn(*[t[rows] if a.role == ROW else t for t, a in zip(inputs, args)]) for rows in (slice(0, n // 2), slice(n // 2, n))]
        for i, (out, a, b) in enumerate(zip(full, *halves)):
            ref, a, b = out.double(), a.double(), b.double()
            tol = 1e-3 * (ref.abs().max().item() + 1.0)
            stacked = out.dim() >= 1 and torch.cat([a, b]).shape == out.shape
            if stacked and (torch.cat([a, b]) - ref).abs().max().item() <= tol:
                continue
            # A sum over rows: the halves add up to the whole. Not when both halves already equal
            # it (zeros, or a value that does not depend on the rows at all): chunk by chunk it
            # would be added up once per chunk.
            same = torch.equal(a, ref) and torch.equal(b, ref)
            if a.shape == out.shape and not same and (a + b - ref).abs().max().item() <= tol:
                continue
            raise NotImplementedError(
                f"compile_graph: output {i} (shape {tuple(out.shape)}) is neither per-row nor a sum over rows; "
                "keep this region in ATen"
            )
