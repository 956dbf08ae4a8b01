"""RMSNorm (with Gemma's ``offset + w``) and LayerNorm, however the user wrote them.

RMSNorm:   x · rsqrt(mean(x², -1) + eps) · (offset + w)   (x / sqrt(...) too; any casts)
LayerNorm: (x − mean) · rsqrt(var + eps) · w (+ b)         (var as var(..., correction=0) or
           mean((x − mean)²)), and ``aten.layer_norm`` itself.
"""
from __future__ import annotations

import operator

import torch
from torch.fx import Node

from torchfuser.backends.reference.layer_norm import layer_norm as ref_layer_norm
from torchfuser.backends.reference.rms_norm import rms_norm as ref_rms_norm
from torchfuser.compiler.rewrite import Match
from torchfuser.compiler.rules._util import (
    aten, call, cast_like, forward_casts, is_op, is_scalar, is_vector_of, last_dim_list, ndim, other, strip, val,
)

tf = torch.ops.torchfuser


def _eps_and_normalized(stat: Node, is_base):
    """From the statistic (mean square / variance): its ``+ eps``, the rsqrt (or sqrt) and the
    product (or quotient) with the tensor being normalised. Yields (eps, normalized node)."""
    for e in stat.users:
        if not is_op(e, aten.add) or len(e.args) < 2:
            continue
        eps = e.args[1] if e.args[0] is stat else e.args[0]
        if not is_scalar(eps):
            continue
        for r in e.users:
            if is_op(r, aten.rsqrt):
                for n in r.users:
                    if is_op(n, aten.mul) and (o := other(n, r)) is not None and is_base(o):
                        yield float(eps), n
            elif is_op(r, aten.sqrt):
                for n in r.users:
                    if is_op(n, aten.div) and n.args[1] is r and is_base(n.args[0]):
                        yield float(eps), n


def _weight_mul(n: Node, size):
    """The multiplication of the normalised ``n`` (through casts) by a 1-D weight, or by
    (weight + offset). Yields (mul node, weight node, offset)."""
    for c in forward_casts(n):
        for u in c.users:
            if not is_op(u, aten.mul) or (w := other(u, c)) is None or not isinstance(w, Node):
                continue
            if is_op(w, aten.add) and is_scalar(w.args[1]) and is_vector_of(w.args[0], size):
                yield u, w.args[0], float(w.args[1])
            elif is_op(w, aten.add) and is_scalar(w.args[0]) and is_vector_of(w.args[1], size):
                yield u, w.args[1], float(w.args[0])
            elif is_vector_of(w, size):
                yield u, w, 0.0


def _mean_last(n) -> bool:
    return is_op(n, aten.mean) and len(n.args) >= 2 and last_dim_list(n.args[1], ndim(n.args[0])) and (
        (len(n.args) > 2 and n.args[2]) or n.kwargs.get("keepdim", False)
    )


def _square_of(n):
    if is_op(n, aten.pow) and n.args[1] == 2:
        return n.args[0]
    if is_op(n, aten.mul) and isinstance(n.args[0], Node) and strip(n.args[0]) is strip(n.args[1]):
        return n.args[0]
    return None


def _out_dtype(n):
    v = val(n)
    return None if v is None else v.dtype


def rms_norm(graph):
    for m in list(graph.nodes):
        if not _mean_last(m) or (a := _square_of(m.args[0])) is None:
            continue
        x = strip(a)
        if val(x) is None or not val(x).is_floating_point():
            continue
        size = val(x).shape[-1]
        for eps, normed in _eps_and_normalized(m, lambda o: strip(o) is x):
            for out, w, offset in _weight_mul(normed, size):
                dtype = _out_dtype(out)

                def build(g, ins, backend, eps=eps, offset=offset, dtype=dtype):
                    y = call(g, operator.getitem, call(g, tf.rms_norm_fwd.default, ins["x"], ins["weight"], eps, offset, None, backend), 0)
                    return cast_like(g, y, dtype, val(ins["x"]).dtype)

                yield Match(
                    "rms_norm", out, {"x": x, "weight": w}, {"eps": eps, "offset": offset},
                    reference=lambda xx, ww, eps=eps, offset=offset: ref_rms_norm(xx, ww, eps, offset)[0],
                    build=build,
                )


def _centered(n):
    """``x − mean(x, -1, keepdim)`` → x, else None."""
    if is_op(n, aten.sub) and isinstance(n.args[1], Node) and _mean_last(n.args[1]) and strip(n.args[1].args[0]) is strip(n.args[0]):
        return strip(n.args[0])
    return None


def _variances(c: Node, x: Node):
    """Nodes computing the biased variance over the last dim of x, from ``c`` = x − mean."""
    for src in (c, x):
        for v in src.users:
            if is_op(v, aten.var) and strip(v.args[0]) in (x, c):
                corr = v.kwargs.get("correction", None)
                unbiased = v.args[2] if len(v.args) > 2 and isinstance(v.args[2], bool) else None
                keep = v.kwargs.get("keepdim", v.args[3] if len(v.args) > 3 else False)
                if (corr == 0 or unbiased is False) and keep and last_dim_list(v.args[1], ndim(v.args[0])):
                    yield v
            elif src is c and (sq := _square_of(v)) is not None and strip(sq) is c:
                yield from (mm for mm in v.users if _mean_last(mm))


def layer_norm(graph):
    for n in list(graph.nodes):
        if is_op(n, aten.layer_norm) and len(n.args) >= 3 and n.args[2] is not None and len(n.args[1]) == 1:
            x, w = n.args[0], n.args[2]
            b = n.args[3] if len(n.args) > 3 else n.kwargs.get("bias")
            eps = n.args[4] if len(n.args) > 4 else n.kwargs.get("eps", 1e-5)
            yield _ln_match(n, x, w, b, float(eps))
            continue
        if (x := _centered(n)) is None or val(x) is None:
            continue
        size = val(x).shape[-1]
        for var in _variances(n, x):
            for eps, normed in _eps_and_normalized(var, lambda o: strip(o) is n):
                for out, w, offset in _weight_mul(normed, size):
                    if offset:
                        continue
                    bias = None
                    for u in out.users:
                        if is_op(u, aten.add) and (b := other(u, out)) is not None and isinstance(b, Node) and is_vector_of(b, size):
                            out, bias = u, b
                            break
                    yield _ln_match(out, x, w, bias, eps)


def _ln_match(out, x, w, b, eps):
    dtype = _out_dtype(out)
    inputs = {"x": x, "weight": w} | ({"bias": b} if b is not None else {})

    def build(g, ins, backend):
        y = call(g, operator.getitem, call(g, tf.layer_norm_fwd.default, ins["x"], ins["weight"], ins.get("bias"), eps, backend), 0)
        return cast_like(g, y, dtype, val(ins["x"]).dtype)

    def reference(xx, ww, bb=None):
        return ref_layer_norm(xx, ww, bb, eps)[0]

    return Match("layer_norm", out, inputs, {"eps": eps}, reference=reference, build=build)
