"""Full fine-tuning with the Hugging Face Trainer and TorchFuserCallback.

    python recipes/hf_trainer.py                           # tiny Llama, random tokens, CPU
    python recipes/hf_trainer.py --config qwen2 --compare  # a tiny Qwen2, fused against unfused
    python recipes/hf_trainer.py --checkpoint ./my-model --steps 100 --output ./run

The callback fuses the model at the end of ``Trainer.__init__``, before the optimizer is built and
before any distributed wrapping; parameters stay the same objects under the same names, so the
checkpoints it saves load into plain ``transformers``. (This recipe needs ``accelerate``.)
"""
from __future__ import annotations

import argparse
import tempfile

from transformers import Trainer

import torchfuser
from common import (StepTimer, add_model_args, load_model, print_result, random_tokens,
                    train_and_compare, trainer_losses, trainer_timer_callback, training_arguments)


def train(args, fused: bool) -> dict:
    model = load_model(args)
    data = [{"input_ids": ids, "labels": ids} for ids in random_tokens(model.config.vocab_size, 64, args.seq)]
    timer = StepTimer()
    callbacks = [trainer_timer_callback(timer)]
    if fused:
        callbacks.append(torchfuser.TorchFuserCallback(backend=args.backend))
    with tempfile.TemporaryDirectory() as scratch:
        training = training_arguments(args, scratch)
        trainer = Trainer(model=model, args=training, train_dataset=data, callbacks=callbacks)
        if fused:
            print(torchfuser.report(model).summary())
        trainer.train()
    return print_result("fused" if fused else "unfused", trainer_losses(trainer),
                        timer.tokens_per_s(args.batch * args.seq), timer.ms_per_step())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("recipe", nargs="?", help="a config.json (the same as --config)")
    add_model_args(parser)
    parser.add_argument("--output", help="where to save the final checkpoint (default: nothing is saved)")
    args = parser.parse_args()
    if args.recipe:
        args.config = args.recipe
    train_and_compare(train, args)


if __name__ == "__main__":
    main()
