"""``model.set_experts_implementation(...)`` (transformers 5's experts dispatch) does not reach fused MoE
blocks: the report says so on every model with fused MoE blocks, says it again where the setting was
changed after optimize, and ``optimize(model, exclude=['moe'])`` gives transformers' experts back."""
from __future__ import annotations

import copy

import pytest
import torch

import torchfuser
from test_moe import _ids, _model
from test_optimize import tiny_llama
from torchfuser.modules.moe import FusedMoE

CASES = ["mixtral", "olmoe", "qwen3_moe"]


def _notes(model, words):
    return [n for n in torchfuser.report(model).notes if words in n]


@pytest.mark.parametrize("case", CASES)
def test_the_report_says_set_experts_implementation_does_not_reach_fused_blocks(case):
    ref = _model(case)
    model = torchfuser.optimize(copy.deepcopy(ref), backend="reference")
    blocks = [n for n, m in model.named_modules() if isinstance(m, FusedMoE)]
    assert blocks
    impl = model.config._experts_implementation
    (note,) = _notes(model, "fused MoE blocks run TorchFuser's grouped expert kernels")
    assert f"config._experts_implementation is {impl!r}" in note and "set_experts_implementation" in note
    assert not _notes(model, "was called after optimize")
    other = "eager" if impl != "eager" else "grouped_mm"
    model.set_experts_implementation(other)
    (changed,) = _notes(model, "was called after optimize")
    assert f"set_experts_implementation({other!r})" in changed and f"no effect on the {len(blocks)} fused MoE" in changed
    assert all(isinstance(model.get_submodule(n), FusedMoE) for n in blocks)  # still fused: it reached nothing
    # exclude=['moe']: the MoE blocks are transformers' again, and run what the setting says.
    torchfuser.optimize(model, exclude=["moe"])
    assert not any(isinstance(m, FusedMoE) for m in model.modules())
    assert not _notes(model, "fused MoE blocks") and not _notes(model, "was called after optimize")
    ref.set_experts_implementation(other)
    with torch.no_grad():
        torch.testing.assert_close(model(input_ids=_ids()).logits, ref(input_ids=_ids()).logits, rtol=1e-5, atol=1e-5)


def test_no_note_without_fused_moe_blocks():
    model = torchfuser.optimize(tiny_llama(), backend="reference")
    assert not _notes(model, "MoE")
