"""The host cost of the fused LoRA node (modules/adapters/lora.py), counted, not timed: ATen calls are
deterministic, so an upper bound on the calls one training step's nodes dispatch is a legitimate test.
Top-level calls only (those not made inside another ATen op: the CPU kernels' own nested calls are
PyTorch's, not ours). Tiny Llama, PEFT LoRA r=8 on all seven projections, fp32 and a bf16 base with fp32
adapters (the hi/lo split path): 8 nodes a step (q/k/v, o, gate/up, down in each of 2 layers).
benchmarks/probes/lora_aten_calls.py prints the counts by op (docs/performance/NOTES-lora.md)."""
from __future__ import annotations

import contextlib
import copy

import pytest
import torch
from torch.profiler import ProfilerActivity, profile, record_function

import torchfuser
from torchfuser.modules.adapters import lora

peft = pytest.importorskip("peft")

# Measured with torch 2.13, transformers 5.17 and 5.25 alike: fp32 262, bf16 base 778; before the casts
# that do nothing, one-part concatenations and one-part splits were left out: fp32 392, bf16 869 (the bf16
# path's CPU count includes the fp32 spelling of the GPU's out_dtype GEMMs).
BOUNDS = {torch.float32: 270, torch.bfloat16: 790}


def _inside_aten(e) -> bool:
    p = e.cpu_parent
    while p is not None:
        if p.name.startswith("aten::"):
            return True
        p = p.cpu_parent
    return False


def _node_calls(monkeypatch, model, ids) -> tuple[int, int]:
    """(fused LoRA node calls, top-level ATen calls inside them) in one training step."""
    real_joint, real_backward = lora.joint, lora._LoRALinear.backward

    def joint(*args, **kwargs):
        with record_function("lora_node"):
            return real_joint(*args, **kwargs)

    def backward(ctx, dy):
        with record_function("lora_node"):
            return real_backward(ctx, dy)
    monkeypatch.setattr(lora, "joint", joint)
    monkeypatch.setattr(lora._LoRALinear, "backward", staticmethod(backward))
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        model(input_ids=ids, labels=ids).loss.backward()
    monkeypatch.undo()
    events = prof.events()
    nodes = [e for e in events if e.name == "lora_node"]

    def below(e):
        for c in e.cpu_children:
            yield c
            yield from below(c)
    calls = [c for n in nodes for c in below(n) if c.name.startswith("aten::") and not _inside_aten(c)]
    return len(nodes), len(calls)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_aten_calls_of_the_fused_lora_nodes_are_bounded(dtype, monkeypatch):
    from test_lora_fused import _pair

    from torchfuser.modules import residual_norm

    # The nodes' own calls: the norms' outputs, made again when a node's backward unpacks them, are the
    # norms' work (one rms_norm forward each), not the node's.
    monkeypatch.setattr(residual_norm, "_made_again", lambda *args: contextlib.nullcontext())
    _, fused = _pair("llama", dtype=dtype)
    torchfuser.optimize(fused, backend="reference")
    ids = torch.randint(0, 128, (2, 16), generator=torch.Generator().manual_seed(1))
    fused(input_ids=ids, labels=ids).loss.backward()  # lazy first-call work out of the count
    nodes, calls = _node_calls(monkeypatch, fused, ids)
    assert nodes == 2 * 8  # 8 forwards, 8 backwards
    assert calls <= BOUNDS[dtype], calls
