"""Stage 2: replace subgraphs that compute a known op by the ``torchfuser::`` custom op.

Each rule (``compiler/rules``) proposes matches by structure: an anchor node (a mean over
the last dim of a square, a silu times a tensor of the same shape, a rotate-half ``cat``, ...)
and the chain of ops around it, looking through dtype casts and commutative operand order.
A proposal is then *checked numerically*: its subgraph is cut out, run on random float64
probes, and compared with the op's reference formula. Only a match that agrees is rewritten,
so a structural false positive costs a skipped rewrite, never a wrong result.

The rewrite runs before autodiff, so the backward of a rewritten op is the op's own
``_bwd`` kernel rather than whatever autograd would derive from the user's formulation.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable

import torch
from torch.fx import Graph, GraphModule, Node
from torch._subclasses.fake_tensor import unset_fake_temporarily
from torchfuser.compiler._compat import size_hint

from torchfuser import backends
from torchfuser.compiler.record import CompileRecord

# probes larger than this (elements over all inputs) are not run: the match is skipped
PROBE_LIMIT = 1 << 23


@dataclass
class Match:
    op: str                                  # kernel family: rms_norm, layer_norm, swiglu, ...
    output: Node                             # its uses are redirected to the fused result
    inputs: dict[str, Node]                  # the tensor inputs, in the reference's order
    consts: dict = field(default_factory=dict)
    # reference(*probe inputs) → the expected float64 output, from the op's definition
    reference: Callable = None
    # build(graph, inputs, backend) → the node that replaces ``output`` (inserted before it)
    build: Callable = None
    extra_outputs: tuple = ()                # further (node, index) pairs the build also replaces
    int_high: Callable = None                # probe shapes → upper bound for integer probes
    note: str = ""

    def describe(self) -> str:
        ins = ", ".join(f"{k}={v.name}" for k, v in self.inputs.items())
        consts = "".join(f", {k}={v}" for k, v in self.consts.items())
        return f"{self.op}({ins}{consts}) → {self.output.name}{' ' + self.note if self.note else ''}"


def kernel_backend(op: str, device: torch.device, policy, kernels: str) -> tuple[str | None, str]:
    """The backend whose ``<op>_fwd`` the rewritten node will call, or None with the reason."""
    try:
        name = backends.resolve(kernels, device)
    except backends.BackendUnavailable as e:
        return None, str(e)
    if name != "reference":
        try:
            has = hasattr(backends.kernels(name), f"{op}_fwd")
        except Exception:  # the backend package fails to import: its kernels are not there
            has = False
        name = name if has else "reference"
    if name == "reference" and policy == "auto" and device.type != "meta":
        return None, f"no compiled {op} kernel for {device.type} yet (reference only; rewrite=True forces it)"
    return name, ""


def _subgraph(m: Match) -> list[Node] | None:
    """The nodes between ``m.inputs`` and ``m.output`` in graph order; None if it reads anything else."""
    stop = set(m.inputs.values())
    seen, todo = set(), [m.output]
    for node, _ in m.extra_outputs:
        todo.append(node)
    while todo:
        n = todo.pop()
        if n in seen or n in stop:
            continue
        if n.op == "placeholder":
            return None
        seen.add(n)
        todo += n.all_input_nodes
    return [n for n in m.output.graph.nodes if n in seen]


def _extract(gm: GraphModule, m: Match, nodes: list[Node]) -> GraphModule:
    g = Graph()
    env = {m.inputs[k]: g.placeholder(k) for k in m.inputs}
    for n in nodes:
        env[n] = g.node_copy(n, lambda a: env[a])
    outs = [env[m.output]] + [env[n] for n, _ in m.extra_outputs]
    g.output(tuple(outs))
    return GraphModule(gm, g)


def _probe_shapes(m: Match, shrink: str) -> list[tuple[int, ...]]:
    """Probe shapes: ``"position"`` keeps the last dim of each float input and maps every other
    dim to a small size (the same size to the same small one); ``"value"`` also keeps any dim
    equal to a kept feature size (for subgraphs whose views bake the sizes in); ``"none"`` keeps
    the real shapes."""
    vals = [n.meta["val"] for n in m.inputs.values()]
    shapes = [tuple(int(size_hint(s)) for s in v.shape) for v in vals]
    if shrink == "none":
        return shapes
    features = {s[-1] for s, v in zip(shapes, vals) if s and v.is_floating_point()}
    small, nxt = {1: 1}, 2

    def smaller(d: int) -> int:
        nonlocal nxt
        if d not in small:
            small[d], nxt = nxt, nxt + 1
        return small[d]

    out = []
    for s, v in zip(shapes, vals):
        last = len(s) - 1 if v.is_floating_point() else -1
        keep = lambda i, d: i == last or (shrink == "value" and d in features)
        out.append(tuple(d if keep(i, d) else smaller(d) for i, d in enumerate(s)))
    return out


def _probe(m: Match, shapes) -> list[torch.Tensor]:
    vals = [n.meta["val"] for n in m.inputs.values()]
    high = m.int_high(shapes) if m.int_high else 2
    gen = torch.Generator().manual_seed(0)
    out = []
    for v, s in zip(vals, shapes):
        if v.is_floating_point():
            out.append(torch.randn(s, generator=gen, dtype=torch.float64))
        else:
            out.append(torch.randint(0, high, s, generator=gen, dtype=v.dtype))
    return out


def verify(gm: GraphModule, m: Match) -> str | None:
    """None when the matched subgraph computes the op on random float64 probes; else why not."""
    if any(n.meta.get("val") is None for n in m.inputs.values()):
        return "inputs without shape information"
    nodes = _subgraph(m)
    if nodes is None:
        return "the subgraph reads tensors other than the op's inputs"
    sub = _extract(gm, m, nodes)
    last = "not probed"
    with unset_fake_temporarily(), torch.no_grad():
        for shrink in ("position", "value", "none"):
            shapes = _probe_shapes(m, shrink)
            if sum(torch.Size(s).numel() for s in shapes) > PROBE_LIMIT:
                last = "probe too large to check numerically"
                continue
            probes = _probe(m, shapes)
            try:
                got = sub(*probes)
                want = m.reference(*probes)
            except Exception as e:  # baked shapes that need the real sizes, unsupported probes
                last = f"probe failed: {type(e).__name__}: {e}"[:200]
                continue
            want = want if isinstance(want, tuple) else (want,)
            for g_, w_ in zip(got, want):
                g_, w_ = g_.double(), w_.double()
                scale = w_.abs().max().item() if w_.numel() else 0.0
                if g_.shape != w_.shape or not torch.allclose(g_, w_, rtol=1e-4, atol=1e-4 * max(scale, 1.0)):
                    return "numeric check failed: the subgraph does not compute the op"
            return None
    return last


def apply(m: Match, backend: str) -> dict[Node, Node]:
    """Insert the fused op and redirect the uses of the replaced outputs; returns old → new."""
    graph = m.output.graph
    with graph.inserting_before(m.output):
        new = m.build(graph, m.inputs, backend)
    new = new if isinstance(new, tuple) else (new,)
    olds = [m.output] + [node for node, _ in m.extra_outputs]
    for old, repl in zip(olds, new):
        old.replace_all_uses_with(repl)
        # later matches read shapes and dtypes from "val": the replacement has the old one's
        repl.meta.setdefault("val", old.meta.get("val"))
    return dict(zip(olds, new))


def device_of(m: Match) -> torch.device:
    v = m.output.meta.get("val")
    return v.device if isinstance(v, torch.Tensor) else torch.device("cpu")


# Ops that are pure pointwise math: the MLIR region compiler fuses them with their neighbours.
POINTWISE_OPS = {"swiglu", "geglu"}
# Under Inductor these stay Inductor's with rewrite="auto": as opaque custom ops they stop its
# fusion (casts, residual adds) and each costs a dispatcher call from its wrapper; whole training
# steps on an H200 ran 2–17% slower with them rewritten (docs/performance/NOTES-compiler.md).
# What a rewrite still brings there is linear_cross_entropy: the logits never exist.
INDUCTOR_FUSES = {"rms_norm", "layer_norm", "swiglu", "geglu", "rope"}


def in_pointwise_region(m: Match) -> bool:
    """Whether the match reads or feeds other pointwise ops, i.e. would sit inside a larger region.

    On the CPU the fused kernel is then a kernel boundary in the middle of what the region compiler
    builds as one loop: silu(x)·y + 0.5·sin(b) ran slower rewritten than left to the region
    (docs/performance/NOTES-compiler.md). A SwiGLU between matmuls (an MLP) keeps it."""
    from torchfuser.compiler.partition import fusible

    outs = [m.output, *(n for n, _ in m.extra_outputs)]
    if any(fusible(u) for o in outs for u in o.users):
        return True
    return any(fusible(n) for n in m.inputs.values())


def run(gm: GraphModule, record: CompileRecord, policy, kernels: str, graph_backend: str | None = None) -> GraphModule:
    """Apply every rule in order; each rule sees the graph the previous ones left.

    ``graph_backend="mlir"`` with ``policy="auto"``: pointwise ops (SwiGLU, GeGLU) that are part
    of a larger pointwise region are left to the region compiler."""
    if policy is False:
        record.note("rewrite disabled (rewrite=False)")
        return gm
    from torchfuser.compiler.rules import RULES

    for rule in RULES:
        claimed: set[Node] = set()
        replaced: dict[Node, Node] = {}
        # propose first, then apply: applying changes the users the rule walks
        for m in list(rule(gm.graph)):
            # a match may read the output of one just rewritten (two norms in a row)
            m.inputs = {k: replaced.get(v, v) for k, v in m.inputs.items()}
            outs = {m.output, *(n for n, _ in m.extra_outputs)}
            if outs & claimed:
                continue
            backend, why = kernel_backend(m.op, device_of(m), policy, kernels)
            if backend is None:
                record.skip(f"{m.describe()}: {why}")
                continue
            if policy == "auto" and graph_backend == "mlir" and m.op in POINTWISE_OPS and in_pointwise_region(m):
                record.skip(f"{m.describe()}: part of a larger pointwise region, left to the MLIR region compiler")
                continue
            if policy == "auto" and graph_backend == "inductor" and m.op in INDUCTOR_FUSES:
                record.skip(f"{m.describe()}: left to Inductor, which fuses it with its neighbours (rewrite=True forces it)")
                continue
            why = verify(gm, m)
            if why is not None:
                record.skip(f"{m.describe()}: {why}")
                continue
            replaced.update(apply(m, backend))
            claimed |= outs
            record.rewrote(f"{m.describe()} [kernel backend {backend}]")
        gm.graph.eliminate_dead_code()
    gm.graph.lint()
    gm.recompile()
    return gm
