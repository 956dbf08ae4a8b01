"""optimize(model) on a CPU without torch-mlir (CI's plain wheel): the default leaves to PyTorch every block whose
only fused form there is the reference backend's, slower than PyTorch, and says so; the fused LM head + loss
stays. An explicit backend="reference" still fuses everything. torch-mlir's absence is monkeypatched."""
from __future__ import annotations

import copy

import pytest
import torch
from rich.console import Console
from transformers import GPT2Config, GPT2LMHeadModel, LlamaConfig, LlamaForCausalLM

import torchfuser
from torchfuser import backends, demo
from torchfuser.backends import policy


@pytest.fixture
def no_mlir(monkeypatch):
    monkeypatch.setitem(backends._INSTALLED, "torch_mlir", False)


def _llama():
    torch.manual_seed(0)
    cfg = LlamaConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                      num_key_value_heads=2, vocab_size=128)
    return LlamaForCausalLM(cfg)


def _gpt2():
    torch.manual_seed(0)
    return GPT2LMHeadModel(GPT2Config(n_embd=64, n_layer=2, n_head=4, vocab_size=128, n_positions=32,
                                      resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0))


def _loss_and_grads(model, ids):
    model.zero_grad(set_to_none=True)
    loss = model(input_ids=ids, labels=ids, use_cache=False).loss
    loss.backward()
    return loss.detach(), {n: p.grad.clone() for n, p in model.named_parameters()}


@pytest.mark.parametrize("build", [_llama, _gpt2], ids=["llama", "gpt2"])
def test_default_without_mlir_fuses_the_lm_head_alone_and_says_why(no_mlir, build):
    base = build()
    model = torchfuser.optimize(copy.deepcopy(base))
    rep = torchfuser.report(model)
    assert [e.pattern for e in rep.fused] == ["lm_head_loss"]
    assert rep.fused[0].backend.startswith("reference (torch-mlir is not installed")
    others = [e for e in rep.entries if e.pattern != "lm_head_loss"]
    assert len(others) >= 4 and all(e.reason == policy.REASON for e in others), [e.reason for e in others]
    assert {e.pattern for e in others} >= {"attention"}
    assert any(n.startswith(policy.LEFT_TO_PYTORCH) and 'pip install ".[mlir]"' in n for n in rep.notes)
    for name, module in model.named_modules():  # the blocks left out are the originals, untouched
        if name and name in dict(base.named_modules()):
            assert type(module) is type(base.get_submodule(name)), name
    assert model.state_dict().keys() == base.state_dict().keys()
    ids = torch.randint(0, 128, (2, 16), generator=torch.Generator().manual_seed(1))
    (loss0, g0), (loss1, g1) = _loss_and_grads(base, ids), _loss_and_grads(model, ids)
    torch.testing.assert_close(loss1, loss0, rtol=1e-5, atol=1e-6)
    assert g0.keys() == g1.keys()
    for n in g0:
        torch.testing.assert_close(g1[n], g0[n], rtol=1e-4, atol=1e-6, msg=n)
    torchfuser.restore(model)
    assert all(type(m) is type(base.get_submodule(n)) for n, m in model.named_modules())


def test_explicit_reference_still_fuses_everything(no_mlir):
    model = torchfuser.optimize(_llama(), backend="reference")
    rep = torchfuser.report(model)
    assert not rep.skipped and {e.pattern for e in rep.fused} >= {"attention", "gated_mlp", "rms_norm", "lm_head_loss"}
    assert not any(n.startswith(policy.LEFT_TO_PYTORCH) for n in rep.notes)


def test_strict_lets_the_default_choice_pass(no_mlir):
    model = torchfuser.optimize(_llama(), strict=True)
    assert [e.pattern for e in torchfuser.report(model).fused] == ["lm_head_loss"]


def test_a_later_reference_call_fuses_the_blocks_left_out(no_mlir):
    model = torchfuser.optimize(_llama())
    torchfuser.optimize(model, backend="reference")
    rep = torchfuser.report(model)
    assert not rep.skipped and all(e.backend == "reference" for e in rep.fused)


def test_policy_applies_only_to_auto_on_a_cpu_without_its_compiled_backend(monkeypatch):
    cpu, meta = torch.device("cpu"), torch.device("meta")
    monkeypatch.setitem(backends._INSTALLED, "torch_mlir", True)
    assert policy.held("auto", cpu) is None
    monkeypatch.setitem(backends._INSTALLED, "torch_mlir", False)
    assert policy.held("auto", cpu) == policy.KEPT_WITHOUT_COMPILER
    assert policy.held("reference", cpu) is None and policy.held("auto", meta) is None
    assert policy.held("auto", None) is None
    # Options only fused blocks bring: the user asked for them, so nothing is left out.
    assert policy.held("auto", cpu, fp8="rowwise") is None and policy.held("auto", cpu, checkpointing=True) is None


def test_demo_reports_honestly_without_mlir(no_mlir, monkeypatch):
    monkeypatch.setitem(demo.SIZES, "cpu", demo.DemoSize(hidden=64, intermediate=128, layers=2, heads=4, kv_heads=2,
                                                        vocab=512, batch=2, seq=16))
    console = Console(record=True, width=400)
    results = demo.run(device="cpu", steps=4, console=console)
    text = console.export_text()
    assert "1 blocks fused" in text and policy.LEFT_TO_PYTORCH in text
    assert "torchfuser here: no compiled CPU backend" in text and "only lm_head_loss is fused" in text
    assert 'pip install ".[mlir]"' in text  # not eaten as rich markup
    assert "loss parity" in text and "speed-up" in text
    eager, fused = results["eager"]["losses"], results["torchfuser"]["losses"]
    assert max(abs(a - b) for a, b in zip(eager, fused)) < 1e-4


def test_demo_with_mlir_says_nothing_of_it(monkeypatch):
    monkeypatch.setitem(backends._INSTALLED, "torch_mlir", True)
    assert demo._held_note(torch.device("cpu"), "auto") is None
    assert demo._held_note(torch.device("cpu"), "reference") is None
