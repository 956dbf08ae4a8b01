"""Rotary embedding, rotate-half convention, on B×H×S×D tensors:

    t · cos' + cat(−t[..., D/2:], t[..., :D/2]) · sin'     with cos' = cos.unsqueeze(1) (cos B×S×D)

The q and k rotations that share cos and sin become one ``rope_fwd``; a lone one is paired
with itself. cos and sin must not require grad (the op treats them as constants).
"""
from __future__ import annotations

import operator

import torch
from torch.fx import Node

from torchfuser.backends.reference.rope import rope as ref_rope
from torchfuser.compiler.rewrite import Match
from torchfuser.compiler.rules._util import aten, call, is_op, other, strip, val

tf = torch.ops.torchfuser


def _last(dim, nd) -> bool:
    return dim == -1 or dim == nd - 1


def _rotate_half_of(cat: Node):
    if not is_op(cat, aten.cat) or len(cat.args[0]) != 2:
        return None
    t = val(cat)
    if t is None or t.dim() != 4 or not _last(cat.args[1] if len(cat.args) > 1 else 0, 4):
        return None
    neg, lo = cat.args[0]
    if not is_op(neg, aten.neg) or not is_op(neg.args[0], aten.slice) or not is_op(lo, aten.slice):
        return None
    hi = neg.args[0]
    if hi.args[0] is not lo.args[0] or not all(_last(s.args[1], 4) for s in (hi, lo)) or lo.args[2] != 0:
        return None
    return lo.args[0]


def _table(n):
    """cos' / sin' → the B×S×D table it broadcasts from, when it is an unsqueeze at dim 1."""
    if is_op(n, aten.unsqueeze) and n.args[1] == 1 and val(n.args[0]) is not None and val(n.args[0]).dim() == 3:
        t = n.args[0]
        return None if val(t).requires_grad else t
    return None


def _single(graph):
    """(output add, t, cos table, sin table) for each rotation."""
    for cat in graph.nodes:
        if (t := _rotate_half_of(cat)) is None:
            continue
        for ms in cat.users:
            if not is_op(ms, aten.mul) or (sin := _table(other(ms, cat))) is None:
                continue
            for add in ms.users:
                if not is_op(add, aten.add) or len(add.args) != 2 or (mc := other(add, ms)) is None:
                    continue
                if is_op(mc, aten.mul) and (c := other(mc, t)) is not None and strip(other(mc, c)) is strip(t):
                    if (cos := _table(c)) is not None:
                        yield add, strip(t) if val(strip(t)) is not None else t, cos, sin


def rope(graph):
    singles = list(_single(graph))
    order = {n: i for i, n in enumerate(graph.nodes)}
    used = set()
    for i, (out_q, q, cos, sin) in enumerate(singles):
        if i in used:
            continue
        used.add(i)
        partner = None
        for j in range(i + 1, len(singles)):
            out_k, k, cos_k, sin_k = singles[j]
            if j in used or cos_k is not cos or sin_k is not sin or val(k).dtype != val(q).dtype:
                continue
            # one fused node must come after both inputs and before both outputs
            if max(order[q], order[k]) < min(order[out_q], order[out_k]):
                partner = j
                break
        if partner is not None:
            used.add(partner)
            out_k, k = singles[partner][0], singles[partner][1]
            yield _match(out_q, q, cos, sin, out_k, k)
        else:
            yield _match(out_q, q, cos, sin)


def _match(out_q, q, cos, sin, out_k=None, k=None):
    dq = val(out_q).dtype
    dk = val(out_k).dtype if out_k is not None else None
    inputs = {"q": q} | ({"k": k} if k is not None else {}) | {"cos": cos, "sin": sin}

    def build(g, ins, backend):
        kk = ins.get("k", ins["q"])
        r = call(g, tf.rope_fwd.default, ins["q"], kk, ins["cos"], ins["sin"], None, backend)
        qo = call(g, operator.getitem, r, 0)
        qo = qo if dq == val(ins["q"]).dtype else call(g, aten.to.dtype, qo, dq)
        if "k" not in ins:
            return qo
        ko = call(g, operator.getitem, r, 1)
        return qo, (ko if dk == val(kk).dtype else call(g, aten.to.dtype, ko, dk))

    def reference(*t):
        if k is None:
            qq, c, s = t
            return ref_rope(qq, qq, c, s)[0]
        return ref_rope(*t)

    extra = ((out_k, 1),) if out_k is not None else ()
    return Match("rope", out_q, inputs, reference=reference, build=build, extra_outputs=extra,
                 note="" if k is not None else "(q only)")
