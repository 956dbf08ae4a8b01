"""Stage 4 (CPU): split an ATen graph into maximal regions of pointwise ops and reductions
and compile each region with the MLIR backend. Matrix products, convolutions, attention,
the ``torchfuser::`` ops and anything else not listed here stay ATen calls between regions.

A region the MLIR backend cannot take (``compile_graph`` missing or raising) runs eagerly,
with a note in the compile record and the log: slower, never wrong.
"""
from __future__ import annotations

import torch
from torch import nn
from torch.fx import GraphModule, Node
from torch.fx.passes.infra.partitioner import CapabilityBasedPartitioner
from torch.fx.passes.operator_support import OperatorSupport

from torchfuser.compiler.record import CompileRecord, Region

aten = torch.ops.aten

REDUCTIONS = {aten.sum, aten.mean, aten.amax, aten.amin, aten.prod, aten.var, aten.var_mean, aten.argmax,
              aten.argmin, aten.any, aten.all, aten.max, aten.min}
# layout ops that are free inside a region but not worth a region of their own
VIEWS = {aten.view, aten._unsafe_view, aten.reshape, aten.expand, aten.permute, aten.squeeze, aten.unsqueeze,
         aten.t, aten.transpose, aten.alias, aten.slice, aten.select}
OTHER = {aten.full, aten.scalar_tensor, aten._to_copy, aten.clone, aten.where, aten.full_like,
         aten.zeros_like, aten.ones_like}


def fusible(node: Node) -> bool:
    if node.op != "call_function" or not isinstance(node.target, torch._ops.OpOverload):
        return False
    if node.target.namespace != "aten":
        return False
    p = node.target.overloadpacket
    if torch.Tag.pointwise in node.target.tags or p in REDUCTIONS or p in VIEWS or p in OTHER:
        # nothing random, nothing mutating: a region is a pure function of its inputs
        return not node.target._schema.is_mutable and torch.Tag.nondeterministic_seeded not in node.target.tags
    return False


class _Support(OperatorSupport):
    def is_node_supported(self, submodules, node: Node) -> bool:
        return fusible(node)


class _Compiled(nn.Module):
    """A region after compilation: the callable the MLIR backend returned."""

    def __init__(self, fn):
        super().__init__()
        self.fn = fn

    def forward(self, *args):
        return self.fn(*args)


def _view_names() -> list[str]:
    return [str(op) for p in VIEWS for op in (getattr(p, o) for o in p.overloads())]


def _compile_graph():
    """``torchfuser.backends.mlir.compile_graph`` if the MLIR backend provides it yet, else None."""
    try:
        import torchfuser.backends.mlir as mlir

        return getattr(mlir, "compile_graph", None)
    except Exception:  # torch-mlir missing, or the backend mid-change: eager regions, said in the record
        return None


def compile_regions(gm: GraphModule, record: CompileRecord, which: str, dynamic: bool) -> GraphModule:
    partitions = CapabilityBasedPartitioner(
        gm, _Support(), allows_single_node_partition=True, non_compute_ops=_view_names()
    ).propose_partitions()
    if not partitions:
        return gm
    from torch.fx.passes.utils.fuser_utils import fuse_by_partitions

    fused = fuse_by_partitions(gm, [list(p.nodes) for p in partitions], prefix=f"{which}_region_")
    compile_graph = _compile_graph()
    if compile_graph is None:
        record.note(f"{which}: torchfuser.backends.mlir.compile_graph is not available yet; "
                    f"{len(partitions)} region(s) run eagerly (ATen op by op)")
    for node in list(fused.graph.nodes):
        if node.op != "call_module" or not node.target.startswith(f"{which}_region_"):
            continue
        sub: GraphModule = getattr(fused, node.target)
        ops = [str(n.target).replace("aten.", "") for n in sub.graph.nodes if n.op == "call_function"]
        region = Region(node.target, which, ops, "eager (MLIR backend unavailable)", fx=sub.code)
        record.regions.append(region)
        if compile_graph is None:
            continue
        examples = [a.meta.get("val") if isinstance(a, Node) else a for a in node.args]
        try:
            compiled = compile_graph(sub, examples, dynamic=bool(dynamic))
        except Exception as e:  # an op the MLIR pipeline does not lower: this region runs eagerly
            region.compiled_by = f"eager ({type(e).__name__}: {str(e).splitlines()[0][:160] if str(e) else ''})"
            record.note(f"{which}/{node.target}: MLIR compile failed, region runs eagerly: {region.compiled_by}")
            continue
        region.compiled_by = "mlir"
        region.stages = dict(getattr(compiled, "stages", None) or getattr(compiled, "ir", None) or {})
        setattr(fused, node.target, _Compiled(compiled))
    fused.recompile()
    return fused
