"""The Dynamo backend: ``torch.compile(model, backend="torchfuser")``.

    Dynamo graph ─capture→ pre-dispatch ATen graph ─rewrite→ fused custom ops
      ├─ CUDA/ROCm (or backend="inductor"): Inductor (which runs AOTAutograd itself)
      └─ CPU: AOTAutograd → forward / backward ATen graphs → pointwise/reduction regions,
              each compiled by the MLIR backend; matmuls, convolutions, SDPA and the fused
              ops stay ATen calls
"""
from __future__ import annotations

import collections
import functools

import torch
from torch.fx import GraphModule

from torchfuser.compiler import capture, causal_mask, grouped_kv, rewrite
from torchfuser.compiler.options import parse
from torchfuser.compiler.record import CompileRecord

# the most recent compilations, newest last (``torchfuser.compiler.last_record()``)
RECENT: collections.deque[CompileRecord] = collections.deque(maxlen=32)


def _device(example_inputs) -> torch.device:
    for t in example_inputs:
        if isinstance(t, torch.Tensor):
            return t.device
    return torch.device("cpu")


def _is_dynamic(example_inputs) -> bool:
    return any(
        isinstance(x, torch.SymInt) or (isinstance(x, torch.Tensor) and any(isinstance(s, torch.SymInt) for s in x.shape))
        for x in example_inputs
    )


@functools.cache
def _decompositions():
    # Core ATen, so that regions see pointwise ops and plain reductions (silu_backward →
    # sigmoid/mul, softmax → amax/sub/exp/sum, ...), but attention stays one call.
    from torch._decomp import core_aten_decompositions

    return {k: v for k, v in core_aten_decompositions().items() if "scaled_dot_product" not in str(k)}


def _lowering(record: CompileRecord, which: str, graph_backend: str, dynamic: bool):
    def compile_fn(gm: GraphModule, example_inputs):
        record.graphs[which] = gm.code
        from torch._functorch.aot_autograd import make_boxed_func

        if graph_backend == "eager":
            return make_boxed_func(gm.forward)
        from torchfuser.compiler.partition import compile_regions

        out = compile_regions(gm, record, which, dynamic)
        record.graphs[f"{which} regions"] = out.code
        return make_boxed_func(out.forward)

    return compile_fn


def dynamo_backend(gm: GraphModule, example_inputs, options: dict | None = None, _sink: list | None = None, **kwargs):
    """Compile one Dynamo graph. Options (``torch.compile(..., options={...})`` or keywords):
    ``backend`` ("auto" | "mlir" | "inductor" | "eager"), ``rewrite`` ("auto" | True | False),
    ``dynamic`` and ``kernels`` (the kernel backend baked into rewritten ops, default "auto").
    Before Inductor, attention masks that are exactly causal and computed from constants become
    ``is_causal=True`` (``causal_mask``), and grouped keys and values that were repeated per query
    head for a mask go to SDPA unrepeated (``grouped_kv``); both off with ``rewrite=False``."""
    opts = parse(options, **kwargs)
    device = _device(example_inputs)
    graph_backend = opts.graph_backend(device.type)
    dynamic = _is_dynamic(example_inputs) if opts.dynamic is None else bool(opts.dynamic)
    record = CompileRecord(device=str(device), graph_backend=graph_backend, dynamic=dynamic)
    RECENT.append(record)
    if _sink is not None:
        _sink.append(record)
    if graph_backend == "mlir" and device.type != "cpu":
        raise capture.CompileError(
            f"torchfuser: the MLIR graph backend runs on CPU tensors only, this graph is on {device}; "
            "use backend='auto' or 'inductor'"
        )
    if opts.rewrite is not False and graph_backend == "inductor":
        # Not before the MLIR/eager lowering: AOTAutograd's graph there runs ATen's SDPA as traced,
        # and on the CPU its causal kernel's output layout differs from what the trace assumed
        # (a view of it fails; found by tests/test_causal_mask.py). Inductor checks the layouts.
        causal_mask.run(gm, record)
        grouped_kv.run(gm, record)
    record.graphs["dynamo"] = gm.code
    aten_gm = capture.to_aten(gm, example_inputs)
    record.graphs["capture"] = aten_gm.code
    rewrite.run(aten_gm, record, opts.rewrite, opts.kernels, graph_backend)
    record.graphs["rewrite"] = aten_gm.code

    if graph_backend == "inductor":
        from torch._inductor.compile_fx import compile_fx

        return _first_call_unchecked(compile_fx(aten_gm, example_inputs))

    from torch._functorch.aot_autograd import aot_module_simplified

    fw = _lowering(record, "forward", graph_backend, dynamic)
    return _first_call_unchecked(aot_module_simplified(
        aten_gm,
        example_inputs,
        fw_compiler=fw,
        bw_compiler=_lowering(record, "backward", graph_backend, dynamic),
        inference_compiler=_lowering(record, "inference", graph_backend, dynamic),
        decompositions=_decompositions(),
    ))


def _first_call_unchecked(compiled):
    """AOTAutograd runs the first call of a compiled graph under a dispatch mode that checks custom
    ops for aliasing; kernels that use torch.func inside (the reference backend's vjp) fail under
    it ("Cannot access storage of TensorWrapper"). Our ops declare no aliasing (fresh outputs), so
    the check is switched off for that one call."""
    from torch._functorch import config as functorch_config

    state = {"first": True}

    def run(*args):
        if state["first"]:
            state["first"] = False
            with functorch_config.patch(check_custom_op_aliasing=False):
                return compiled(*args)
        return compiled(*args)

    # keep the calling convention Dynamo will use (a boxed callable takes one list)
    if getattr(compiled, "_boxed_call", False):
        run._boxed_call = True
    return run
