"""Linear + cross-entropy: ``cross_entropy(softcap?(h @ W.T + b), labels)`` where the logits
feed the loss only (when the logits are also returned, they exist anyway and fusing saves
nothing, so the match is skipped)."""
from __future__ import annotations

import torch
from torch.fx import Node

from torchfuser.backends.reference.linear_cross_entropy import linear_cross_entropy as ref_lce
from torchfuser.compiler.rewrite import Match
from torchfuser.ops.linear_cross_entropy import linear_cross_entropy as ops_lce
from torchfuser.compiler.rules._util import aten, call, is_op, is_scalar, strip, val

tf = torch.ops.torchfuser

_VIEWS = (aten.view, aten.reshape, aten._unsafe_view, aten.flatten)
_REDUCTIONS = {1: "mean", 2: "sum"}


def _through_views(n):
    """Back from the loss input through views and casts that nothing else reads."""
    while is_op(n, *_VIEWS) or strip(n) is not n:
        if len(n.users) > 1:
            return None
        n = n.args[0]
    return n


def _softcap(n):
    """tanh(z / c) · c → (z, c); else (n, None)."""
    if is_op(n, aten.mul) and is_scalar(n.args[1]) and is_op(n.args[0], aten.tanh):
        d = n.args[0].args[0]
        if is_op(d, aten.div) and d.args[1] == n.args[1]:
            return d.args[0], float(n.args[1])
    return n, None


def linear_cross_entropy(graph):
    for ce in list(graph.nodes):
        if not is_op(ce, aten.cross_entropy_loss):
            continue
        args = list(ce.args) + [None] * 6
        logits, labels = args[0], args[1]
        weight = ce.kwargs.get("weight", args[2])
        reduction = ce.kwargs.get("reduction", args[3] if args[3] is not None else 1)
        ignore = ce.kwargs.get("ignore_index", args[4] if args[4] is not None else -100)
        smoothing = ce.kwargs.get("label_smoothing", args[5] if args[5] is not None else 0.0)
        if weight is not None or smoothing or reduction not in _REDUCTIONS or val(logits) is None or val(logits).dim() != 2:
            continue
        z = _through_views(logits)
        z, softcap = _softcap(z) if z is not None else (None, None)
        z = _through_views(z) if z is not None else None
        if not is_op(z, aten.linear) or len(z.users) != 1:
            continue
        h, w = z.args[0], z.args[1]
        b = z.args[2] if len(z.args) > 2 else None
        if val(w) is None or val(w).dim() != 2 or val(h) is None:
            continue
        yield _match(ce, h, w, b, labels, int(ignore), softcap, _REDUCTIONS[reduction])


def _match(ce: Node, h, w, b, labels, ignore, softcap, reduction):
    out_dtype = val(ce).dtype
    inputs = {"hidden": h, "weight": w} | ({"bias": b} if b is not None else {}) | {"labels": labels}

    def build(g, ins, backend):
        hid = ins["hidden"]
        hdim = val(hid).shape[-1]
        h2 = call(g, aten.reshape.default, hid, [-1, hdim])
        y = call(g, aten.reshape.default, ins["labels"], [-1])
        # The ops-layer wrapper, not the custom op: it decides need_grad when AOTAutograd traces it,
        # from the grad mode and requires_grad it sees then (unknown at this point of the pipeline).
        loss = call(g, ops_lce, h2, ins["weight"], ins.get("bias"), y, ignore, softcap, reduction, backend)
        return loss if out_dtype == torch.float32 else call(g, aten.to.dtype, loss, out_dtype)

    def reference(hh, ww, *rest):
        bb, yy = (rest[0], rest[1]) if len(rest) == 2 else (None, rest[0])
        return ref_lce(hh.reshape(-1, hh.shape[-1]), ww, bb, yy.reshape(-1), ignore, softcap, reduction)

    return Match("linear_cross_entropy", ce, inputs, {"reduction": reduction, "softcap": softcap}, reference=reference,
                 build=build, int_high=lambda shapes: shapes[1][0])
