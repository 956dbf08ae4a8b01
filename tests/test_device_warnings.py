"""Options that do nothing useful on the model's device (fp8, cuda_graphs on the CPU) are said once, as a
UserWarning at the user's call; the default call and a later call that keeps them say nothing."""
from __future__ import annotations

import warnings

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM

import torchfuser


def tiny_llama():
    cfg = LlamaConfig(hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
                      num_key_value_heads=2, vocab_size=128, attn_implementation="sdpa")
    torch.manual_seed(0)
    return LlamaForCausalLM(cfg)


def optimize_and_catch(model, **kwargs) -> list[warnings.WarningMessage]:
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        torchfuser.optimize(model, backend="reference", **kwargs)
    return [w for w in caught if issubclass(w.category, UserWarning) and "optimize(" in str(w.message)]


@pytest.mark.parametrize("kwargs, words", [
    ({"fp8": "rowwise"}, ["optimize(fp8='rowwise')", "on the CPU", "emulated", "8.9"]),
    ({"cuda_graphs": True}, ["optimize(cuda_graphs=True)", "on the CPU", "CUDA device"]),
    ({"cuda_graphs": torchfuser.GraphOptions(max_buckets=2)}, ["optimize(cuda_graphs=GraphOptions(...))"]),
])
def test_an_option_idle_on_the_cpu_warns_once_at_the_users_call(kwargs, words):
    model = tiny_llama()
    filters = list(warnings.filters)
    caught = optimize_and_catch(model, **kwargs)
    assert len(caught) == 1, [str(w.message) for w in caught]
    assert all(word in str(caught[0].message) for word in words), str(caught[0].message)
    assert caught[0].filename == __file__  # points at the caller of optimize, not into torchfuser
    assert warnings.filters == filters
    assert torchfuser.report(model).fused, "the option is still applied (the model fused as asked)"
    # A later call that keeps the setting (TorchFuserCallback's optimize(model)) or passes it again: silent.
    assert optimize_and_catch(model) == []
    assert optimize_and_catch(model, **kwargs) == []
    torchfuser.restore(model)


def test_the_default_call_and_options_turned_off_do_not_warn():
    model = tiny_llama()
    assert optimize_and_catch(model) == []
    assert optimize_and_catch(model, fp8=None, cuda_graphs=False) == []
    torchfuser.restore(model)


def test_two_idle_options_in_one_call_are_two_warnings():
    model = tiny_llama()
    caught = optimize_and_catch(model, fp8="tensorwise", cuda_graphs=True)
    assert sorted(str(w.message).split("=")[0] for w in caught) == ["optimize(cuda_graphs", "optimize(fp8"]
    torchfuser.restore(model)
