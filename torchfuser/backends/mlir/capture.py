"""Stage 1, capture: a reference function → ATen FX graphs at static row-chunk shapes.

A kernel is a *row program*: every "row" input and output has a leading dim that indexes
independent rows (tokens); "broadcast" inputs (weights) are shared by all rows; "sum"
outputs (weight gradients, summed losses) are sums over rows. The graph is traced twice,
at ``R`` rows (the vector/cache-sized chunk) and at 1 row (the tail), with static shapes,
so that nothing inside a compiled body is dynamic; the wrapper stage loops over chunks of
any row count. Graphs are *derived* by tracing (make_fx, with torch.func.vjp for the
backward), never written by hand.

Sum outputs are kept in fp32: a trailing cast to a lower precision is cut off here and
applied by the runner after the per-thread partial sums are added, so that bf16 weights do
not get their gradient rounded once per chunk.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable, Sequence

import torch
from torch.fx.experimental.proxy_tensor import make_fx

from torchfuser.backends._saved_hooks import hooks_set_aside

ROW, BCAST = "row", "bcast"
_CASTS = {torch.ops.prims.convert_element_type.default, torch.ops.aten._to_copy.default}


@dataclass(frozen=True)
class ArgSpec:
    """One tensor input: its role, the shape of one row (row inputs) or the whole shape, dtype."""

    role: str
    shape: tuple[int, ...]
    dtype: torch.dtype


@dataclass
class Captured:
    name: str
    args: tuple[ArgSpec, ...]
    rows: int                                  # R, rows per chunk of the main body
    graphs: dict[int, torch.fx.GraphModule]    # rows → graph (R and 1)
    out_roles: tuple[str, ...] = ()            # ROW or "sum" per output
    out_shapes: tuple[tuple[int, ...], ...] = ()  # per-row shape (row) or full shape (sum)
    out_dtypes: tuple[torch.dtype, ...] = ()   # dtype of the graph output (fp32 for sums)
    final_dtypes: tuple[torch.dtype, ...] = ()  # dtype the caller gets
    meta: dict = field(default_factory=dict)

    def print_graphs(self) -> str:
        return "\n".join(f"# {self.name} @ {r} rows\n{g.code}" for r, g in self.graphs.items())


_DECOMPS = None


def decompositions():
    """torch-mlir's table plus a few of PyTorch's own (see also ``_static_factories``)."""
    global _DECOMPS
    if _DECOMPS is None:
        from torch._decomp import get_decompositions
        from torch_mlir.extras.fx_decomp_util import get_decomposition_table

        aten = torch.ops.aten
        _DECOMPS = dict(get_decomposition_table())
        _DECOMPS.update(get_decompositions([aten.zeros_like, aten.ones_like]))
        # torch-mlir's own gelu(tanh) lowering rounds sqrt(2/pi) to 0.797724 (5e-5 off):
        # keep PyTorch's decomposition, which is the reference's math.
        _DECOMPS.update(get_decompositions([aten.gelu, aten.gelu_backward]))
    return _DECOMPS


def example(spec: ArgSpec, rows: int) -> torch.Tensor:
    shape = (rows, *spec.shape) if spec.role == ROW else spec.shape
    if spec.dtype.is_floating_point:
        # A generator of its own: a kernel compiled at a model's first call must not move the global one
        # (a dropout mask drawn after it would change).
        gen = torch.Generator().manual_seed(0)
        return torch.randn(shape, dtype=torch.float32, generator=gen).to(spec.dtype)
    return torch.zeros(shape, dtype=spec.dtype)


def trace(fn: Callable, examples: Sequence[torch.Tensor]) -> torch.fx.GraphModule:
    # functionalize: decompositions of some backward ops write in place (copy_), which the
    # torch-mlir importer only takes in value semantics.
    pure = torch.func.functionalize(fn, remove="mutations")
    with hooks_set_aside():
        gm = make_fx(pure, decomposition_table=decompositions(), tracing_mode="real")(*examples)
    _static_factories(gm)
    return gm


def _static_factories(gm: torch.fx.GraphModule) -> None:
    """``full_like(t, v)`` → ``full(shape, v)``: shapes are static here, and torch-mlir cannot
    lower the memory-format argument of ``empty_like``/``empty_permuted`` (silu's backward)."""
    for node in list(gm.graph.nodes):
        if node.target in (torch.ops.aten.slice.Tensor, torch.ops.aten.slice_copy.Tensor) and len(node.args) > 3:
            # t[..., a:] traces with end = INT64_MAX, which torch-mlir leaves unlowered.
            src, dim = node.args[0], node.args[1]
            size = src.meta["val"].shape[dim]
            if node.args[3] > size:
                node.args = (*node.args[:3], size, *node.args[4:])
        if node.target is torch.ops.aten.full_like.default:
            val = node.meta["val"]
            with gm.graph.inserting_before(node):
                full = gm.graph.call_function(
                    torch.ops.aten.full.default, (list(val.shape), node.args[1]),
                    {"dtype": val.dtype, "device": torch.device("cpu"), "pin_memory": False},
                )
            full.meta["val"] = val
            node.replace_all_uses_with(full)
            gm.graph.erase_node(node)
    gm.graph.eliminate_dead_code()
    gm.recompile()


def _outputs(gm: torch.fx.GraphModule):
    out = next(n for n in gm.graph.nodes if n.op == "output")
    vals = out.args[0]
    return out, list(vals) if isinstance(vals, (tuple, list)) else [vals]


def _strip_sum_casts(gm: torch.fx.GraphModule, sums: Sequence[int]) -> None:
    """Outputs ``sums`` become their fp32 value before the final down-cast."""
    out, vals = _outputs(gm)
    for i in sums:
        node = vals[i]
        while node.target in _CASTS and node.args[0].meta["val"].dtype == torch.float32:
            node = node.args[0]
        vals[i] = node
    out.args = (tuple(vals),)
    gm.graph.eliminate_dead_code()
    gm.recompile()


def capture(name: str, fn: Callable, args: Sequence[ArgSpec], rows: int) -> Captured:
    """Trace ``fn`` at ``rows`` and at 1 row; classify outputs as row or sum outputs."""
    graphs, shapes = {}, {}
    for r in dict.fromkeys((rows, 1)):
        gm = trace(fn, [example(a, r) for a in args])
        graphs[r] = gm
        shapes[r] = [tuple(v.meta["val"].shape) for v in _outputs(gm)[1]]
    big, one = shapes[rows], shapes[1]
    roles = []
    for sb, s1 in zip(big, one):
        if rows != 1 and sb == s1:
            roles.append("sum")
        elif len(sb) >= 1 and sb[0] == rows and s1[0] == 1 and sb[1:] == s1[1:]:
            roles.append(ROW)
        elif rows == 1 and len(sb) >= 1 and sb[0] == 1:
            roles.append(ROW)
        else:
            raise NotImplementedError(f"{name}: output shapes {sb} / {s1} are neither per-row nor a sum over rows")
    final = tuple(v.meta["val"].dtype for v in _outputs(graphs[rows])[1])
    sums = [i for i, r in enumerate(roles) if r == "sum"]
    for gm in graphs.values():
        _strip_sum_casts(gm, sums)
    vals = _outputs(graphs[rows])[1]
    return Captured(
        name=name,
        args=tuple(args),
        rows=rows,
        graphs=graphs,
        out_roles=tuple(roles),
        out_shapes=tuple(tuple(v.meta["val"].shape[1:]) if r == ROW else tuple(v.meta["val"].shape) for v, r in zip(vals, roles)),
        out_dtypes=tuple(v.meta["val"].dtype for v in vals),
        final_dtypes=final,
    )
