"""Grouped-query attention without repeated keys and values: SDPA with ``enable_gqa=True``.

transformers repeats each key/value head once per query head of its group (``repeat_kv``: a
``[:, :, None]``, an ``expand`` and a ``reshape``) whenever it passes SDPA a mask, and under
torch.compile it always passes one. Once ``causal_mask`` has turned that mask into
``is_causal=True``, the repeat is left for nothing: the compiled forward copies k and v per query
head and the backward sums their gradients back per group, and cuDNN runs on every repeated head
(qwen05b on an H200: ≈ 1.9 ms of GPU time a step, ``docs/performance/NOTES-train-step.md``).
Here a maskless SDPA call whose k and v are exactly ``repeat_kv(x, n)`` takes x with
``enable_gqa=True``, which PyTorch defines as the same repeat.
"""
from __future__ import annotations

import operator

import torch
from torch.fx import GraphModule, Node

from torchfuser.compiler.causal_mask import SDPA, sdpa_argument
from torchfuser.compiler.record import CompileRecord

_FULL = slice(None, None, None)


def _shape(node) -> tuple | None:
    value = node.meta.get("example_value") if isinstance(node, Node) else None
    if not isinstance(value, torch.Tensor) or not all(isinstance(d, int) for d in value.shape):
        return None
    return tuple(value.shape)


def _calls(node, methods: tuple[str, ...], functions: tuple = ()) -> bool:
    return isinstance(node, Node) and (
        (node.op == "call_method" and node.target in methods) or (node.op == "call_function" and node.target in functions)
    )


def _unit_dim_at_2(node: Node) -> Node | None:
    """x when ``node`` is ``x[:, :, None]`` (trailing full slices allowed) or ``x.unsqueeze(2)``."""
    if _calls(node, (), (operator.getitem,)):
        x, index = node.args
        if isinstance(index, tuple) and index[:3] == (_FULL, _FULL, None) and all(
                i == _FULL or i is Ellipsis for i in index[3:]):
            return x
        return None
    if _calls(node, ("unsqueeze",), (torch.unsqueeze,)):
        dim = node.args[1] if len(node.args) > 1 else node.kwargs.get("dim")
        return node.args[0] if dim in (2, -3) else None
    return None


def repeated(node) -> tuple[Node, int] | None:
    """(x, n) when ``node`` is transformers' ``repeat_kv(x, n)`` of a 4-D x, else None."""
    if not _calls(node, ("reshape", "view"), (torch.reshape,)):
        return None
    expanded = node.args[0]
    if not _calls(expanded, ("expand",)):
        return None
    unit = expanded.args[0]
    x = _unit_dim_at_2(unit) if isinstance(unit, Node) else None
    shapes = [_shape(n) for n in (x, unit, expanded, node)]
    if x is None or None in shapes or len(shapes[0]) != 4:
        return None
    (b, h, s, d), unit_shape, expanded_shape, out_shape = shapes
    n = expanded_shape[2] if len(expanded_shape) == 5 else 0
    if unit_shape != (b, h, 1, s, d) or expanded_shape != (b, h, n, s, d) or out_shape != (b, h * n, s, d):
        return None
    return x, n


def _maskless(node: Node) -> bool:
    """No mask, and not grouped already."""
    return sdpa_argument(node, "attn_mask") is None and not sdpa_argument(node, "enable_gqa", False)


def run(gm: GraphModule, record: CompileRecord, where=lambda node: True) -> int:
    """Give every maskless SDPA call of ``gm`` (for which ``where(node)`` holds) whose k and v are
    repeated per query head the unrepeated k and v with ``enable_gqa=True``; returns how many."""
    done, dropped = 0, []
    for node in list(gm.graph.nodes):
        if node.op != "call_function" or node.target is not SDPA or not where(node) or not _maskless(node):
            continue
        k, v = (repeated(a) for a in node.args[1:3])
        if k is None or v is None or k[1] != v[1] or k[1] < 2:
            continue
        for repeat in node.args[1:3]:  # reshape → expand → unit dim
            dropped += [repeat, repeat.args[0], repeat.args[0].args[0]]
        node.args = (node.args[0], k[0], v[0], *node.args[3:7])
        node.kwargs = {**node.kwargs, "enable_gqa": True}
        done += 1
    if done:
        for n in dict.fromkeys(dropped):  # in order, once each, where nothing else reads it
            if not n.users:
                gm.graph.erase_node(n)
        gm.recompile()
        record.rewrote(f"grouped k/v: {done} scaled_dot_product_attention call(s) take enable_gqa=True instead "
                       "of keys and values repeated per query head")
    return done
