"""Train a recipe with the Hugging Face Trainer and TorchFuserCallback (random weights, synthetic data).

    python recipes/hf_trainer.py recipes/tiny.json --steps 20 --output /tmp/tf-run
"""
from __future__ import annotations

import argparse
import json

import torch
from transformers import AutoConfig, AutoModelForCausalLM, Trainer, TrainingArguments

import torchfuser


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("recipe")
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--seq", type=int, default=128)
    parser.add_argument("--output", default="tf-trainer-run")
    args = parser.parse_args()
    fields = json.load(open(args.recipe))
    cfg = AutoConfig.for_model(fields.pop("model_type"), **fields)
    model = AutoModelForCausalLM.from_config(cfg)
    gen = torch.Generator().manual_seed(0)
    data = [{"input_ids": ids, "labels": ids} for ids in torch.randint(0, cfg.vocab_size, (64, args.seq), generator=gen)]
    training = TrainingArguments(output_dir=args.output, max_steps=args.steps, per_device_train_batch_size=4,
                                 logging_steps=5, report_to=[], bf16=torch.cuda.is_available())
    trainer = Trainer(model=model, args=training, train_dataset=data, callbacks=[torchfuser.TorchFuserCallback()])
    print(torchfuser.report(model).summary())
    trainer.train()


if __name__ == "__main__":
    main()
