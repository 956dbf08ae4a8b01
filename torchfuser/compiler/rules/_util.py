"""Small helpers for reading pre-dispatch ATen graphs: ops by packet, casts looked through."""
from __future__ import annotations

import numbers

import torch
from torch.fx import Node

aten = torch.ops.aten

# dtype conversions and layout no-ops the user's code may put anywhere in a block
_CASTS = {aten.to, aten._to_copy, aten.type_as, aten.contiguous, aten.clone, aten.alias}


def packet(n) -> object:
    if not isinstance(n, Node) or n.op != "call_function":
        return None
    return getattr(n.target, "overloadpacket", n.target)


def is_op(n, *packets) -> bool:
    return packet(n) in packets


def strip(n):
    """``n`` with any chain of dtype casts / contiguous / clone removed."""
    while is_op(n, *_CASTS):
        n = n.args[0]
    return n


def val(n):
    return n.meta.get("val") if isinstance(n, Node) else None


def users(n) -> list[Node]:
    return list(n.users)


def forward_casts(n: Node) -> list[Node]:
    """``n`` and every node reachable from it through casts only (the candidates for the next step)."""
    out, todo = [], [n]
    while todo:
        m = todo.pop()
        out.append(m)
        todo += [u for u in m.users if is_op(u, *_CASTS) and u.args[0] is m]
    return out


def is_scalar(a) -> bool:
    return isinstance(a, numbers.Number) and not isinstance(a, bool)


def other(n: Node, a: Node):
    """The other operand of the binary op ``n`` given one operand ``a`` (looked up through casts)."""
    if len(n.args) < 2:
        return None
    x, y = n.args[0], n.args[1]
    if x is a or (isinstance(x, Node) and strip(x) is strip(a) and x is not y):
        return y
    if y is a or (isinstance(y, Node) and strip(y) is strip(a)):
        return x
    return None


def last_dim_list(dims, ndim) -> bool:
    if not isinstance(dims, (list, tuple)) or len(dims) != 1:
        return False
    d = dims[0]
    return d == -1 or (isinstance(ndim, int) and d == ndim - 1)


def ndim(n):
    v = val(n)
    return None if v is None else v.dim()


def same_size(a, b) -> bool:
    from torch.fx.experimental.symbolic_shapes import statically_known_true

    try:
        return bool(statically_known_true(a == b)) if not (isinstance(a, int) and isinstance(b, int)) else a == b
    except Exception:
        return False


def is_vector_of(w, size) -> bool:
    v = val(w)
    return v is not None and v.dim() == 1 and same_size(v.shape[0], size) and v.is_floating_point()


def call(graph, target, *args, **kwargs) -> Node:
    return graph.call_function(target, args, kwargs)


def cast_like(graph, node: Node, want_dtype, have_dtype) -> Node:
    """Cast the fused op's output to the dtype the replaced subgraph produced."""
    if want_dtype is None or want_dtype == have_dtype:
        return node
    return call(graph, aten.to.dtype, node, want_dtype)
