"""The causal-mask and grouped k/v rewrites for ``torch.compile(optimize(model))`` with Inductor,
PyTorch's default.

``torch.compile(model, backend="torchfuser")`` runs ``causal_mask`` and ``grouped_kv`` itself. A
model that ``torchfuser.optimize`` changed and the user compiles with the default backend never
reaches that backend, so ``optimize`` adds this pass to Inductor's pre-grad passes
(``torch._inductor.config.pre_grad_custom_pass``, after any pass already there). It rewrites only
the attention calls made by torchfuser's own ``FusedAttention`` (found by the module stack Dynamo
records on each node): every other graph, and every other attention call, is left as it was.

It is held by the models that need it (``hold``/``release``, weakly: a model collected without
``restore`` lets go too) and taken out when the last lets go, leaving Inductor's config exactly
as it was; ``uninstall()`` takes it out at once.
"""
from __future__ import annotations

import hashlib
import weakref
from pathlib import Path

from torch._inductor import config
from torch._inductor.custom_graph_pass import CustomGraphPass
from torch.fx import Graph, Node

import torchfuser.ops
from torchfuser.compiler import causal_mask, grouped_kv
from torchfuser.compiler.record import CompileRecord
from torchfuser.modules.attention import FusedAttention

RECENT: list[CompileRecord] = []  # one record per graph the pass changed or kept masks in (latest last)
_MAX_RECORDS = 16


_FUSED_NAME = f"{FusedAttention.__module__}.{FusedAttention.__qualname__}"


def _is_fused_attention(kind) -> bool:
    # Dynamo records the class; export and some versions its qualified name.
    return issubclass(kind, FusedAttention) if isinstance(kind, type) else kind == _FUSED_NAME


def _from_fused_attention(node: Node) -> bool:
    stack = node.meta.get("nn_module_stack") or {}
    return any(_is_fused_attention(kind) for _, kind in stack.values())


def _passes(chain) -> tuple:
    if chain is None:
        return ()
    return tuple(chain) if isinstance(chain, (list, tuple)) else (chain,)


def _uuid_of(p) -> str:
    uuid = getattr(p, "uuid", None)
    return repr(uuid() if callable(uuid) else None)


def _sources() -> list[Path]:
    """What the compiled code depends on besides the graph: these rewrites, and the ops layer,
    whose fake impls give Inductor the layouts it bakes into its code (a cached graph from before
    a change to them would fail its stride checks)."""
    ops = Path(torchfuser.ops.__file__).parent
    return [Path(__file__), Path(causal_mask.__file__), Path(grouped_kv.__file__), *sorted(ops.glob("*.py"))]


class CausalMaskPass(CustomGraphPass):
    """Runs the passes that were installed before it, then ``causal_mask.run`` and
    ``grouped_kv.run`` on the calls of ``FusedAttention``. ``uuid`` (Inductor's cache key) covers this
    code, the ops layer and those passes."""

    def __init__(self, previous=None):
        self.previous = previous

    def __call__(self, graph: Graph) -> None:
        for p in _passes(self.previous):
            p(graph)
        gm = graph.owning_module
        if gm is None or not any(n.target is causal_mask.SDPA and _from_fused_attention(n) for n in graph.nodes):
            return
        record = CompileRecord(graph_backend="inductor (pre-grad pass)")
        causal_mask.run(gm, record, where=_from_fused_attention)
        grouped_kv.run(gm, record, where=_from_fused_attention)
        RECENT.append(record)
        del RECENT[:-_MAX_RECORDS]

    def uuid(self) -> str:
        digest = hashlib.sha256()
        for source in _sources():
            digest.update(Path(source).read_bytes())
        digest.update("".join(_uuid_of(p) for p in _passes(self.previous)).encode())
        return digest.hexdigest()


def installed() -> bool:
    return any(isinstance(p, CausalMaskPass) for p in _passes(config.pre_grad_custom_pass))


def install() -> None:
    """Add the pass to Inductor's pre-grad passes once, keeping any the user set."""
    if not installed():
        config.pre_grad_custom_pass = CausalMaskPass(config.pre_grad_custom_pass)


def uninstall() -> None:
    """Take the pass out, leaving the passes it wrapped where they were (the same object where the
    config still holds the pass itself); no model holds it any more."""
    _holders.clear()
    current = config.pre_grad_custom_pass
    if isinstance(current, CausalMaskPass):
        config.pre_grad_custom_pass = current.previous  # what was there before, the very object
    elif any(isinstance(p, CausalMaskPass) for p in _passes(current)):  # listed with passes of the user's
        kept = [q for p in _passes(current) for q in (_passes(p.previous) if isinstance(p, CausalMaskPass) else (p,))]
        config.pre_grad_custom_pass = None if not kept else kept[0] if len(kept) == 1 else kept


# id(model) → a weak reference to it, whose callback lets go when the model is collected.
_holders: dict[int, weakref.ref] = {}


def hold(model) -> None:
    """``model`` has fused attention: the pass is in until ``release(model)`` (or its collection)."""
    key = id(model)
    if key not in _holders:
        _holders[key] = weakref.ref(model, lambda _, key=key: _let_go(key))
    install()


def release(model) -> None:
    _let_go(id(model))


def _let_go(key: int) -> None:
    if _holders.pop(key, None) is not None and not _holders:
        uninstall()


def holders() -> int:
    return len(_holders)
