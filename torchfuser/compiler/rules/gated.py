"""SwiGLU = silu(gate) · up and GeGLU = gelu_tanh(gate) · up, with silu written as
``silu`` or ``gate · sigmoid(gate)``, when gate and up have one shape and dtype (no broadcast)."""
from __future__ import annotations

import torch
from torch.fx import Node

from torchfuser.backends.reference.gated import geglu as ref_geglu, swiglu as ref_swiglu
from torchfuser.compiler.rewrite import Match
from torchfuser.compiler.rules._util import aten, call, is_op, other, strip, val

tf = torch.ops.torchfuser


def _activations(graph):
    """(activation node, gate, kind) for every silu / gelu-tanh in the graph."""
    for n in graph.nodes:
        if is_op(n, aten.silu):
            yield n, n.args[0], "swiglu"
        elif is_op(n, aten.gelu) and (n.kwargs.get("approximate") or (n.args[1] if len(n.args) > 1 else "none")) == "tanh":
            yield n, n.args[0], "geglu"
        elif is_op(n, aten.mul):
            for s, g in ((n.args[1], n.args[0]), (n.args[0], n.args[1])):
                if is_op(s, aten.sigmoid) and isinstance(g, Node) and strip(s.args[0]) is strip(g):
                    yield n, g, "swiglu"
                    break


def gated(graph):
    for act, gate, kind in list(_activations(graph)):
        gv = val(gate)
        if gv is None or not gv.is_floating_point():
            continue
        for out in list(act.users):
            up = other(out, act) if is_op(out, aten.mul) else None
            uv = val(up)
            if uv is None or uv.shape != gv.shape or uv.dtype != gv.dtype or up is gate:
                continue
            op, ref = (tf.swiglu_fwd, ref_swiglu) if kind == "swiglu" else (tf.geglu_fwd, ref_geglu)
            dtype = val(out).dtype if val(out) is not None else gv.dtype

            def build(g, ins, backend, op=op, dtype=dtype):
                y = call(g, op.default, ins["gate"], ins["up"], backend)
                return y if dtype == gv.dtype else call(g, aten.to.dtype, y, dtype)

            yield Match(kind, out, {"gate": gate, "up": up}, reference=ref, build=build)
