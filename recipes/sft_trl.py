"""Supervised fine-tuning with TRL's SFTTrainer and TorchFuserCallback.

    python recipes/sft_trl.py                          # tiny Llama, a tiny built-in text, CPU
    python recipes/sft_trl.py --padding-free --compare # rows concatenated, no pad tokens
    python recipes/sft_trl.py --packing --compare      # best-fit packing (padding-free too)
    python recipes/sft_trl.py --lora --compare         # LoRA through SFTTrainer's peft_config

``SFTTrainer(..., callbacks=[TorchFuserCallback()])`` fuses the model at the end of the trainer's
``__init__``. Padding-free batches (``padding_free=True``, or ``packing=True`` whose default "bfd"
strategy implies it) are one row of concatenated sequences whose ``position_ids`` restart at each
sequence; with SDPA, transformers turns them into a block-diagonal causal mask, which the fused
attention applies as SDPA does.

With ``--lora`` SFTTrainer wraps the model in PEFT before the callback runs; the blocks that hold
adapters stay fused, with the adapters running inside them (the report's notes say so).
``--optimize-first`` fuses the model yourself before SFTTrainer, which gives the same.
SFTTrainer computes the LM head and loss with TRL's own fused head (``add_fused_lm_head``): TorchFuser's
``lm_head_loss`` does not run under it, and the report lists it "bypassed" (the other blocks run fused).
(This recipe needs ``trl``; ``--lora`` needs ``peft``.)
"""
from __future__ import annotations

import argparse
import tempfile

import torch
from datasets import Dataset
from transformers import PreTrainedTokenizerFast
from trl import SFTConfig, SFTTrainer

import torchfuser
from common import (TINY_TEXT, StepTimer, add_model_args, dtype, load_model, print_result,
                    train_and_compare, trainer_losses, trainer_timer_callback)


def char_tokenizer(text: str) -> PreTrainedTokenizerFast:
    """A character-level tokenizer built here (nothing downloaded): one id per character of ``text``."""
    from tokenizers import Regex, Tokenizer, models, pre_tokenizers

    specials = ["<pad>", "<s>", "</s>", "<unk>"]
    vocab = {tok: i for i, tok in enumerate(specials + sorted(set(text) - {"\n"}))}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Split(Regex("."), behavior="isolated")
    return PreTrainedTokenizerFast(tokenizer_object=tok, pad_token="<pad>", bos_token="<s>", eos_token="</s>",
                                   unk_token="<unk>")


def tokenizer_for(args) -> PreTrainedTokenizerFast:
    if args.checkpoint:
        from transformers import AutoTokenizer

        try:
            return AutoTokenizer.from_pretrained(args.checkpoint, local_files_only=True)
        except (OSError, ValueError):
            pass  # a checkpoint without a tokenizer: the character tokenizer below
    return char_tokenizer(TINY_TEXT)


def sft_config(args, output_dir: str) -> SFTConfig:
    return SFTConfig(
        output_dir=output_dir, max_steps=args.steps, per_device_train_batch_size=args.batch,
        gradient_accumulation_steps=args.grad_accum, learning_rate=args.lr, logging_steps=1, save_strategy="no",
        report_to=[], seed=args.seed, use_cpu=not torch.cuda.is_available(), bf16=dtype(args) == torch.bfloat16,
        gradient_checkpointing=args.gradient_checkpointing, packing=args.packing, padding_free=args.padding_free,
        # Padding-free without packing does not truncate (TRL refuses a max_length there).
        max_length=None if args.padding_free and not args.packing else args.seq,
        dataset_num_proc=1, disable_tqdm=True, log_level="warning")


def train(args, fused: bool) -> dict:
    model = load_model(args)
    tokenizer = tokenizer_for(args)
    assert len(tokenizer) <= model.config.vocab_size, "the tokenizer's ids must fit the model's vocabulary"
    if fused and args.optimize_first:
        torchfuser.optimize(model, backend=args.backend)
    lines = [line for line in TINY_TEXT.splitlines() if line]
    data = Dataset.from_dict({"text": lines * args.repeat})
    peft_config = None
    if args.lora:
        from peft import LoraConfig

        peft_config = LoraConfig(r=8, lora_alpha=16, target_modules="all-linear", lora_dropout=0.0,
                                 init_lora_weights=False)
        torch.manual_seed(args.seed + 1)  # the adapters' initial weights, the same for both runs
    callback = torchfuser.TorchFuserCallback(backend=args.backend)
    timer = StepTimer()
    # Fused already (--optimize-first): the callback has nothing left to do.
    callbacks = [trainer_timer_callback(timer)] + ([callback] if fused and not args.optimize_first else [])
    with tempfile.TemporaryDirectory() as scratch:
        trainer = SFTTrainer(model=model, args=sft_config(args, scratch), train_dataset=data,
                             processing_class=tokenizer, peft_config=peft_config, callbacks=callbacks)
        if fused:
            print(torchfuser.report(trainer.model).summary())
        trainer.train()
    tokens = timer_tokens(trainer, args)
    rep = torchfuser.report(trainer.model) if fused else None
    return print_result("fused" if fused else "unfused", trainer_losses(trainer), timer.tokens_per_s(tokens),
                        timer.ms_per_step(), fused_blocks=len(rep.fused) if rep else 0,
                        skipped_blocks=len(rep.skipped) if rep else 0)


def timer_tokens(trainer, args) -> float:
    """Tokens per optimizer step, from the trainer's own count of the tokens it saw."""
    seen = getattr(trainer.state, "num_input_tokens_seen", 0) or 0
    if seen:
        return seen / max(trainer.state.global_step, 1)
    return args.batch * args.grad_accum * args.seq


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_model_args(parser, steps=10, batch=4, seq=64)
    parser.add_argument("--packing", action="store_true", help="SFTConfig(packing=True): bfd, padding-free")
    parser.add_argument("--padding-free", action="store_true", help="SFTConfig(padding_free=True)")
    parser.add_argument("--lora", action="store_true", help="LoRA adapters through SFTTrainer's peft_config")
    parser.add_argument("--optimize-first", action="store_true",
                        help="torchfuser.optimize before SFTTrainer (keeps the blocks fused under --lora)")
    parser.add_argument("--grad-accum", type=int, default=1)
    parser.add_argument("--gradient-checkpointing", action=argparse.BooleanOptionalAction, default=False,
                        help="SFTConfig's default is on; off here for speed on the CPU")
    parser.add_argument("--repeat", type=int, default=8, help="copies of the built-in text in the data set")
    args = parser.parse_args()
    train_and_compare(train, args)


if __name__ == "__main__":
    main()
