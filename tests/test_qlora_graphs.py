"""QLoRA layers under CUDA graphs (cuda_graphs/__init__.py, replay.py): a frozen quantised base (bitsandbytes'
Params4bit) is a tensor subclass, but its bytes stay in place between steps and get no gradient, so a stack of
fused QLoRA layers may be captured; any other wrapped parameter still keeps the layers eager, with the reason.
The H200's profile of the 8B QLoRA step (2026-12-05) showed it host-bound because of that refusal."""
from __future__ import annotations

import copy
import warnings

import pytest
import torch
from torch import nn

import torchfuser
from torchfuser.cuda_graphs import param_problem
from torchfuser.modules import fallbacks

bnb = pytest.importorskip("bitsandbytes")
peft = pytest.importorskip("peft")
from test_qlora_fused import _CFG, _LORA, checkpoints  # noqa: E402,F401  (module fixture: tiny checkpoints)
from transformers import AutoModelForCausalLM, BitsAndBytesConfig  # noqa: E402


def _qlora(path, device: str, double: bool = True):
    cfg = BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_quant_type="nf4", bnb_4bit_use_double_quant=double,
                             bnb_4bit_compute_dtype=torch.bfloat16)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        model = AutoModelForCausalLM.from_pretrained(path, quantization_config=cfg, device_map=device,
                                                     dtype=torch.bfloat16)
        model = peft.prepare_model_for_kbit_training(model, use_gradient_checkpointing=False)
    torch.manual_seed(1)
    model = peft.get_peft_model(model, peft.LoraConfig(**_LORA))
    model.config.use_cache = False
    return model.train()


def test_a_frozen_quantised_base_may_be_captured_a_wrapped_parameter_may_not(checkpoints):  # noqa: F811
    model = _qlora(checkpoints["llama"], "cpu")
    base = model.base_model.model.model.layers[0].mlp.up_proj.base_layer.weight
    assert type(base) is not nn.Parameter and not base.requires_grad
    assert param_problem(base, base.device) is None
    lora_a = model.base_model.model.model.layers[0].mlp.up_proj.lora_A["default"].weight
    assert param_problem(lora_a, lora_a.device) is None

    class Wrapped(nn.Parameter):  # e.g. a sharded or traced parameter: no promise its storage stays put
        pass
    assert "wrapped" in param_problem(Wrapped(torch.zeros(2)), torch.device("cpu"))
    assert "devices" in param_problem(nn.Parameter(torch.zeros(2)), torch.device("meta"))


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA (graphs, bitsandbytes' CUDA quantisation)")
def test_qlora_layers_replay_and_train_as_eager(checkpoints):  # noqa: F811
    ref = _qlora(checkpoints["llama"], "cuda")
    fused = torchfuser.optimize(copy.deepcopy(ref), cuda_graphs=True)
    ids = torch.randint(0, _CFG["vocab_size"], (2, 16), generator=torch.Generator().manual_seed(1)).cuda()
    for m in (ref, fused):
        for _ in range(3):  # the second call captures, the third replays
            m.zero_grad(set_to_none=True)
            loss = m(input_ids=ids, labels=ids).loss
            loss.backward()
        m.final = (loss.detach(), {n: p.grad for n, p in m.named_parameters() if p.grad is not None})
    notes = " | ".join(torchfuser.report(fused).notes)
    assert "replayed" in notes and "not used" not in notes, notes
    assert not fallbacks.counts(fused.get_base_model())
    (lf, gf), (lr, gr) = fused.final, ref.final
    torch.testing.assert_close(lf, lr, rtol=2e-2, atol=2e-2)
    assert list(gf) == list(gr) and all("lora_" in n for n in gr)
    for n in gr:
        scale = gr[n].float().abs().max().item() + 1e-6
        assert (gf[n].float() - gr[n].float()).abs().max().item() <= 5e-2 * scale, n
