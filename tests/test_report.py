"""A report that tells the truth: a block reported fused runs fused, or the report counts the calls
that did not (with the reason); the report is found through wrappers (PEFT, DDP, torch.compile)."""
from __future__ import annotations

import copy

import pytest
import torch
import torch.distributed as dist
from transformers import LlamaConfig, LlamaForCausalLM

import torchfuser
from torchfuser.modules import FusedRMSNorm
from torchfuser.modules.residual_norm import ResidualNormForward


def _llama():
    cfg = LlamaConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                      num_key_value_heads=2, vocab_size=128, attn_implementation="sdpa")
    torch.manual_seed(0)
    return LlamaForCausalLM(cfg)


IDS = torch.randint(0, 128, (2, 8), generator=torch.Generator().manual_seed(1))


def _fallback_notes(model):
    return [n for n in torchfuser.report(model).notes if n.startswith("fallback: ")]


def test_residual_norm_without_fused_norms_is_skipped_not_reported_fused():
    model = torchfuser.optimize(_llama(), exclude=["rms_norm"], backend="reference")
    entries = [e for e in torchfuser.report(model).entries if e.pattern == "residual_norm"]
    assert len(entries) == 2 and not any(e.is_fused for e in entries)
    assert all("rms_norm pattern is not selected" in e.reason for e in entries)
    assert all("forward" not in layer.__dict__ for layer in model.model.layers)
    model(input_ids=IDS)
    assert not _fallback_notes(model)


def test_residual_norm_on_norms_fused_earlier_is_fused():
    model = torchfuser.optimize(_llama(), patterns=["rms_norm"], backend="reference")
    norm = model.model.layers[0].input_layernorm
    torchfuser.optimize(model, patterns=["rms_norm", "residual_norm"])  # the norms stay: the layers adopt them
    assert model.model.layers[0].input_layernorm is norm
    assert all(isinstance(layer.__dict__.get("forward"), ResidualNormForward) for layer in model.model.layers)
    assert isinstance(model.model.layers[0].input_layernorm, FusedRMSNorm)


def test_fused_runs_count_nothing_and_fallbacks_are_counted_with_the_reason():
    ref = _llama()
    model = torchfuser.optimize(copy.deepcopy(ref), backend="reference")
    model(input_ids=IDS)
    assert not _fallback_notes(model) and torchfuser.report(model).fallbacks == {}
    out = model(input_ids=IDS, output_attentions=True)
    torch.testing.assert_close(out.logits, ref(input_ids=IDS).logits, rtol=1e-5, atol=1e-5)
    model(input_ids=IDS, output_attentions=True)
    rep = torchfuser.report(model)
    why = "output_attentions=True (SDPA never forms the attention weights)"
    assert rep.fallbacks == {f"model.layers.{i}.self_attn": {why: 2} for i in range(2)}
    notes = _fallback_notes(model)
    assert notes == [f"fallback: model.layers.*.self_attn (2 modules): 4 calls left the fused path: {why}"]
    assert rep.to_dict()["fallbacks"] == rep.fallbacks
    assert str(rep).count("fallback: ") == 1  # refreshed, not appended again


def test_residual_norm_fallback_is_counted():
    model = torchfuser.optimize(_llama(), backend="reference")
    model.model.layers[1].post_attention_layernorm.register_forward_hook(lambda *a: None)
    model(input_ids=IDS)
    assert torchfuser.report(model).fallbacks == {
        "model.layers.1": {"hooks (or a forward of their own) on its norms: the fused path would skip them": 1}}
    torchfuser.restore(model)
    assert not any("_torchfuser_fallbacks" in m.__dict__ for m in model.modules())


def test_unoptimized_model():
    rep = torchfuser.report(_llama())
    assert len(rep) == 0 and "not called on this model, nor on any module inside it" in rep.notes[0]


def _seen_through(wrapper, inner_path: str):
    rep = torchfuser.report(wrapper)
    assert rep.model_type == "LlamaForCausalLM" and rep.counts()["attention"]["fused"] == 2
    assert any(f"optimize was called on {inner_path!r} (LlamaForCausalLM)" in n for n in rep.notes)
    return rep


def test_report_sees_through_peft():
    peft = pytest.importorskip("peft")
    model = torchfuser.optimize(_llama(), backend="reference")
    wrapped = peft.get_peft_model(model, peft.LoraConfig(r=4, target_modules=["q_proj"]))
    assert "nothing to fuse" not in torchfuser.report(wrapped).summary()
    _seen_through(wrapped, "base_model.model")
    # optimize given the PeftModel itself: its own report, no note
    wrapped = torchfuser.optimize(peft.get_peft_model(_llama(), peft.LoraConfig(r=4, target_modules=["q_proj"])))
    assert torchfuser.report(wrapped).model_type == "PeftModel"


def test_report_sees_through_torch_compile_and_data_parallel():
    model = torchfuser.optimize(_llama(), backend="reference")
    _seen_through(torch.compile(model), "_orig_mod")
    model(input_ids=IDS, output_attentions=True)  # counts reach the wrapper's report too
    assert len(_seen_through(torch.compile(model), "_orig_mod").fallbacks) == 2
    _seen_through(torch.nn.DataParallel(model), "module")  # last: on one GPU it moves the model there


@pytest.mark.skipif(not dist.is_available(), reason="torch.distributed is not available")
def test_report_sees_through_ddp(tmp_path):
    from torch.nn.parallel import DistributedDataParallel

    dist.init_process_group("gloo", init_method=f"file://{tmp_path}/store", rank=0, world_size=1)
    try:
        wrapped = DistributedDataParallel(torchfuser.optimize(_llama(), backend="reference"))
        _seen_through(wrapped, "module")
    finally:
        dist.destroy_process_group()
