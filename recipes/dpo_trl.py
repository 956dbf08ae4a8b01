"""Preference optimisation with TRL's DPOTrainer and TorchFuserCallback.

    python recipes/dpo_trl.py --compare                    # tiny Llama, a reference model, CPU
    python recipes/dpo_trl.py --lora --compare             # LoRA; the reference is the model, adapters off
    python recipes/dpo_trl.py --loss-type sigmoid bco_pair sft --loss-weights 0.8 0.2 1.0 --compare  # MPO
    python recipes/dpo_trl.py --config recipes/llama8b.json --lora 16 --batch 4 --seq 2048  # GPU: Llama-3-8B shapes

``DPOTrainer(..., callbacks=[TorchFuserCallback()])`` fuses the policy at the end of the trainer's
``__init__``; the norms, attention, rotary embedding and MLPs (with LoRA adapters inside them) run
TorchFuser's kernels. The LM head is TRL's: DPOTrainer scores the chosen and rejected completions with
``fused_lm_head=True``, per-token log-probabilities from TRL's chunked kernels, and the report says so
("LM head: TRL's chunked kernels run"). The preference pairs are built from a tiny built-in text: the
chosen completion is the line's own ending, the rejected one another line's (nothing downloaded).
(This recipe needs ``trl``; ``--lora`` needs ``peft``.)
"""
from __future__ import annotations

import argparse
import tempfile

import torch
from datasets import Dataset
from trl import DPOConfig, DPOTrainer

import torchfuser
from common import (TINY_TEXT, StepTimer, add_model_args, dtype, load_model, lora_config, train_and_compare,
                    trainer_timer_callback, trl_result)
from sft_trl import timer_tokens, tokenizer_for


def preference_pairs(repeat: int) -> Dataset:
    """prompt: a line's first half; chosen: its own second half; rejected: the next line's second half."""
    lines = [line for line in TINY_TEXT.splitlines() if len(line) > 8]
    halves = [(line[: len(line) // 2], line[len(line) // 2:]) for line in lines]
    rows = {"prompt": [], "chosen": [], "rejected": []}
    for i, (prompt, chosen) in enumerate(halves):
        rows["prompt"].append(prompt)
        rows["chosen"].append(chosen)
        rows["rejected"].append(halves[(i + 1) % len(halves)][1])
    return Dataset.from_dict({k: v * repeat for k, v in rows.items()})


def dpo_config(args, output_dir: str) -> DPOConfig:
    return DPOConfig(
        output_dir=output_dir, max_steps=args.steps, per_device_train_batch_size=args.batch,
        gradient_accumulation_steps=args.grad_accum, learning_rate=args.lr, logging_steps=1, save_strategy="no",
        report_to=[], seed=args.seed, use_cpu=not torch.cuda.is_available(), bf16=dtype(args) == torch.bfloat16,
        loss_type=args.loss_type, loss_weights=args.loss_weights, beta=args.beta, max_length=args.seq,
        gradient_checkpointing=args.gradient_checkpointing, dataset_num_proc=1, disable_tqdm=True,
        log_level="warning")


def train(args, fused: bool) -> dict:
    model = load_model(args)
    tokenizer = tokenizer_for(args)
    assert len(tokenizer) <= model.config.vocab_size, "the tokenizer's ids must fit the model's vocabulary"
    peft_config = ref_model = None
    if args.lora:
        peft_config = lora_config(args.lora, args.seed + 1)
    else:
        ref_model = load_model(args)  # the same weights: a frozen copy of the starting policy
    timer = StepTimer()
    callbacks = [trainer_timer_callback(timer)]
    if fused:
        callbacks.append(torchfuser.TorchFuserCallback(backend=args.backend, verbose=False))
    with tempfile.TemporaryDirectory() as scratch:
        trainer = DPOTrainer(model=model, ref_model=ref_model, args=dpo_config(args, scratch),
                             train_dataset=preference_pairs(args.repeat), processing_class=tokenizer,
                             peft_config=peft_config, callbacks=callbacks)
        trainer.train()
    return trl_result(trainer, fused, timer, timer_tokens(trainer, args))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_model_args(parser, steps=6, batch=4, seq=64)
    parser.add_argument("--lora", type=int, nargs="?", const=8, default=0,
                        help="LoRA rank (8 if given alone); the reference is the model with its adapters disabled")
    parser.add_argument("--loss-type", nargs="+", default=["sigmoid"], help="DPOConfig.loss_type (one or several)")
    parser.add_argument("--loss-weights", type=float, nargs="+", default=None)
    parser.add_argument("--beta", type=float, default=0.1)
    parser.add_argument("--grad-accum", type=int, default=1)
    parser.add_argument("--gradient-checkpointing", action=argparse.BooleanOptionalAction, default=False)
    parser.add_argument("--repeat", type=int, default=4, help="copies of the built-in pairs in the data set")
    args = parser.parse_args()
    train_and_compare(train, args)


if __name__ == "__main__":
    main()
