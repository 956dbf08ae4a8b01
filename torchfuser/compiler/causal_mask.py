"""Attention masks that only say "causal": SDPA with ``is_causal=True`` instead of a tensor mask.

transformers builds the causal mask as a tensor whenever its code is traced (it cannot look at a
padding mask's values then), so under torch.compile every attention call gets a B×1×S×S mask and
SDPA runs its masked kernels: on the H200 cuDNN's masked forward and backward take 2.4–2.8× the
time of its causal ones (``docs/performance/NOTES-compiler.md``). A mask computed from constants
alone (aranges of static lengths, no graph input) is evaluated here, once, at compile time; when
its value is exactly the lower-triangular causal mask, the call is rewritten to ``is_causal=True``.
A mask that depends on an input (a padding mask), has symbolic sizes, or is anything but causal is
left as it is.
"""
from __future__ import annotations

import torch
from torch.fx import Graph, GraphModule, Node

from torchfuser.compiler.record import CompileRecord

SDPA = torch.nn.functional.scaled_dot_product_attention
_SDPA_ARGS = ("query", "key", "value", "attn_mask", "dropout_p", "is_causal", "scale", "enable_gqa")
_MAX_MASK_ELEMENTS = 1 << 28  # evaluating a larger mask costs more memory than this pass is worth


def sdpa_argument(node: Node, name: str, default=None):
    """An argument of an SDPA call node, given by position or by keyword."""
    position = _SDPA_ARGS.index(name)
    return node.args[position] if len(node.args) > position else node.kwargs.get(name, default)


def _ancestors(node: Node) -> list[Node]:
    seen, order, stack = set(), [], [node]
    while stack:
        n = stack.pop()
        if n in seen:
            continue
        seen.add(n)
        order.append(n)
        stack.extend(n.all_input_nodes)
    return order


def _constant_value(gm: GraphModule, mask: Node, order: dict[Node, int]):
    """The mask's value when it is computed from constants alone, else (None, why)."""
    nodes = _ancestors(mask)
    if any(n.op not in ("call_function", "call_method") for n in nodes):
        return None, "it depends on the graph's inputs"
    meta = mask.meta.get("example_value")
    if not isinstance(meta, torch.Tensor) or any(not isinstance(d, int) for d in meta.shape):
        return None, "its shape is symbolic"
    if meta.numel() > _MAX_MASK_ELEMENTS:
        return None, f"it has {meta.numel()} elements (evaluated only up to {_MAX_MASK_ELEMENTS})"
    graph, env = Graph(), {}
    for n in sorted(nodes, key=order.__getitem__):
        env[n] = graph.node_copy(n, lambda a: env[a])
    graph.output(env[mask])
    from torch._subclasses.fake_tensor import unset_fake_temporarily

    try:
        with unset_fake_temporarily(), torch.no_grad():
            return GraphModule(gm, graph)(), None
    except Exception as err:  # an op that cannot run outside its graph: keep the mask
        return None, f"it could not be evaluated ({type(err).__name__})"


def is_causal(value: torch.Tensor, q_len: int, kv_len: int) -> bool:
    """Whether ``value`` (bool: True = attend; float: 0 = attend, very negative = masked) is the
    lower-triangular mask of a q_len × kv_len attention, broadcast over its leading dims."""
    if q_len != kv_len or tuple(value.shape[-2:]) != (q_len, kv_len):
        return False
    if value.dtype == torch.bool:
        allowed = value
    elif value.is_floating_point():
        allowed = value == 0
        if not bool((allowed | (value <= torch.finfo(value.dtype).min / 2)).all()):
            return False
    else:
        return False
    tril = torch.ones(q_len, kv_len, dtype=torch.bool, device=value.device).tril()
    return bool((allowed == tril).all())


def run(gm: GraphModule, record: CompileRecord, where=lambda node: True) -> int:
    """Rewrite every SDPA call of ``gm`` (for which ``where(node)`` holds) whose mask is a constant
    causal mask; returns how many."""
    done, kept, values = 0, [], {}
    order = {n: i for i, n in enumerate(gm.graph.nodes)}
    for node in list(gm.graph.nodes):
        if node.op != "call_function" or node.target is not SDPA or not where(node):
            continue
        mask = sdpa_argument(node, "attn_mask")
        if not isinstance(mask, Node) or sdpa_argument(node, "is_causal", False):
            continue
        if mask not in values:  # transformers hands one mask to every layer
            values[mask] = _constant_value(gm, mask, order)
        value, why = values[mask]
        q, k = (getattr(a, "meta", {}).get("example_value") for a in node.args[:2])
        if value is not None and not (isinstance(q, torch.Tensor) and isinstance(k, torch.Tensor)
                                      and is_causal(value, q.shape[-2], k.shape[-2])):
            why = "its value is not the causal mask"
        if why is not None:
            kept.append(why)
            continue
        if "attn_mask" in node.kwargs:
            node.kwargs = {**node.kwargs, "attn_mask": None, "is_causal": True}
        else:
            node.args = (*node.args[:3], None, *node.args[4:])
            node.kwargs = {**node.kwargs, "is_causal": True}
        done += 1
    if done:
        # Only the masks' own computations go: the rest of a Dynamo graph may hold in-place ops
        # whose results nobody reads.
        for mask in values:
            for n in sorted(_ancestors(mask), key=order.__getitem__, reverse=True):
                if not n.users:
                    gm.graph.erase_node(n)
        gm.recompile()
        record.rewrote(f"causal mask: {done} scaled_dot_product_attention call(s) take is_causal=True instead of "
                       "a mask computed from constants that is exactly causal")
    for why in sorted(set(kept)):
        record.skip(f"causal mask: {kept.count(why)} attention mask(s) kept: {why}")
    return done
