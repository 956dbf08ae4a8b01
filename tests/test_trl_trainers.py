"""TRL's post-training trainers with TorchFuserCallback on a tiny Llama on the CPU, each against the same
trainer unfused from the same seeds: DPO (a reference model, or the adapters disabled as the reference;
several loss types), KTO, GRPO and RLOO (rollouts by transformers' own ``generate``, a rule-based reward
made here), and the distillation trainer (a tiny teacher). The loss of every step and the trained
weights (or adapters) agree within fp32 tolerance, the fused attention and MLPs ran (no call handed back
to an original module), and the report says which LM head runs: TRL's own (``fused_lm_head=True``), never
TorchFuser's, which it lists bypassed. SFT (padded, padding-free, packing, LoRA, accumulation) is in
tests/test_trl.py.

Sampled rollouts draw from the same generator in both runs; the fused model's probabilities differ from
the unfused one's by float rounding only, so the same tokens are drawn (the completions are compared).
"""
from __future__ import annotations

import logging

import pytest
import torch

import torchfuser
from test_trl import TEXT, _model, _tokenizer

trl = pytest.importorskip("trl")
pytest.importorskip("accelerate")
datasets = pytest.importorskip("datasets")

RTOL, ATOL = 1e-5, 1e-6


def _lora():
    peft = pytest.importorskip("peft")
    return peft.LoraConfig(r=4, lora_alpha=8, target_modules="all-linear", lora_dropout=0.0, init_lora_weights=False)


def _common(tmp_path, fused: bool, steps: int, **over) -> dict:
    options = dict(output_dir=str(tmp_path / ("fused" if fused else "plain")), max_steps=steps, learning_rate=1e-3,
                   logging_steps=1, save_strategy="no", report_to=[], seed=0, use_cpu=True, bf16=False,
                   disable_tqdm=True, per_device_train_batch_size=2)
    options.update(over)
    return options


def _callbacks(fused: bool) -> list:
    return [torchfuser.TorchFuserCallback(backend="reference", verbose=False)] if fused else []


def _trained(trainer) -> dict[str, torch.Tensor]:
    """The trainable parameters after training (all of them, or the adapters), by name."""
    return {n: p.detach().clone() for n, p in trainer.model.named_parameters() if p.requires_grad}


def _train(trainer):
    trainer.initial = _trained(trainer)
    trainer.train()
    return trainer


def _losses(trainer, steps: int) -> list[float]:
    losses = [e["loss"] for e in trainer.state.log_history if "loss" in e]
    assert len(losses) == steps and all(x == x and abs(x) < 50 for x in losses), losses
    return losses


def _same_training(run, steps: int, *, lora: bool = False):
    """Train unfused then fused (``run(fused) -> trainer``); compare losses and trained weights."""
    plain = run(False)
    fused = run(True)
    a, b = _losses(plain, steps), _losses(fused, steps)
    assert b == pytest.approx(a, rel=RTOL, abs=ATOL), (a, b)
    wa, wb = _trained(plain), _trained(fused)
    assert wa.keys() == wb.keys() and wa, sorted(wb)[:4]
    if lora:
        assert all("lora_" in n for n in wa), [n for n in wa if "lora_" not in n][:4]
    moved = 0.0
    for name in wa:
        torch.testing.assert_close(wb[name], wa[name], rtol=RTOL, atol=1e-5, msg=name)
        moved = max(moved, (wa[name] - plain.initial[name]).abs().max().item())
    assert moved > 1e-5  # training changed the weights: a comparison of two untrained models proves nothing
    _fused_ran(fused)
    return plain, fused


def _fused_ran(trainer):
    rep = torchfuser.report(trainer.model)
    counts = rep.counts()
    assert counts["attention"]["fused"] == 2 and counts["gated_mlp"]["fused"] == 2, rep
    assert counts["rms_norm"]["fused"] == 5, rep
    assert not rep.fallbacks, rep.fallbacks  # every fused block ran its fused path
    return rep


def _says_trls_head_runs(trainer):
    rep = torchfuser.report(trainer.model)
    head = next(e for e in rep.entries if e.pattern == "lm_head_loss")
    assert not head.is_fused and "TRL's fused_lm_head wrapper" in head.reason, head
    assert any("LM head: TRL's chunked kernels run (fused_lm_head=True)" in n for n in rep.notes), rep.notes


# ---------------------------------------------------------------------------------------------------- DPO

def _preferences():
    return datasets.Dataset.from_dict({"prompt": TEXT[:4] * 2, "chosen": TEXT[4:] * 2,
                                       "rejected": TEXT[4:][::-1] * 2})


def _dpo(tmp_path, *, steps=2, lora=False, ref=True, **config):
    def run(fused):
        options = _common(tmp_path, fused, steps, max_length=64, dataset_num_proc=1, **config)
        model = _model()
        if lora:
            torch.manual_seed(1)  # the adapters' initial weights: the same in both runs
        return _train(trl.DPOTrainer(model=model, ref_model=_model() if ref else None, args=trl.DPOConfig(**options),
                                     train_dataset=_preferences(), processing_class=_tokenizer(),
                                     peft_config=_lora() if lora else None, callbacks=_callbacks(fused)))
    return _same_training(run, steps, lora=lora)


@pytest.mark.parametrize("loss_type", [["sigmoid"], pytest.param(["ipo"], marks=pytest.mark.slow),
                                       pytest.param(["sigmoid", "bco_pair", "sft"], marks=pytest.mark.slow)],
                         ids=["sigmoid", "ipo", "mpo"])
def test_dpo_with_a_reference_model(tmp_path, loss_type, caplog):
    caplog.set_level(logging.ERROR)
    weights = {"loss_weights": [0.8, 0.2, 1.0]} if len(loss_type) == 3 else {}
    _, fused = _dpo(tmp_path, loss_type=loss_type, **weights)
    _says_trls_head_runs(fused)


def test_dpo_lora_reference_by_disabled_adapters(tmp_path, caplog):
    """No ref_model and a peft_config: the reference is the model with its adapters disabled, inside the
    fused blocks (the adapters are switched off there too); gradient accumulation on."""
    caplog.set_level(logging.ERROR)
    _, fused = _dpo(tmp_path, lora=True, ref=False, gradient_accumulation_steps=2, per_device_train_batch_size=1)
    assert fused.ref_model is None
    _says_trls_head_runs(fused)
    rep = torchfuser.report(fused.model)
    assert any(n.startswith("adapters: ") and "LoRA r=" in n for n in rep.notes), rep.notes


# ------------------------------------------------------------------------------------------- GRPO / RLOO

def _reward_vowels(seen: list):
    """A rule-based reward (no model): letters score 1, other visible characters 0.5 (ids outside the tiny
    tokenizer's vocabulary decode to nothing); records the completions."""
    def reward(prompts, completions, **kwargs):
        seen.extend(completions)
        return [sum(1.0 if c.isalpha() else 0.5 for c in text.strip()) for text in completions]
    return reward


def _prompts():
    return datasets.Dataset.from_dict({"prompt": [t[:12] for t in TEXT] * 2})


def _online(tmp_path, cls, config_cls, *, steps=2, lora=False, **config):
    seen = {False: [], True: []}

    def run(fused):
        options = _common(tmp_path, fused, steps, num_generations=2, max_completion_length=4,
                           **{"per_device_train_batch_size": 4, **config})
        model = _model()
        if lora:
            torch.manual_seed(1)
        return _train(cls(model=model, reward_funcs=_reward_vowels(seen[fused]), args=config_cls(**options),
                          train_dataset=_prompts(), processing_class=_tokenizer(),
                          peft_config=_lora() if lora else None, callbacks=_callbacks(fused)))
    plain, fused = _same_training(run, steps, lora=lora)
    assert seen[True] == seen[False] and len(seen[True]) >= steps * 2, (seen[False], seen[True])  # the same rollouts
    return plain, fused


def test_grpo_full_fine_tuning(tmp_path, caplog):
    caplog.set_level(logging.ERROR)
    _, fused = _online(tmp_path, trl.GRPOTrainer, trl.GRPOConfig)
    _says_trls_head_runs(fused)


def test_grpo_lora_with_kl_and_accumulation(tmp_path, caplog):
    caplog.set_level(logging.ERROR)
    _, fused = _online(tmp_path, trl.GRPOTrainer, trl.GRPOConfig, lora=True, beta=0.1, gradient_accumulation_steps=2)
    _says_trls_head_runs(fused)


@pytest.mark.slow
def test_rloo_full_fine_tuning(tmp_path, caplog):
    caplog.set_level(logging.ERROR)
    # beta=0: with a KL term and no adapters RLOO loads its reference model by the checkpoint's name
    _, fused = _online(tmp_path, trl.RLOOTrainer, trl.RLOOConfig, beta=0.0)
    _says_trls_head_runs(fused)


@pytest.mark.slow
def test_rloo_lora_with_kl(tmp_path, caplog):
    caplog.set_level(logging.ERROR)
    _, fused = _online(tmp_path, trl.RLOOTrainer, trl.RLOOConfig, lora=True, beta=0.05)
    _says_trls_head_runs(fused)


# ---------------------------------------------------------------------------------------------------- KTO

def _unpaired():
    return datasets.Dataset.from_dict({"prompt": TEXT[:4] * 2, "completion": TEXT[4:] + TEXT[4:][::-1],
                                       "label": [True, False] * 4})


@pytest.mark.slow
@pytest.mark.parametrize("lora", [False, True], ids=["full", "lora"])
def test_kto(tmp_path, lora, caplog):
    caplog.set_level(logging.ERROR)

    def run(fused):
        options = _common(tmp_path, fused, 2, max_length=64, dataset_num_proc=1, per_device_train_batch_size=4)
        model = _model()
        if lora:
            torch.manual_seed(1)
        return _train(trl.KTOTrainer(model=model, ref_model=None if lora else _model(), args=trl.KTOConfig(**options),
                                     train_dataset=_unpaired(), processing_class=_tokenizer(),
                                     peft_config=_lora() if lora else None, callbacks=_callbacks(fused)))
    _, fused = _same_training(run, 2, lora=lora)
    _says_trls_head_runs(fused)


# ------------------------------------------------------------------------------------------- distillation

def _teacher():
    from transformers import LlamaConfig, LlamaForCausalLM

    cfg = LlamaConfig(hidden_size=96, intermediate_size=192, num_hidden_layers=2, num_attention_heads=4,
                      num_key_value_heads=2, vocab_size=128, attn_implementation="sdpa")
    torch.manual_seed(5)
    return LlamaForCausalLM(cfg)


@pytest.mark.slow
@pytest.mark.parametrize("lora", [False, True], ids=["full", "lora"])
def test_distillation(tmp_path, lora, caplog):
    """On-policy distillation (the student's own rollouts by ``generate``), generalized JSD against a tiny
    teacher. TRL's trainer runs the student's backbone and scores it with its chunked divergence kernel
    on ``lm_head.weight``: the fused blocks run, the fused LM head + loss is bypassed (no call)."""
    caplog.set_level(logging.ERROR)

    def run(fused):
        options = _common(tmp_path, fused, 2, max_completion_length=4, beta=0.5, per_device_train_batch_size=4)
        model = _model()
        if lora:
            torch.manual_seed(1)
        return _train(trl.DistillationTrainer(model=model, teacher_model=_teacher(),
                                              args=trl.DistillationConfig(**options), train_dataset=_prompts(),
                                              processing_class=_tokenizer(), peft_config=_lora() if lora else None,
                                              callbacks=_callbacks(fused)))
    _, fused = _same_training(run, 2, lora=lora)
    head = next(e for e in torchfuser.report(fused.model).entries if e.pattern == "lm_head_loss")
    assert not head.is_fused and head.reason.startswith("bypassed — 0 fused calls"), head
