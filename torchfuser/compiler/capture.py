"""Stage 1: the Dynamo graph (torch-level calls) → a pre-dispatch ATen graph.

Pre-dispatch tracing keeps what the rewrite needs and what autograd must see again: grad-mode
switches stay in the graph as nodes (a plain trace would drop ``no_grad`` and differentiate
through it), and composite ops such as ``aten.linear`` / ``aten.layer_norm`` survive as single
nodes. Nothing is differentiated here: AOTAutograd runs on the rewritten graph afterwards, so the
backward of a rewritten op is the custom op's own backward.
"""
from __future__ import annotations

from contextlib import nullcontext

import torch
from torch._guards import detect_fake_mode
from torch.fx.experimental.proxy_tensor import make_fx


class CompileError(RuntimeError):
    """A construct torchfuser cannot compile; the message names the op."""


class _Tracked(torch.fx.Interpreter):
    """Runs the Dynamo graph node by node so that a failure can name the op it failed on."""

    current = None

    def run_node(self, n):
        self.current = n
        return super().run_node(n)


def fakeify(example_inputs, fake_mode):
    """Dynamo hands backends real tensors; map each to the fake tensor Dynamo traced it as (same
    symbols, same sources), the way AOTAutograd does."""
    from torch._guards import TracingContext
    from torch._subclasses.fake_tensor import FakeTensor

    ctx = TracingContext.try_get()
    out = []
    for x in example_inputs:
        if not isinstance(x, torch.Tensor) or isinstance(x, FakeTensor):
            out.append(x)
            continue
        sym = ctx.tensor_to_context.get(x) if ctx is not None else None
        source = getattr(sym, "tensor_source", None)
        out.append(fake_mode.from_tensor(x, symbolic_context=sym, source=source, trace=sym is None))
    return out


def to_aten(gm: torch.fx.GraphModule, example_inputs) -> torch.fx.GraphModule:
    fake_mode = detect_fake_mode(example_inputs)
    if fake_mode is not None:
        example_inputs = fakeify(example_inputs, fake_mode)
    interp = _Tracked(gm)
    # Trace Dynamo's own fake tensors under its fake mode ("real" mode = no re-fakeifying): new
    # symbols made here would have no source and break Dynamo's guards.
    mode = "real" if fake_mode is not None else "fake"
    try:
        with fake_mode if fake_mode is not None else nullcontext():
            traced = make_fx(interp.run, tracing_mode=mode, pre_dispatch=True, _allow_non_fake_inputs=True)(*example_inputs)
    except Exception as e:
        n = interp.current
        where = f"{n.format_node()}" if n is not None else "the graph"
        target = getattr(n, "target", None)
        name = getattr(target, "__name__", str(target))
        raise CompileError(f"torchfuser cannot capture op {name!r} ({where}): {type(e).__name__}: {e}") from e
    traced.graph.eliminate_dead_code()
    traced.recompile()
    return traced
