"""Skip reasons a user can act on: what the block is and why it is not reproduced, in words (not a
probe's exception or a search's jargon). One tiny model per kind of reason."""
from __future__ import annotations

import pytest
import torch
from transformers import AutoModelForCausalLM

import torchfuser

from arch_sweep import tiny_config


@pytest.mark.parametrize("model_type, pattern, words", [
    ("bert", "attention", "q, k and v projections (query, key, value) and no output projection"),
    ("gpt_oss", "attention", "attention sinks (a learned logit per head in the softmax's denominator): 'sinks'"),
    ("deepseek_v2", "attention", "fit no layout the fused attention has: q, k and v read from the hidden states"),
    ("afmoe", "attention", "more projections than those mean an output gate"),
    ("ministral3", "attention", "Ministral3Attention's forward requires 'position_ids'"),
    ("openai-gpt", "attention", "its model chooses no attention implementation"),
    ("xlnet", "mlp", "unrecognised submodules ['layer_norm'] ('layer_norm' (LayerNorm))"),
    ("minimax", "residual_norm", "something sits between the blocks"),
])
def test_reason_in_words(model_type, pattern, words):
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(tiny_config(model_type))
    torchfuser.optimize(model, backend="reference")
    reasons = {e.reason for e in torchfuser.report(model).skipped if e.pattern == pattern}
    assert any(words in r for r in reasons), reasons
    assert not any(r.startswith(("probe forward failed", "projection shapes fit")) for r in reasons)
