"""RL with a verifiable reward: TRL's GRPOTrainer with TorchFuserCallback.

    python recipes/grpo_trl.py --compare                   # tiny Llama, rollouts by generate, CPU
    python recipes/grpo_trl.py --lora --beta 0.05 --compare   # LoRA; the KL reference is the model, adapters off
    python recipes/grpo_trl.py --config recipes/qwen15b.json --batch 16 --completion 1024  # GPU: Qwen2.5-1.5B

``GRPOTrainer(..., callbacks=[TorchFuserCallback()])`` fuses the policy at the end of the trainer's
``__init__``. Rollouts are transformers' own ``generate`` on the fused model (training mode, KV cache,
prompts padded on the left); the training half scores them with TRL's ``fused_lm_head=True`` (per-token
log-probabilities and entropy from TRL's chunked kernels; the report says "LM head: TRL's chunked
kernels run") while the norms, attention, rotary embedding and MLPs run TorchFuser's kernels.

The reward is a rule, no model and nothing downloaded: a completion scores the share of its characters
that are lowercase letters or spaces (text-like output), minus a penalty for repeating a character three
times in a row. Replace ``text_like_reward`` with your own verifier (exact-match answers, unit tests, ...).
(This recipe needs ``trl``; ``--lora`` needs ``peft``.)
"""
from __future__ import annotations

import argparse
import re
import tempfile

import torch
from datasets import Dataset
from trl import GRPOConfig, GRPOTrainer

import torchfuser
from common import (TINY_TEXT, StepTimer, add_model_args, dtype, load_model, lora_config, train_and_compare,
                    trainer_timer_callback, trl_result)
from sft_trl import timer_tokens, tokenizer_for


def text_like_reward(prompts, completions, **kwargs) -> list[float]:
    """A rule-based reward: lowercase letters and spaces score, runs of one character are penalised."""
    scores = []
    for text in completions:
        good = sum(c.islower() or c == " " for c in text) / max(len(text), 1)
        scores.append(good - 0.5 * len(re.findall(r"(.)\1\1", text)))
    return scores


def prompts(repeat: int) -> Dataset:
    lines = [line for line in TINY_TEXT.splitlines() if line]
    return Dataset.from_dict({"prompt": [line[: max(4, len(line) // 3)] for line in lines] * repeat})


def grpo_config(args, output_dir: str) -> GRPOConfig:
    return GRPOConfig(
        output_dir=output_dir, max_steps=args.steps, per_device_train_batch_size=args.batch,
        gradient_accumulation_steps=args.grad_accum, learning_rate=args.lr, logging_steps=1, save_strategy="no",
        report_to=[], seed=args.seed, use_cpu=not torch.cuda.is_available(), bf16=dtype(args) == torch.bfloat16,
        num_generations=args.num_generations, max_completion_length=args.completion, beta=args.beta,
        loss_type=args.loss_type, gradient_checkpointing=args.gradient_checkpointing, disable_tqdm=True,
        log_level="warning")


def train(args, fused: bool) -> dict:
    model = load_model(args)
    tokenizer = tokenizer_for(args)
    assert len(tokenizer) <= model.config.vocab_size, "the tokenizer's ids must fit the model's vocabulary"
    peft_config = None
    if args.lora:
        peft_config = lora_config(args.lora, args.seed + 1)
    elif args.beta:
        raise SystemExit("--beta > 0 without --lora: GRPOTrainer would load a reference model by the checkpoint's "
                         "name; use --lora (the reference is the model with its adapters disabled)")
    timer = StepTimer()
    callbacks = [trainer_timer_callback(timer)]
    if fused:
        callbacks.append(torchfuser.TorchFuserCallback(backend=args.backend, verbose=False))
    with tempfile.TemporaryDirectory() as scratch:
        trainer = GRPOTrainer(model=model, reward_funcs=text_like_reward, args=grpo_config(args, scratch),
                              train_dataset=prompts(args.repeat), processing_class=tokenizer,
                              peft_config=peft_config, callbacks=callbacks)
        trainer.train()
    rewards = [e["reward"] for e in trainer.state.log_history if "reward" in e]
    return trl_result(trainer, fused, timer, timer_tokens(trainer, args), rewards=rewards)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_model_args(parser, steps=4, batch=8, seq=64)
    parser.add_argument("--lora", type=int, nargs="?", const=8, default=0,
                        help="LoRA rank (8 if given alone); a KL reference is the model with its adapters disabled")
    parser.add_argument("--num-generations", type=int, default=4, help="completions per prompt (the group)")
    parser.add_argument("--completion", type=int, default=8, help="max_completion_length (tokens)")
    parser.add_argument("--beta", type=float, default=0.0, help="KL coefficient (needs --lora here)")
    parser.add_argument("--loss-type", default="dapo", help="GRPOConfig.loss_type: grpo, dapo, dr_grpo, bnpo, ...")
    parser.add_argument("--grad-accum", type=int, default=1)
    parser.add_argument("--gradient-checkpointing", action=argparse.BooleanOptionalAction, default=False)
    parser.add_argument("--repeat", type=int, default=8, help="copies of the built-in prompts in the data set")
    args = parser.parse_args()
    train_and_compare(train, args)


if __name__ == "__main__":
    main()
