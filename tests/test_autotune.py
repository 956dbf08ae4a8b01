"""autotune.apply's mechanics under a fake clock: what it keeps, where it puts originals back, the
report, the cache, restore. The real clock is never asserted on."""
from __future__ import annotations

import copy

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM

import torchfuser
from torchfuser import autotune
from torchfuser.modules.base import FusedModule


@pytest.fixture(autouse=True)
def _fresh_cache():
    autotune.clear()
    yield
    autotune.clear()


def _model(layers=2):
    cfg = LlamaConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=layers, num_attention_heads=4,
                      num_key_value_heads=2, vocab_size=128, attn_implementation="sdpa")
    torch.manual_seed(0)
    return LlamaForCausalLM(cfg)


_KIND = {"FusedAttention": "attention", "FusedGatedMLP": "gated_mlp", "FusedRMSNorm": "rms_norm",
         "LlamaAttention": "attention", "LlamaMLP": "gated_mlp", "LlamaRMSNorm": "rms_norm"}


def _fake_clock(monkeypatch, original_faster: set[str], slow=2.0):
    """The faster of a block and its original takes 1 s, the other ``slow`` s: the fused one is faster
    but for the kinds in ``original_faster``. Returns the list of timed classes."""
    calls = []

    def fake(module, args, kwargs, device):
        calls.append(type(module).__name__)
        fast_one_is_fused = _KIND[type(module).__name__] not in original_faster
        return 1.0 if isinstance(module, FusedModule) == fast_one_is_fused else slow

    monkeypatch.setattr(autotune, "time_call", fake)
    return calls


IDS = torch.randint(0, 128, (2, 12), generator=torch.Generator().manual_seed(1))


def test_keeps_original_where_faster_and_same_training(monkeypatch):
    _fake_clock(monkeypatch, {"attention", "rms_norm"})
    ref, model = _model(), _model()
    originals = {n: m for n, m in model.named_modules()}
    keys = list(model.state_dict())
    torchfuser.optimize(model)
    autotune.apply(model)
    loss = model(input_ids=IDS, labels=IDS).loss  # the default KV cache is on: every layer must still decide
    loss.backward()
    ref_loss = ref(input_ids=IDS, labels=IDS).loss
    ref_loss.backward()
    torch.testing.assert_close(loss, ref_loss, rtol=1e-5, atol=1e-6)
    # The probes' gradients went nowhere: every .grad is the training step's alone.
    for (n, p), (_, q) in zip(ref.named_parameters(), model.named_parameters()):
        torch.testing.assert_close(q.grad, p.grad, rtol=1e-4, atol=1e-6, msg=n)
    layers = model.model.layers
    assert all(type(l.self_attn).__name__ == "LlamaAttention" for l in layers)
    assert all(type(l.mlp).__name__ == "FusedGatedMLP" for l in layers)
    assert type(model.model.norm).__name__ == "LlamaRMSNorm"
    # Norms a fused residual-add layer calls by method are left fused, untimed.
    assert all(type(l.input_layernorm).__name__ == "FusedRMSNorm" for l in layers)
    rep = torchfuser.report(model)
    assert any(n.startswith("autotune: attention kept original: fused 0.50×") for n in rep.notes)
    assert any(n.startswith("autotune: gated_mlp kept fused: fused 2.00×") for n in rep.notes)
    kept = {e.name for e in rep.skipped if e.reason.startswith("autotune kept the original")}
    assert kept == {"model.layers.0.self_attn", "model.layers.1.self_attn", "model.norm"}
    assert list(model.state_dict()) == keys
    torchfuser.restore(model)
    assert all(m is originals[n] for n, m in model.named_modules())
    assert not any(isinstance(m, FusedModule) for m in model.modules())


def test_decision_cached_per_shape(monkeypatch):
    calls = _fake_clock(monkeypatch, {"gated_mlp"})
    for _ in range(2):
        model = torchfuser.optimize(_model())
        autotune.apply(model)
        model(input_ids=IDS, labels=IDS, use_cache=False).loss.backward()
        assert all(type(l.mlp).__name__ == "LlamaMLP" for l in model.model.layers)
    first = len(calls)
    assert first == 2 * 5 * 3  # 5 alternated runs of fused and original, three kinds, the first model only
    model = torchfuser.optimize(_model())
    autotune.apply(model)
    ids = IDS[:, :7]  # another shape: decided anew
    model(input_ids=ids, labels=ids, use_cache=False).loss.backward()
    assert len(calls) == 2 * first
    assert len(autotune.decisions()) == 6


def test_waits_for_a_training_call(monkeypatch):
    calls = _fake_clock(monkeypatch, {"attention", "gated_mlp", "rms_norm"})
    model = torchfuser.optimize(_model())
    autotune.apply(model)
    with torch.no_grad():
        model(input_ids=IDS)
    model.eval()
    model(input_ids=IDS)
    assert not calls and isinstance(model.model.layers[0].mlp, FusedModule)
    model.train()
    model(input_ids=IDS, labels=IDS).loss.backward()
    assert calls and not isinstance(model.model.layers[0].mlp, FusedModule)


def test_real_clock_runs(monkeypatch):
    """The real timer end to end, on one layer: whichever it keeps, the loss is the eager one."""
    ref, model = _model(1), torchfuser.optimize(_model(1))
    autotune.apply(model, repeats=1)
    loss = model(input_ids=IDS, labels=IDS).loss
    torch.testing.assert_close(loss, ref(input_ids=IDS, labels=IDS).loss, rtol=1e-5, atol=1e-6)
    assert len(autotune.decisions()) == 3
    assert sum(n.startswith("autotune: ") and " kept " in n for n in torchfuser.report(model).notes) == 3


def test_needs_an_optimized_model():
    with pytest.raises(ValueError, match="optimize"):
        autotune.apply(_model(1))


def test_reapply_and_copy(monkeypatch):
    calls = _fake_clock(monkeypatch, {"rms_norm"})
    model = torchfuser.optimize(_model(1))
    autotune.apply(model)
    autotune.apply(model)  # the first call's hooks go: one decision per block, not two
    twin = copy.deepcopy(model)
    model(input_ids=IDS, labels=IDS).loss.backward()
    assert len(calls) == 2 * 5 * 3
    twin(input_ids=IDS, labels=IDS).loss.backward()  # its own hooks, the cached decisions
    assert len(calls) == 2 * 5 * 3
    assert type(twin.model.norm).__name__ == "LlamaRMSNorm"


def test_within_margin_keeps_fused(monkeypatch):
    _fake_clock(monkeypatch, {"attention", "gated_mlp", "rms_norm"}, slow=1.02)  # originals 2% faster: noise
    model = torchfuser.optimize(_model(1))
    autotune.apply(model)
    model(input_ids=IDS, labels=IDS).loss.backward()
    assert sum(isinstance(m, FusedModule) for m in model.modules()) == 5  # attention, mlp, three norms
    autotune.clear()
    model = torchfuser.optimize(_model(1))
    autotune.apply(model, margin=0.0)
    model(input_ids=IDS, labels=IDS).loss.backward()
    assert type(model.model.layers[0].mlp).__name__ == "LlamaMLP"


def test_optimize_autotune_true_is_apply(monkeypatch):
    _fake_clock(monkeypatch, {"gated_mlp"})
    model = torchfuser.optimize(_model(layers=1), autotune=True)
    model(input_ids=IDS, labels=IDS).loss.backward()
    assert type(model.model.layers[0].mlp).__name__ == "LlamaMLP"
    assert any(n.startswith("autotune: gated_mlp kept original") for n in torchfuser.report(model).notes)
