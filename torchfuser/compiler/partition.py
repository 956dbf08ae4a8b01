"""Stage 4 (CPU): split an ATen graph into maximal regions of pointwise ops and reductions
and compile each region with the MLIR backend. Matrix products, convolutions, attention,
the ``torchfuser::`` ops and anything else not listed here stay ATen calls between regions.

A region the MLIR backend cannot take (``compile_graph`` missing or raising) runs eagerly,
with a note in the compile record and the log: slower, never wrong.
"""
from __future__ import annotations

import logging

import torch
from torch import nn
from torch.fx import GraphModule, Node
from torch.fx.passes.infra.partitioner import CapabilityBasedPartitioner
from torch.fx.passes.operator_support import OperatorSupport

from torchfuser.compiler.record import CompileRecord, Region

aten = torch.ops.aten

REDUCTIONS = {aten.sum, aten.mean, aten.amax, aten.amin, aten.prod, aten.var, aten.var_mean, aten.argmax,
              aten.argmin, aten.any, aten.all, aten.max, aten.min}
# Layout ops stay ATen calls between regions (free in eager): a region is elementwise work and
# reductions over trailing dims only, which is the shape of kernel the MLIR backend builds (rows ×
# features); a view that reshapes the row dim inside a region would break that.
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
    if p in VIEWS:
        return False
    if torch.Tag.pointwise in node.target.tags or p in REDUCTIONS or p in OTHER:
        # nothing random, nothing mutating: a region is a pure function of its inputs
        return not node.target._schema.is_mutable and torch.Tag.nondeterministic_seeded not in node.target.tags
    return False


class _Support(OperatorSupport):
    def is_node_supported(self, submodules, node: Node) -> bool:
        return fusible(node)


class _Compiled(nn.Module):
    """A region after compilation: the callable the MLIR backend returned (it always returns a
    tuple; the parent graph expects a bare tensor from a one-output region). Its outputs are dense;
    where the trace had another layout (a pointwise op keeps its input's, e.g. a transposed q), the
    output is laid out as traced, because the graph's later views may only be valid for that one."""

    def __init__(self, fn, single: bool, strides=None):
        super().__init__()
        self.fn = fn
        self.single = single
        self.strides = strides or ()

    def forward(self, *args):
        out = tuple(self.fn(*args))
        if self.strides:
            out = tuple(_laid_out(o, s) for o, s in zip(out, self.strides))
        return out[0] if self.single else out


def _laid_out(t, stride):
    if stride is None or not isinstance(t, torch.Tensor) or t.stride() == stride:
        return t
    return torch.empty_strided(t.shape, stride, dtype=t.dtype, device=t.device).copy_(t)


def _traced_strides(sub: GraphModule):
    """Each output's strides in the trace (None where unknown or symbolic)."""
    (out,) = [n for n in sub.graph.nodes if n.op == "output"]
    nodes = out.args[0] if isinstance(out.args[0], (tuple, list)) else (out.args[0],)
    strides = []
    for n in nodes:
        val = n.meta.get("val") if isinstance(n, Node) else None
        stride = tuple(val.stride()) if isinstance(val, torch.Tensor) else None
        strides.append(stride if stride is not None and all(isinstance(x, int) for x in stride) else None)
    return tuple(strides)


def _single_output(sub: GraphModule) -> bool:
    (out,) = [n for n in sub.graph.nodes if n.op == "output"]
    return not isinstance(out.args[0], (tuple, list))


def _real_examples(node: Node):
    """Real tensors shaped like the region's inputs (the MLIR backend compiles from real
    tensors, at the size hints when shapes are symbolic); None if an input is not a tensor."""
    from torch._subclasses.fake_tensor import unset_fake_temporarily
    from torchfuser.compiler._compat import size_hint

    out = []
    gen = torch.Generator().manual_seed(0)  # its own: compiling must not move the caller's generator
    with unset_fake_temporarily():
        for a in node.args:
            v = a.meta.get("val") if isinstance(a, Node) else a
            if not isinstance(v, torch.Tensor):
                return None
            shape = [int(size_hint(s)) for s in v.shape]
            if v.is_floating_point():
                t = torch.randn(shape, generator=gen).to(v.dtype)
            else:  # never all zeros: zeros hide a wrong row contract or a wrong cast (positions → float)
                t = torch.randint(1, 8, shape, generator=gen).to(v.dtype)
            out.append(t)
    return out


def _compile_graph():
    """``torchfuser.backends.mlir.compile_graph`` if the MLIR backend can run here, else None."""
    from torchfuser.backends import unavailable_reason

    if unavailable_reason("mlir", "cpu") is not None:
        return None
    try:
        import torchfuser.backends.mlir as mlir

        return getattr(mlir, "compile_graph", None)
    except Exception:  # torch-mlir missing, or the backend mid-change: eager regions, said in the record
        return None


def _check_against_eager(sub: GraphModule, compiled, examples, single: bool) -> str | None:
    from torch._subclasses.fake_tensor import unset_fake_temporarily

    with torch.no_grad(), unset_fake_temporarily():
        return _compare(sub, compiled, examples, single)


def _compare(sub: GraphModule, compiled, examples, single: bool) -> str | None:
    """Run the compiled region and the ATen region on the same random inputs once; a mismatch
    (a miscompile, or a region outside what the backend supports but did not reject) sends the
    region back to eager. Tolerances allow for reassociated sums and fast math."""
    want = sub(*examples)
    got = _Compiled(compiled, single)(*examples)
    want = want if isinstance(want, (tuple, list)) else (want,)
    got = got if isinstance(got, (tuple, list)) else (got,)
    if len(got) != len(want):
        return f"returned {len(got)} outputs, expected {len(want)}"
    for i, (g, w) in enumerate(zip(got, want)):
        if not isinstance(w, torch.Tensor):
            continue
        if g.shape != w.shape or g.dtype != w.dtype:
            return f"output {i}: {tuple(g.shape)} {g.dtype}, expected {tuple(w.shape)} {w.dtype}"
        if w.is_floating_point():
            finite = torch.nan_to_num(w.float(), nan=0.0, posinf=0.0, neginf=0.0)
            scale = max(finite.abs().max().item(), 1.0) if w.numel() else 1.0
            tol = 1e-3 if w.dtype == torch.float32 else 3e-2
            if not torch.allclose(g.float(), w.float(), rtol=tol, atol=tol * scale, equal_nan=True):
                return f"output {i} differs from eager by {(g.float() - w.float()).abs().max().item():.3g}"
        elif not torch.equal(g, w):
            return f"output {i} differs from eager"
    return None


def _connected(nodes) -> list[list[Node]]:
    """``nodes`` (one proposed partition) split into the parts that share no value, neither one
    computed inside nor an input read from outside. The partitioner also groups computations that
    are independent of each other; one kernel runs all of a region's outputs over one row dim, and
    two independent parts need not have one: in the backward of ``silu(x) * y + sin(b)`` with x of
    n × m and b of m, ``b``'s gradient (m values, from the summed output gradient) and ``x``'s
    (n × m) shared a region, which the MLIR backend had to refuse. Parts that read one input stay
    one region (the input is read once). No path leaves a partition and comes back into it, so the
    parts fuse without cycles."""
    members = list(nodes)
    parent: dict[Node, Node] = {}

    def root(n):
        parent.setdefault(n, n)
        while parent[n] is not n:
            parent[n] = parent[parent[n]]
            n = parent[n]
        return n

    for n in members:
        for a in n.all_input_nodes:  # inside or outside: either way the two share a value
            parent[root(a)] = root(n)
    parts: dict[Node, list[Node]] = {}
    for n in members:
        parts.setdefault(root(n), []).append(n)
    return list(parts.values())


def compile_regions(gm: GraphModule, record: CompileRecord, which: str, dynamic: bool) -> GraphModule:
    proposed = CapabilityBasedPartitioner(gm, _Support(), allows_single_node_partition=True).propose_partitions()
    parts = [dict.fromkeys(part) for p in proposed for part in _connected(p.nodes)]
    # a part that reads nothing from outside (a constant built by aten.full for ops elsewhere) has
    # no rows to loop over: it stays an ATen call
    partitions = [part for part in parts if any(a not in part for n in part for a in n.all_input_nodes)]
    if not partitions:
        return gm
    from torch.fx.passes.utils.fuser_utils import fuse_by_partitions

    fused = fuse_by_partitions(gm, partitions, prefix=f"{which}_region_")
    compile_graph = _compile_graph()
    if compile_graph is None:
        from torchfuser.backends import unavailable_reason

        why = unavailable_reason("mlir", "cpu") or "torchfuser.backends.mlir.compile_graph is not available"
        record.note(f"{which}: {why}; {len(partitions)} region(s) run eagerly (ATen op by op)")
    for node in list(fused.graph.nodes):
        if node.op != "call_module" or not node.target.startswith(f"{which}_region_"):
            continue
        sub: GraphModule = getattr(fused, node.target)
        ops = [str(n.target).replace("aten.", "") for n in sub.graph.nodes if n.op == "call_function"]
        region = Region(node.target, which, ops, "eager (MLIR backend unavailable)", fx=sub.code)
        record.regions.append(region)
        if compile_graph is None:
            continue
        examples = _real_examples(node)
        if examples is None:
            region.compiled_by = "eager (a region input is not a tensor: a symbolic size)"
            record.note(f"{which}/{node.target}: {region.compiled_by}")
            continue
        try:
            compiled = compile_graph(sub, examples, dynamic=bool(dynamic))
        except Exception as e:  # an op the MLIR pipeline does not lower: this region runs eagerly
            region.compiled_by = f"eager ({type(e).__name__}: {str(e).splitlines()[0][:160] if str(e) else ''})"
            record.note(f"{which}/{node.target}: MLIR compile failed, region runs eagerly: {region.compiled_by}")
            continue
        why = _check_against_eager(sub, compiled, examples, _single_output(sub))
        if why is not None:
            region.compiled_by = f"eager (MLIR result rejected: {why})"
            record.note(f"{which}/{node.target}: {region.compiled_by}", logging.WARNING)
            continue
        region.compiled_by = "mlir"
        region.stage_ir = getattr(compiled, "stage_ir", None)
        setattr(fused, node.target, _Compiled(compiled, _single_output(sub), _traced_strides(sub)))
    fused.recompile()
    return fused
