"""LoRA with PEFT and the Hugging Face Trainer, on a fused model.

    python recipes/lora_peft.py                     # tiny Llama, random tokens, CPU
    python recipes/lora_peft.py --compare --rank 8
    python recipes/lora_peft.py --checkpoint ./my-model --targets q_proj v_proj

Order matters: ``torchfuser.optimize`` first, then ``get_peft_model``. The fused blocks then run the
adapters' ``lora.Linear`` modules as their projections and stay fused. The other way round (adapters
first, or ``TorchFuserCallback`` on an already-wrapped PEFT model) a block that holds an adapter is
not recognised and stays unfused; the report says so. (This recipe needs ``peft`` and ``accelerate``.)
"""
from __future__ import annotations

import argparse
import tempfile

import torch
from peft import LoraConfig, get_peft_model
from transformers import Trainer

import torchfuser
from common import (StepTimer, add_model_args, load_model, print_result, random_tokens,
                    train_and_compare, trainer_losses, trainer_timer_callback, training_arguments)


def train(args, fused: bool) -> dict:
    model = load_model(args)
    if fused:
        torchfuser.optimize(model, backend=args.backend)
    # init_lora_weights=False: B starts random, not zero, so the adapters change the loss from the first step.
    lora = LoraConfig(r=args.rank, lora_alpha=2 * args.rank, target_modules=args.targets, lora_dropout=0.0,
                      init_lora_weights=args.init_zero or False)
    torch.manual_seed(args.seed + 1)  # the adapters' initial weights, the same for both runs
    model = get_peft_model(model, lora)
    if fused:
        print(torchfuser.report(model).summary())
    model.print_trainable_parameters()
    data = [{"input_ids": ids, "labels": ids} for ids in random_tokens(model.config.vocab_size, 64, args.seq)]
    timer = StepTimer()
    with tempfile.TemporaryDirectory() as scratch:
        training = training_arguments(args, scratch)
        trainer = Trainer(model=model, args=training, train_dataset=data, callbacks=[trainer_timer_callback(timer)])
        trainer.train()
    return print_result("fused" if fused else "unfused", trainer_losses(trainer),
                        timer.tokens_per_s(args.batch * args.seq), timer.ms_per_step())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_model_args(parser)
    parser.add_argument("--rank", type=int, default=8)
    parser.add_argument("--targets", nargs="+", default=["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj",
                                                         "up_proj", "down_proj"])
    parser.add_argument("--init-zero", action="store_true", help="PEFT's default init (B = 0)")
    parser.add_argument("--output", help="where to save the adapter checkpoint (default: nothing is saved)")
    args = parser.parse_args()
    train_and_compare(train, args)


if __name__ == "__main__":
    main()
