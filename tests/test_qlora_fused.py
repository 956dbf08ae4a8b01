"""QLoRA inside the fused blocks (modules/adapters/quantized_base.py, modules/adapters/lora.py): tiny Llama and Qwen2 (q/k/v
biases) checkpoints quantised by transformers' BitsAndBytesConfig on the CPU (NF4, FP4, double
quantisation, int8), prepare_model_for_kbit_training + PEFT LoRA on all seven projections. One training
step fused vs PEFT's unfused model: the loss and every adapter gradient (fp32 compute: rtol 1e-5; bf16
compute: DESIGN.md's rule against the same model in float64 on the dequantised weights), no gradient
for the base, no dequantised weight kept for the backward, the report, restore and state_dict keys.

Dimensions are multiples of the 64-element quantisation block: bitsandbytes 0.50's CPU dequantisation
kernel reads blocks per row, where its quantiser (and its CUDA kernels) lay them out over the flattened
weight, so rows that do not fill whole blocks come back wrong from bitsandbytes itself on the CPU
(docs/performance/NOTES-qlora.md); the fused path dequantises as the quantiser wrote.
"""
from __future__ import annotations

import copy
import warnings

import pytest
import torch
from transformers import AutoModelForCausalLM, LlamaConfig, LlamaForCausalLM, Qwen2Config, Qwen2ForCausalLM

import torchfuser
from torchfuser.modules import FusedAttention, FusedGatedMLP, fallbacks
from torchfuser.modules.adapters import lora, quantized_base
from torchfuser.modules.base import FusedModule
from numerics import assert_within_rule

bnb = pytest.importorskip("bitsandbytes")
peft = pytest.importorskip("peft")
from transformers import BitsAndBytesConfig  # noqa: E402

ALL = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
_CFG = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
            vocab_size=160)
_ARCH = {"llama": (LlamaConfig, LlamaForCausalLM), "qwen2": (Qwen2Config, Qwen2ForCausalLM)}
F32, BF16 = torch.float32, torch.bfloat16
QUANTS = {
    "nf4": dict(load_in_4bit=True, bnb_4bit_quant_type="nf4"),
    "nf4-double": dict(load_in_4bit=True, bnb_4bit_quant_type="nf4", bnb_4bit_use_double_quant=True),
    "fp4": dict(load_in_4bit=True, bnb_4bit_quant_type="fp4"),
    "fp4-double": dict(load_in_4bit=True, bnb_4bit_quant_type="fp4", bnb_4bit_use_double_quant=True),
    "int8": dict(load_in_8bit=True),
}
_LORA = dict(r=16, lora_alpha=32, target_modules=ALL, lora_dropout=0.0, init_lora_weights=False)


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    out = {}
    for kind, (cfg_cls, model_cls) in _ARCH.items():
        torch.manual_seed(0)
        path = tmp_path_factory.mktemp(kind)
        model_cls(cfg_cls(**_CFG, attn_implementation="sdpa")).save_pretrained(path)
        out[kind] = path
    return out


def _load(path, quant, compute=F32, dtype=F32, prepare=True, checkpointing=False, **lora_kw):
    kw = dict(QUANTS[quant])
    if "load_in_4bit" in kw:
        kw["bnb_4bit_compute_dtype"] = compute
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        model = AutoModelForCausalLM.from_pretrained(path, quantization_config=BitsAndBytesConfig(**kw),
                                                     device_map="cpu", dtype=dtype)
        if prepare:
            model = peft.prepare_model_for_kbit_training(model, use_gradient_checkpointing=checkpointing)
    torch.manual_seed(1)
    model = peft.get_peft_model(model, peft.LoraConfig(**dict(_LORA, **lora_kw)))
    return model.train()


def _ids():
    return torch.randint(0, 160, (2, 12), generator=torch.Generator().manual_seed(1))


def _step(model, seed=3):
    torch.manual_seed(seed)
    out = model(input_ids=_ids(), labels=_ids())
    out.loss.backward()
    return out.loss.detach(), {n: p.grad for n, p in model.named_parameters() if p.grad is not None}


class _Spy:
    def __init__(self, monkeypatch):
        self.calls, real = 0, lora._LoRALinear.apply

        def apply(*args):
            self.calls += 1
            return real(*args)
        monkeypatch.setattr(lora._LoRALinear, "apply", apply)


def _dequantised_shapes(model):
    """Every [rows × in] a base (or a joint q/k/v, gate/up) would have dequantised."""
    shapes = set()
    for m in model.modules():
        names = [n for n in ALL if isinstance(getattr(m, n, None), torch.nn.Module)]
        bases = [lora.base_of(getattr(m, n)) for n in names]
        shapes |= {(b.out_features, b.in_features) for b in bases}
        for group in (("q_proj", "k_proj", "v_proj"), ("gate_proj", "up_proj")):
            if all(n in names for n in group):
                shapes.add((sum(lora.base_of(getattr(m, n)).out_features for n in group), _CFG["hidden_size"]))
    return shapes


# FP4 with double quantisation: its dequantisation is checked bit for bit in tests/backends/test_dequant_4bit.py
# (the nesting is the same code for both formats); the whole model would add ~8 s of bitsandbytes' compiles.
@pytest.mark.parametrize("kind,quant", [("llama", q) for q in QUANTS if q != "fp4-double"] + [("qwen2", "nf4-double")])
def test_fused_and_exact_in_fp32(kind, quant, checkpoints, monkeypatch):
    ref = _load(checkpoints[kind], quant)
    fused = torchfuser.optimize(copy.deepcopy(ref), backend="reference")
    layer = fused.base_model.model.model.layers[0]
    assert isinstance(layer.self_attn, FusedAttention) and isinstance(layer.mlp, FusedGatedMLP)
    assert list(fused.state_dict()) == list(ref.state_dict())
    fmt = {"int8": "int8"}.get(quant, quant[:3].upper())
    assert layer.mlp.lora_summary == f"LoRA r=16 over {fmt} base"
    notes = [n for n in torchfuser.report(fused).notes if n.startswith("adapters: ")]
    assert notes and all(n.endswith(f"fused with LoRA r=16 over {fmt} base") for n in notes)
    spy, saved = _Spy(monkeypatch), []
    with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append((tuple(t.shape), t.dtype)) or t, lambda t: t):
        (lf, gf) = _step(fused)
    (lr, gr) = _step(ref)
    assert spy.calls == 8 and not fallbacks.counts(fused)
    torch.testing.assert_close(lf, lr, rtol=1e-5, atol=1e-6)
    assert gr and all("lora_" in n for n in gr) and list(gf) == list(gr)  # the base: no gradient
    for n in gr:
        torch.testing.assert_close(gf[n], gr[n], rtol=1e-5, atol=1e-6, msg=n)
    dq = _dequantised_shapes(fused)
    assert not [s for s, dt in saved if s in dq and dt.is_floating_point], "a dequantised base kept for the backward"
    torchfuser.restore(fused)
    layer = fused.base_model.model.model.layers[0]
    assert not any(isinstance(m, FusedModule) for m in fused.modules())
    assert quantized_base.kind(layer.mlp.up_proj.base_layer) == fmt and list(fused.state_dict()) == list(ref.state_dict())


def test_optimize_first_then_peft_and_prepares_checkpointing(checkpoints, monkeypatch):
    """optimize on the quantised model, then prepare_model_for_kbit_training with its default gradient
    checkpointing and get_peft_model: the blocks stay fused and the step is PEFT's (the other order with
    checkpointing included)."""
    ref = _load(checkpoints["llama"], "nf4", checkpointing=True)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        model = AutoModelForCausalLM.from_pretrained(checkpoints["llama"], device_map="cpu", dtype=F32,
                                                     quantization_config=BitsAndBytesConfig(**QUANTS["nf4"]))
        model = peft.prepare_model_for_kbit_training(torchfuser.optimize(model, backend="reference"))
    torch.manual_seed(1)
    fused = peft.get_peft_model(model, peft.LoraConfig(**_LORA)).train()
    assert fused.is_gradient_checkpointing and ref.is_gradient_checkpointing
    spy = _Spy(monkeypatch)
    (lf, gf), (lr, gr) = _step(fused), _step(ref)
    assert spy.calls == 16 and not fallbacks.counts(fused)  # 8 nodes, run again by the checkpointed backward
    torch.testing.assert_close(lf, lr, rtol=1e-5, atol=1e-6)
    assert list(gf) == list(gr)
    for n in gr:
        torch.testing.assert_close(gf[n], gr[n], rtol=1e-5, atol=1e-6, msg=n)


def _float64_twin(path, kind, ref):
    """The PEFT model on the dequantised base weights, every tensor in float64: the reference."""
    torch.manual_seed(1)
    twin = peft.get_peft_model(_ARCH[kind][1].from_pretrained(path, dtype=torch.float64), peft.LoraConfig(**_LORA))
    with torch.no_grad():
        for name, m in ref.named_modules():
            if quantized_base.kind(m):
                twin.get_submodule(name).weight.copy_(quantized_base.dequantize(m, F32).double())
        for name, p in ref.named_parameters():
            if "lora_" in name:
                twin.get_parameter(name).copy_(p.double())
    return twin.train()


@pytest.mark.parametrize("case", ["fp32-model-bf16-compute", "bf16-model"])
def test_bf16_compute_within_the_rule(case, checkpoints, monkeypatch):
    """bf16 base GEMMs: on a prepared (fp32) model with compute_dtype=bf16, and on a bf16 model with fp32
    adapters (the node's hi/lo adapter products); DESIGN.md's rule against float64 on the same Ŵ."""
    bf16_model = case == "bf16-model"
    ref = _load(checkpoints["llama"], "nf4-double", compute=BF16, dtype=BF16 if bf16_model else F32,
                prepare=not bf16_model)
    fused = torchfuser.optimize(copy.deepcopy(ref), backend="reference")
    ref64 = _float64_twin(checkpoints["llama"], "llama", ref)
    spy = _Spy(monkeypatch)
    (lf, gf), (ls, gs), (l64, g64) = _step(fused), _step(ref), _step(ref64)
    assert spy.calls == 8 and not fallbacks.counts(fused)
    assert_within_rule(lf, ls, l64, 1e-3, "loss")
    assert list(gf) == list(g64)
    for n in g64:
        assert_within_rule(gf[n], gs[n], g64[n], 2 ** -7 * g64[n].abs().max().item(), n)


def test_the_rule_has_teeth(checkpoints, monkeypatch):
    """A base dequantised with the wrong code table (FP4's for NF4) fails the comparison."""
    ref = _load(checkpoints["llama"], "nf4")
    fused = torchfuser.optimize(copy.deepcopy(ref), backend="reference")
    fp4 = bnb.functional.get_4bit_type("fp4", device="cpu")
    real = quantized_base.dequantize_4bit
    monkeypatch.setattr(quantized_base, "dequantize_4bit", lambda p, a, code, *rest: real(p, a, fp4, *rest))
    with pytest.raises(AssertionError):
        torch.testing.assert_close(_step(fused)[0], _step(ref)[0], rtol=1e-5, atol=1e-6)


def test_int8_out_of_training_runs_as_peft_layers_counted(checkpoints):
    """bitsandbytes' int8 matmul quantises the activations outside training (LLM.int8()): not reproduced,
    so those calls run as PEFT's layers, counted with the reason; the result is PEFT's."""
    ref = _load(checkpoints["llama"], "int8").eval()
    fused = torchfuser.optimize(copy.deepcopy(ref), backend="reference").eval()
    with torch.no_grad(), warnings.catch_warnings():
        warnings.simplefilter("ignore")
        torch.testing.assert_close(fused(input_ids=_ids()).logits, ref(input_ids=_ids()).logits, rtol=1e-5, atol=1e-5)
    assert "LLM.int8()" in " ".join(fallbacks.notes(fused))


@pytest.mark.parametrize("quant", ["nf4", "int8"])
def test_under_bf16_autocast_within_the_rule(quant, checkpoints, monkeypatch):
    """The Trainer's bf16=True: bf16 GEMMs for the bases (Ŵ dequantised, then cast) and the adapters, the
    adapters' bf16 products added to the base's output in x's dtype, as PEFT's bnb layers add them."""
    ref = _load(checkpoints["llama"], quant)
    fused = torchfuser.optimize(copy.deepcopy(ref), backend="reference")
    ref64 = _float64_twin(checkpoints["llama"], "llama", ref)
    spy = _Spy(monkeypatch)
    with torch.autocast("cpu", dtype=BF16):
        (lf, gf), (ls, gs) = _step(fused), _step(ref)
    l64, g64 = _step(ref64)
    assert spy.calls == 8 and not fallbacks.counts(fused)
    assert_within_rule(lf, ls, l64, 1e-3, "loss")
    for n in g64:
        assert_within_rule(gf[n], gs[n], g64[n], 2 ** -7 * g64[n].abs().max().item(), n)


def test_unquantised_bnb_base_leaves_the_block_with_the_reason():
    """A Linear4bit whose weight bitsandbytes has not quantised yet (it quantises on .to(device))."""
    layer = bnb.nn.Linear4bit(64, 64, compute_dtype=F32)
    assert quantized_base.kind(layer) is None
    assert "not quantised" in quantized_base.unsupported(layer)
    assert quantized_base.unsupported(torch.nn.Linear(4, 4)) is None


def test_joint_bases_are_compared_on_the_host_once(checkpoints, monkeypatch):
    """Whether q/k/v (or gate/up) dequantise in one launch is decided without comparing code tables on the device
    a call: on CUDA that comparison waits for the GPU every call (and breaks graph capture)."""
    model = _load(checkpoints["llama"], "nf4")
    attn = next(m for m in model.modules() if hasattr(m, "q_proj") and hasattr(m, "v_proj"))
    bases = [lora.base_of(getattr(attn, n)) for n in ("q_proj", "k_proj", "v_proj")]
    assert len({id(b.weight.quant_state.code) for b in bases}) == 3  # bitsandbytes makes one table per weight
    assert quantized_base._one_launch(bases)

    def fail(*_):
        raise AssertionError("a code table compared again")
    monkeypatch.setattr(torch, "equal", fail)
    monkeypatch.setattr(torch.Tensor, "tolist", fail)
    assert quantized_base._one_launch(bases)
    other = copy.deepcopy(bases[2].weight.quant_state.code)
    other[3] += 1
    monkeypatch.undo()
    bases[2].weight.quant_state.code = other
    assert not quantized_base._one_launch(bases)
