"""TRL's SFTTrainer with TorchFuserCallback on a tiny Llama on the CPU: padded, padding-free and packed
batches, LoRA through ``peft_config``, gradient accumulation, gradient checkpointing. The fused run's
loss at every step equals the unfused run's (same seed) within fp32 tolerance, and the fused attention
really ran (no call handed back to the original module).

Padding-free rows concatenate sequences whose ``position_ids`` restart; with SDPA transformers builds a
block-diagonal causal mask from them. A fused attention that ignored it (plain causal over the row)
would leak attention across sequences and agree with nobody: the padded run's first loss, and the
logits of each sequence run alone, catch that.
"""
from __future__ import annotations

import copy
import logging

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM

import torchfuser
from torchfuser.modules.base import FusedModule

trl = pytest.importorskip("trl")
pytest.importorskip("accelerate")
datasets = pytest.importorskip("datasets")

TEXT = [
    "The quick brown fox jumps over the lazy dog.",
    "Short.",
    "A fused kernel reads its input once and writes its output once.",
    "Norms, rotary embeddings and attention.",
    "Every parameter keeps its name, so checkpoints load anywhere.",
    "Padding matters to the loss only if the mask is wrong.",
    "ab",
    "Gradients flow through the fused modules as through the originals, or the test fails.",
]


def _tokenizer():
    from tokenizers import Regex, Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    specials = ["<pad>", "<s>", "</s>", "<unk>"]
    vocab = {t: i for i, t in enumerate(specials + sorted(set("".join(TEXT))))}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Split(Regex("."), behavior="isolated")
    return PreTrainedTokenizerFast(tokenizer_object=tok, pad_token="<pad>", bos_token="<s>", eos_token="</s>",
                                   unk_token="<unk>")


def _model():
    cfg = LlamaConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                      num_key_value_heads=2, vocab_size=128, attn_implementation="sdpa")
    torch.manual_seed(0)
    return LlamaForCausalLM(cfg)


def _sft(tmp_path, fused: bool, *, optimize_first: bool = False, lora: bool = False, steps: int = 3, **config):
    """Losses of each logged step, and the trainer."""
    model = _model()
    if optimize_first:
        torchfuser.optimize(model, backend="reference")
    peft_config = None
    if lora:
        peft = pytest.importorskip("peft")
        peft_config = peft.LoraConfig(r=4, lora_alpha=8, target_modules="all-linear", lora_dropout=0.0,
                                      init_lora_weights=False)
        torch.manual_seed(1)  # the adapters' initial weights: the same in both runs
    options = dict(output_dir=str(tmp_path / ("fused" if fused else "plain")), max_steps=steps,
                   per_device_train_batch_size=4, learning_rate=1e-3, logging_steps=1, save_strategy="no",
                   report_to=[], seed=0, use_cpu=True, bf16=False, gradient_checkpointing=False, dataset_num_proc=1,
                   max_length=64, disable_tqdm=True)
    options.update(config)
    if options.get("padding_free") and not options.get("packing"):
        options["max_length"] = None  # TRL: padding-free without packing does not truncate
    callbacks = [torchfuser.TorchFuserCallback(backend="reference")] if fused else []
    trainer = trl.SFTTrainer(model=model, args=trl.SFTConfig(**options),
                             train_dataset=datasets.Dataset.from_dict({"text": TEXT * 4}),
                             processing_class=_tokenizer(), peft_config=peft_config, callbacks=callbacks)
    trainer.train()
    losses = [e["loss"] for e in trainer.state.log_history if "loss" in e]
    assert len(losses) == steps and all(0 < x < 20 for x in losses), losses
    return losses, trainer


def _no_attention_fallbacks(trainer):
    rep = torchfuser.report(trainer.model)
    assert any(e.pattern == "attention" and e.is_fused for e in rep.entries), rep
    assert not rep.fallbacks, rep.fallbacks  # every fused block ran its fused path


MODES = {
    "padded": {},
    "padding_free": {"padding_free": True},
    "packing_bfd": {"packing": True},  # bfd implies padding-free
    "packing_wrapped": {"packing": True, "packing_strategy": "wrapped"},
    "gradient_checkpointing": {"gradient_checkpointing": True},  # SFTConfig's own default
}


@pytest.mark.parametrize("mode", MODES)
def test_sft_fused_loss_equals_unfused(tmp_path, mode, caplog):
    caplog.set_level(logging.ERROR)
    plain, _ = _sft(tmp_path, False, **MODES[mode])
    fused, trainer = _sft(tmp_path, True, **MODES[mode])
    assert fused == pytest.approx(plain, rel=1e-5, abs=1e-6)
    _no_attention_fallbacks(trainer)


def test_padding_free_keeps_sequences_apart(tmp_path):
    """Padding-free and padded batches hold the same tokens (TRL's sampler, same seed): the first step's
    mean loss is the same only if no token attends across a sequence boundary."""
    padded, _ = _sft(tmp_path / "a", True, steps=1, max_length=None)  # no truncation, as padding-free
    free, trainer = _sft(tmp_path / "b", True, steps=1, padding_free=True)
    assert free[0] == pytest.approx(padded[0], rel=1e-5)
    _no_attention_fallbacks(trainer)


@pytest.mark.parametrize("backend", ["reference", "auto"])
def test_packed_row_logits_equal_each_sequence_alone(backend):
    """The mechanism itself: position_ids restarting inside one row, no attention mask and no cache (what
    TRL's padding-free collator and compute_loss pass), against each sequence run alone, unfused.
    transformers only builds the block-diagonal mask without a cache: with use_cache=True (the
    config's default, in training mode too) the packed row is plain causal, fused or not."""
    ref = _model().eval()
    fused = torchfuser.optimize(copy.deepcopy(ref), backend=backend).eval()
    # optimize probes each block against the original and leaves a mismatch unfused: check it is fused.
    assert torchfuser.report(fused).counts()["attention"]["fused"] == 2
    gen = torch.Generator().manual_seed(2)
    seqs = [torch.randint(4, 128, (n,), generator=gen) for n in (5, 9, 3)]
    row = torch.cat(seqs)[None]
    pos = torch.cat([torch.arange(len(s)) for s in seqs])[None]
    with torch.no_grad():
        packed = fused(input_ids=row, position_ids=pos, use_cache=False).logits[0]
        alone = torch.cat([ref(input_ids=s[None]).logits[0] for s in seqs])
        packed_ref = ref(input_ids=row, position_ids=pos, use_cache=False).logits[0]
    torch.testing.assert_close(packed_ref, alone, rtol=1e-4, atol=1e-5)  # transformers' own block-diagonal mask
    torch.testing.assert_close(packed, alone, rtol=1e-4, atol=1e-5)
    assert not torchfuser.report(fused).fallbacks  # the fused path ran, not the original's


def test_sft_gradient_accumulation(tmp_path, caplog):
    caplog.set_level(logging.ERROR)
    plain, _ = _sft(tmp_path, False, gradient_accumulation_steps=2, per_device_train_batch_size=2)
    fused, trainer = _sft(tmp_path, True, gradient_accumulation_steps=2, per_device_train_batch_size=2)
    assert fused == pytest.approx(plain, rel=1e-5, abs=1e-6)
    _no_attention_fallbacks(trainer)


def _fused_classes(model) -> set[str]:
    return {type(m).__name__ for m in model.modules() if isinstance(m, FusedModule)}


def test_sft_lora_through_peft_config(tmp_path, caplog):
    """SFTTrainer wraps the model in PEFT before the callback runs: the blocks holding adapters stay
    fused with the adapters inside them, the report says so, and training is exact."""
    caplog.set_level(logging.ERROR)
    plain, _ = _sft(tmp_path, False, lora=True)
    fused, trainer = _sft(tmp_path, True, lora=True)
    assert fused == pytest.approx(plain, rel=1e-5, abs=1e-6)
    rep = torchfuser.report(trainer.model)
    counts = rep.counts()
    assert counts["rms_norm"]["fused"] == 5 and counts["attention"] == {"fused": 2, "skipped": 0}, rep
    assert counts["gated_mlp"] == {"fused": 2, "skipped": 0} and not rep.fallbacks
    assert {"FusedAttention", "FusedGatedMLP", "FusedRMSNorm"} <= _fused_classes(trainer.model)
    assert any(n.startswith("adapters: ") and "LoRA r=" in n for n in rep.notes), rep.notes
    trainable = [n for n, p in trainer.model.named_parameters() if p.requires_grad]
    assert trainable and all("lora_" in n for n in trainable)


def test_sft_lora_after_optimize_keeps_the_fusion(tmp_path, caplog):
    """torchfuser.optimize before SFTTrainer: the adapters sit inside fused blocks, which stay fused."""
    caplog.set_level(logging.ERROR)
    plain, _ = _sft(tmp_path, False, lora=True)
    fused, trainer = _sft(tmp_path, True, lora=True, optimize_first=True)
    assert fused == pytest.approx(plain, rel=1e-5, abs=1e-6)
    assert {"FusedAttention", "FusedGatedMLP", "FusedRMSNorm"} <= _fused_classes(trainer.model)
    layer = trainer.model.base_model.model.model.layers[0]
    assert type(layer.self_attn.q_proj).__module__.startswith("peft")  # the adapter runs inside the fused block


def test_sft_lora_after_optimize_report_says_fused(tmp_path, caplog):
    """Fused first, then SFTTrainer wraps it in a PeftModel and the callback optimizes the wrapper:
    optimize goes on inside the model it was given, and the report stays that model's."""
    caplog.set_level(logging.ERROR)
    _, trainer = _sft(tmp_path, True, lora=True, optimize_first=True, steps=1)
    rep = torchfuser.report(trainer.model)
    assert rep.counts().get("attention", {}).get("fused") == 2, rep
