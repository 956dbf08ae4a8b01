"""torchao NF4 bases (``to_nf4``) in the fused blocks (modules/adapters/torchao_nf4.py): the dequantisation bit for
bit against torchao's own (reference backend; the Triton kernel under TRITON_INTERPRET=1 in
tests/backends/test_dequant_4bit.py), and a tiny Llama / Qwen2 (q/k/v biases) whose seven projections hold NF4Tensor
weights under PEFT LoRA: one training step fused vs PEFT's unfused model, loss and every adapter gradient (fp32:
rtol 1e-5; bf16: DESIGN.md's rule against the float64 model on the dequantised weights), no gradient for the base,
no dequantised weight kept for the backward, the report, restore and state_dict keys. Skipped without torchao."""
from __future__ import annotations

import warnings

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM, Qwen2Config, Qwen2ForCausalLM

import torchfuser
from numerics import assert_within_rule
from torchfuser.backends.reference import dequant_4bit as R
from torchfuser.modules import FusedAttention, FusedGatedMLP, fallbacks
from torchfuser.modules.adapters import lora, quantized_base, torchao_nf4

peft = pytest.importorskip("peft")
with warnings.catch_warnings():
    warnings.simplefilter("ignore")
    ao = pytest.importorskip("torchao.quantization")
to_nf4 = getattr(ao, "to_nf4", None)
if to_nf4 is None:
    to_nf4 = pytest.importorskip("torchao.dtypes").to_nf4  # torchao < 0.15

ALL = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
_CFG = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
            vocab_size=160)
_ARCH = {"llama": (LlamaConfig, LlamaForCausalLM), "qwen2": (Qwen2Config, Qwen2ForCausalLM)}
F32, BF16, F64 = torch.float32, torch.bfloat16, torch.float64
_LORA = dict(r=4, lora_alpha=8, target_modules=ALL, lora_dropout=0.0, init_lora_weights=False)


@pytest.mark.parametrize("dtype", [F32, BF16, torch.float16], ids=str)
@pytest.mark.parametrize("blocks", [(64, 256), (32, 16)], ids=lambda b: f"{b[0]}-{b[1]}")
def test_dequantisation_bit_exact_against_torchao(dtype, blocks):
    w = torch.randn(128, 256, generator=torch.Generator().manual_seed(0)).to(dtype)
    nf4 = to_nf4(w, *blocks)
    want = nf4.get_original_weight()
    packed, absmax, code, bs = torchao_nf4.operands(nf4)
    got = R.dequantize_4bit_fwd(packed, absmax, code, bs, 128, 256, dtype)
    assert got.dtype == want.dtype == dtype and torch.equal(got, want), (got.float() - want.float()).abs().max()
    layer = torch.nn.Linear(256, 128, bias=False, dtype=dtype)
    layer.weight = torch.nn.Parameter(nf4, requires_grad=False)
    assert quantized_base.kind(layer) == "NF4" and quantized_base.unsupported(layer) is None
    assert torch.equal(quantized_base.dequantize(layer, F32, "reference"), want.float())


def _model(kind, dtype, blocks=(64, 32)):
    torch.manual_seed(0)
    cfg_cls, model_cls = _ARCH[kind]
    model = model_cls(cfg_cls(**_CFG, attn_implementation="sdpa")).to(dtype)
    for name, m in model.named_modules():
        if name.rsplit(".", 1)[-1] in ALL:
            m.weight = torch.nn.Parameter(to_nf4(m.weight.detach(), *blocks), requires_grad=False)
    torch.manual_seed(1)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return peft.get_peft_model(model, peft.LoraConfig(**_LORA)).train()


def _ids():
    return torch.randint(0, 160, (2, 12), generator=torch.Generator().manual_seed(1))


def _step(model):
    out = model(input_ids=_ids(), labels=_ids())
    out.loss.backward()
    return out.loss.detach(), {n: p.grad for n, p in model.named_parameters() if p.grad is not None}


def _spy(monkeypatch):
    calls, real = [], lora._LoRALinear.apply
    monkeypatch.setattr(lora._LoRALinear, "apply", lambda *a: calls.append(1) or real(*a))
    return calls


def _twin64(kind, ref):
    """The same PEFT model in float64 on the dequantised base weights: the reference."""
    torch.manual_seed(0)
    cfg_cls, model_cls = _ARCH[kind]
    twin = model_cls(cfg_cls(**_CFG, attn_implementation="sdpa"))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        twin = peft.get_peft_model(twin, peft.LoraConfig(**_LORA)).to(F64)
    with torch.no_grad():
        for name, m in ref.named_modules():
            if quantized_base.kind(m):
                twin.get_submodule(name).weight.copy_(m.weight.get_original_weight().double())
        for name, p in ref.named_parameters():
            twin.get_parameter(name).copy_(p.double())
    return twin.train()


@pytest.mark.parametrize("kind,dtype,blocks", [("llama", F32, (64, 32)), ("qwen2", F32, (32, 16)),
                                               ("llama", BF16, (64, 32))], ids=lambda v: str(v).replace("torch.", ""))
def test_fused_matches_peft(kind, dtype, blocks, monkeypatch):
    ref = _model(kind, dtype, blocks)
    fused = torchfuser.optimize(_model(kind, dtype, blocks), backend="reference")
    layer = fused.base_model.model.model.layers[0]
    assert isinstance(layer.self_attn, FusedAttention) and isinstance(layer.mlp, FusedGatedMLP)
    assert list(fused.state_dict()) == list(ref.state_dict())
    notes = [n for n in torchfuser.report(fused).notes if n.startswith("adapters: ")]
    assert notes and all(n.endswith("fused with LoRA r=4 over NF4 base") for n in notes), notes
    calls, saved = _spy(monkeypatch), []
    with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append((tuple(t.shape), t.dtype)) or t, lambda t: t):
        lf, gf = _step(fused)
    lr, gr = _step(ref)
    assert len(calls) == 8 and not fallbacks.counts(fused)
    assert gr and all("lora_" in n for n in gr) and list(gf) == list(gr)  # the base: no gradient
    if dtype == F32:
        torch.testing.assert_close(lf, lr, rtol=1e-5, atol=1e-6)
        for n in gr:
            torch.testing.assert_close(gf[n], gr[n], rtol=1e-5, atol=1e-6, msg=n)
    else:
        l64, g64 = _step(_twin64(kind, ref))
        assert_within_rule(lf, lr, l64, 1e-3, "loss")
        for n in gr:
            assert_within_rule(gf[n], gr[n], g64[n], 2 ** -7 * g64[n].abs().max().item(), n)
    # r=4: no adapter operand (the hi/lo split A of a joint projection: [2·terms·r × in]) has a base's shape
    dq = {(m.out_features, m.in_features) for m in fused.modules() if quantized_base.kind(m)}
    dq |= {(128, 64), (256, 64)}  # the joint q/k/v and gate/up
    assert not [s for s, dt in saved if s in dq and dt.is_floating_point], "a dequantised base kept for the backward"
    torchfuser.restore(fused)
    assert torchao_nf4.is_nf4(fused.base_model.model.model.layers[0].mlp.up_proj.base_layer.weight)
    assert list(fused.state_dict()) == list(ref.state_dict())


def test_wrong_scales_are_caught(monkeypatch):
    """The rule has teeth: scales off by their mean (the double quantisation half undone) fail the comparison."""
    ref = _model("llama", F32)
    fused = torchfuser.optimize(_model("llama", F32), backend="reference")
    real = torchao_nf4.scales
    monkeypatch.setattr(torchao_nf4, "scales", lambda w: real(w) - w.scaler_mean)
    with pytest.raises(AssertionError):
        torch.testing.assert_close(_step(fused)[0], _step(ref)[0], rtol=1e-5, atol=1e-6)


def test_under_autocast_runs_as_peft_layers_counted():
    """torchao's result dtype under autocast depends on the bias: not reproduced, PEFT's layers run (counted)."""
    ref = _model("llama", F32)
    fused = torchfuser.optimize(_model("llama", F32), backend="reference")
    with torch.autocast("cpu", dtype=BF16):
        lf, lr = _step(fused)[0], _step(ref)[0]
    torch.testing.assert_close(lf, lr, rtol=1e-3, atol=1e-3)
    assert "torchao NF4 base under autocast" in " ".join(fallbacks.notes(fused))
