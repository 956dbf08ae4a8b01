"""optimize / restore / report on whole models: parity, state_dict, idempotence, errors."""
from __future__ import annotations

import copy

import pytest
import torch
from torch import nn
from transformers import LlamaConfig, LlamaForCausalLM

import torchfuser
from torchfuser.modules import FusedGatedMLP, FusedRMSNorm

from tiny_lm import loss_and_grads


def tiny_llama(seed=0, tied=False):
    cfg = LlamaConfig(hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
                      num_key_value_heads=2, vocab_size=128, attn_implementation="sdpa", tie_word_embeddings=tied)
    torch.manual_seed(seed)
    return LlamaForCausalLM(cfg)



def test_llama_parity_state_dict_and_restore():
    model = tiny_llama()
    ref = copy.deepcopy(model)
    ids = torch.randint(0, 128, (2, 9))
    originals = {n: m for n, m in model.named_modules()}
    params = {n: p for n, p in model.named_parameters()}
    out = torchfuser.optimize(model, backend="reference", patterns=["rms_norm", "gated_mlp"])
    assert out is model
    assert isinstance(model.model.norm, FusedRMSNorm) and isinstance(model.model.layers[0].mlp, FusedGatedMLP)
    # The very same Parameter objects, under the same names; identical state_dict.
    assert {n: id(p) for n, p in model.named_parameters()} == {n: id(p) for n, p in params.items()}
    sd, sd_ref = model.state_dict(), ref.state_dict()
    assert list(sd) == list(sd_ref) and all(torch.equal(sd[k], sd_ref[k]) for k in sd)
    loss, grads = loss_and_grads(model, ids)
    loss_ref, grads_ref = loss_and_grads(ref, ids)
    torch.testing.assert_close(loss, loss_ref, rtol=1e-5, atol=1e-6)
    assert grads.keys() == grads_ref.keys()
    for name in grads:
        torch.testing.assert_close(grads[name], grads_ref[name], rtol=1e-4, atol=1e-6, msg=name)
    # A fused model's checkpoint loads strictly into the plain class.
    plain = tiny_llama(seed=1)
    plain.load_state_dict(model.state_dict(), strict=True)
    torchfuser.restore(model)
    assert all(originals[n] is m for n, m in model.named_modules())


def test_report_counts_and_rendering():
    model = torchfuser.optimize(tiny_llama(), backend="reference", patterns=["rms_norm", "gated_mlp"])
    rep = torchfuser.report(model)
    counts = rep.counts()
    assert counts["rms_norm"] == {"fused": 5, "skipped": 0}
    assert counts["gated_mlp"] == {"fused": 2, "skipped": 0}
    text = str(rep)
    assert "model.layers.1.mlp" in text and "LlamaMLP → FusedGatedMLP" in text
    assert rep.to_dict()["counts"] == counts
    from rich.console import Console

    console = Console(record=True, width=200)
    console.print(rep)
    assert "model.layers.*.mlp" in console.export_text()


def test_idempotent():
    model = torchfuser.optimize(tiny_llama(), backend="reference")
    tree = [(n, type(m)) for n, m in model.named_modules()]
    before = str(torchfuser.report(model))
    torchfuser.optimize(model, backend="reference")
    assert [(n, type(m)) for n, m in model.named_modules()] == tree
    assert str(torchfuser.report(model)) == before


def test_exclude_and_patterns_select():
    model = torchfuser.optimize(tiny_llama(), backend="reference", exclude=["gated_mlp"])
    assert not isinstance(model.model.layers[0].mlp, FusedGatedMLP)
    assert isinstance(model.model.norm, FusedRMSNorm)
    model = torchfuser.optimize(tiny_llama(), backend="reference", patterns=["gated_mlp"])
    assert isinstance(model.model.layers[0].mlp, FusedGatedMLP)
    assert not isinstance(model.model.norm, FusedRMSNorm)


def test_restore_after_to_keeps_original_in_sync():
    model = torchfuser.optimize(tiny_llama(), backend="reference", patterns=["rms_norm"])
    model.to(torch.float64)
    torchfuser.restore(model)
    assert type(model.model.norm).__name__ == "LlamaRMSNorm"
    assert model.model.norm.weight.dtype == torch.float64


def test_restore_harmless_on_plain_model():
    model = tiny_llama()
    assert torchfuser.restore(model) is model
    assert "not called" in str(torchfuser.report(model))


def test_train_eval_mode_carries_over():
    model = tiny_llama().eval()
    torchfuser.optimize(model, backend="reference")
    assert not model.model.norm.training
    model.train()
    assert model.model.norm.training


class _NoBlocks(nn.Module):
    def __init__(self):
        super().__init__()
        self.proj = nn.Linear(4, 4)

    def forward(self, x):
        return self.proj(x)


def test_nothing_to_fuse():
    model = _NoBlocks()
    torchfuser.optimize(model)
    assert isinstance(model.proj, nn.Linear)
    assert "nothing to fuse" in str(torchfuser.report(model))


@pytest.mark.parametrize(
    "kwargs, error, words",
    [
        (dict(backend="cuda"), ValueError, "valid backends are auto, reference, triton, mlir"),
        (dict(patterns=["rmsnorm"]), ValueError, "valid patterns are"),
        (dict(exclude=["nope"]), ValueError, "unknown pattern"),
        (dict(patterns="rms_norm"), TypeError, "list or tuple"),
    ],
)
def test_bad_arguments(kwargs, error, words):
    with pytest.raises(error) as info:
        torchfuser.optimize(tiny_llama(), **kwargs)
    assert words in str(info.value)


def test_non_module_is_type_error():
    for fn in (torchfuser.optimize, torchfuser.restore, torchfuser.report):
        with pytest.raises(TypeError, match="torch.nn.Module"):
            fn("llama")


def test_named_backend_that_cannot_run_fails_at_optimize():
    with pytest.raises(RuntimeError, match="triton"):
        import os

        if os.environ.get("TRITON_INTERPRET"):
            pytest.skip("TRITON_INTERPRET lets triton run on the CPU")
        torchfuser.optimize(tiny_llama(), backend="triton")


def test_a_pattern_that_fails_on_a_module_skips_it_with_the_reason(monkeypatch):
    """An unforeseen module (transformers' per-layer configs raise on some attribute reads) must not
    stop the optimization of the rest of the model."""
    from torchfuser.patterns.norms import RMSNormPattern

    real = RMSNormPattern.match

    def match(self, module):
        if getattr(module, "_boom", False):
            raise RuntimeError("per-layer attribute")
        return real(self, module)

    monkeypatch.setattr(RMSNormPattern, "match", match)
    model = tiny_llama()
    model.model.norm._boom = True
    torchfuser.optimize(model, backend="reference")
    rep = torchfuser.report(model)
    entry = next(e for e in rep.entries if e.name == "model.norm")
    assert entry.fused is None and entry.reason == "could not be examined (RuntimeError: per-layer attribute)"
    assert rep.counts()["rms_norm"] == {"fused": 4, "skipped": 1}


@pytest.mark.parametrize("backend", ["reference", "auto"])
def test_a_model_saved_whole_loads_fused_and_restores(backend, tmp_path):
    """torch.save(model) of an optimized model: it loads fused, trains the same and can be restored."""
    model = torchfuser.optimize(tiny_llama(), backend=backend)
    torch.save(model, tmp_path / "model.pt")
    loaded = torch.load(tmp_path / "model.pt", weights_only=False)
    ids = torch.randint(0, 128, (2, 9), generator=torch.Generator().manual_seed(6))
    (la, ga), (lb, gb) = loss_and_grads(model, ids), loss_and_grads(loaded, ids)
    torch.testing.assert_close(lb, la, rtol=0, atol=0)
    assert all(torch.equal(ga[n], gb[n]) for n in ga)
    assert isinstance(loaded.model.norm, FusedRMSNorm)
    torchfuser.restore(loaded)
    assert not any(type(m).__name__.startswith("Fused") for m in loaded.modules())
    assert "forward" not in loaded.__dict__


@pytest.mark.skipif(not torch.cuda.is_available(), reason="host syncs are a CUDA matter")
@pytest.mark.parametrize("tied", [False, True])
@pytest.mark.parametrize("cuda_graphs", [False, True])
def test_a_fused_training_step_never_waits_for_the_gpu(cuda_graphs, tied, monkeypatch):
    """Once warm, a fused training step makes no host sync (no blocking copy, no value read back),
    so the host runs ahead of the GPU. transformers' own packed-sequence check, which reads a value
    on the host in every forward, is stubbed out."""
    from transformers import masking_utils

    model = tiny_llama(tied=tied).cuda().train()
    torchfuser.optimize(model, cuda_graphs=cuda_graphs)
    ids = torch.randint(0, 128, (2, 16), device="cuda")
    monkeypatch.setattr(masking_utils, "find_packed_sequence_indices", lambda position_ids: None)

    def step():
        with torch.autocast("cuda", dtype=torch.bfloat16):
            loss = model(input_ids=ids, labels=ids, use_cache=False).loss
        loss.backward()
        model.zero_grad(set_to_none=True)

    for _ in range(3):
        step()
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        step()
    finally:
        torch.cuda.set_sync_debug_mode(0)


def test_filter_fn_chooses_blocks_and_reports_the_others():
    model, seen = tiny_llama(), []

    def not_layer_0(module, name):  # torchao's order: the module, then its qualified name
        seen.append((name, module))
        return not name.startswith("model.layers.0.")

    torchfuser.optimize(model, backend="reference", filter_fn=not_layer_0)
    modules = dict(model.named_modules())
    assert all(modules[n] is m for n, m in seen if n.startswith("model.layers.0."))  # the refused, left in place
    rep = torchfuser.report(model)
    assert len(seen) == len(rep) and {n for n, _ in seen} == {e.name for e in rep.entries}  # each candidate, once
    excluded = {e.name for e in rep.skipped if e.reason == "excluded by filter_fn"}
    assert excluded and excluded == {n for n, _ in seen if n.startswith("model.layers.0.")}
    assert isinstance(model.model.layers[1].mlp, FusedGatedMLP) and not isinstance(model.model.layers[0].mlp, FusedGatedMLP)
    assert isinstance(model.model.norm, FusedRMSNorm)
    ids = torch.randint(0, 128, (2, 9), generator=torch.Generator().manual_seed(2))
    (loss, grads), (loss_ref, grads_ref) = loss_and_grads(model, ids), loss_and_grads(tiny_llama(), ids)
    torch.testing.assert_close(loss, loss_ref, rtol=1e-5, atol=1e-6)
    for name in grads_ref:
        torch.testing.assert_close(grads[name], grads_ref[name], rtol=1e-4, atol=1e-6, msg=name)


def test_filter_fn_exclusions_pass_strict_and_a_second_call_without_the_filter_fuses_them():
    model = torchfuser.optimize(tiny_llama(), backend="reference", strict=True,
                                filter_fn=lambda module, fqn: not isinstance(module, type(tiny_llama().model.norm)))
    rep = torchfuser.report(model)
    assert rep.counts()["rms_norm"] == {"fused": 0, "skipped": 5}
    # The layers' residual adds run inside their norms' kernels: with the norms excluded, so are they.
    layer = next(e for e in rep.entries if e.name == "model.layers.0")
    assert layer.reason.startswith("excluded by filter_fn, through its input_layernorm and post_attention_layernorm")
    torchfuser.optimize(model)  # the filter is kept: nothing new
    assert torchfuser.report(model).counts()["rms_norm"] == {"fused": 0, "skipped": 5}
    torchfuser.optimize(model, filter_fn=None)  # dropped: the norms are fused now
    assert torchfuser.report(model).counts()["rms_norm"] == {"fused": 5, "skipped": 0}


def test_filter_fn_must_be_callable():
    with pytest.raises(TypeError, match="filter_fn must be a callable"):
        torchfuser.optimize(tiny_llama(), filter_fn="model.layers.0")


def test_filter_fn_in_torchaos_order_fuses_what_it_accepts():
    mlp = type(tiny_llama().model.layers[0].mlp)
    model = torchfuser.optimize(tiny_llama(), backend="reference", filter_fn=lambda module, fqn: isinstance(module, mlp))
    counts = torchfuser.report(model).counts()
    assert counts["gated_mlp"]["fused"] == 2 and counts["rms_norm"]["fused"] == 0
    assert isinstance(model.model.layers[0].mlp, FusedGatedMLP)


@pytest.mark.parametrize("old", [
    lambda name, module: not name.startswith("model.layers.0."),  # AttributeError: a module has no startswith
    lambda name, module: "mlp" in name,  # TypeError: a module is not iterable
    lambda name, module: isinstance(module, type(tiny_llama().model.layers[0].mlp)),  # False for every block
], ids=["raises_attribute_error", "raises_type_error", "refuses_everything"])
def test_filter_fn_in_the_old_order_is_refused_with_the_new_order_named(old):
    model = tiny_llama()
    before = {n: type(m) for n, m in model.named_modules()}
    with pytest.raises(TypeError, match=r"filter_fn takes \(module, fqn\)"):
        torchfuser.optimize(model, backend="reference", filter_fn=old)
    assert {n: type(m) for n, m in model.named_modules()} == before  # nothing changed
    assert "forward" not in model.__dict__


def test_filter_fn_refusing_every_block_in_the_new_order_is_not_an_error():
    model = torchfuser.optimize(tiny_llama(), backend="reference", filter_fn=lambda module, fqn: False)
    rep = torchfuser.report(model)
    assert not rep.fused and all(e.reason == "excluded by filter_fn" or e.reason.startswith("excluded by filter_fn")
                                 for e in rep.skipped)


def test_a_kept_filter_fn_asked_only_about_blocks_it_refused_is_not_taken_for_the_old_order():
    """A second call asks the kept filter about the blocks not fused: all refused, and a filter
    ``not isinstance(module, ...)`` would accept them the other way round; that is no sign of the old order."""
    mlp = type(tiny_llama().model.layers[0].mlp)
    model = torchfuser.optimize(tiny_llama(), backend="reference", patterns=["gated_mlp", "rms_norm"],
                                filter_fn=lambda module, fqn: not isinstance(module, mlp))
    torchfuser.optimize(model)  # only the two MLPs are offered again, and refused
    assert torchfuser.report(model).counts()["gated_mlp"] == {"fused": 0, "skipped": 2}
