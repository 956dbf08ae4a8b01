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


def to_aten(gm: torch.fx.GraphModule, example_inputs) -> torch.fx.GraphModule:
    fake_mode = detect_fake_mode(example_inputs)
    mode = "symbolic" if fake_mode is not None and fake_mode.shape_env is not None else "fake"
    interp = _Tracked(gm)
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
