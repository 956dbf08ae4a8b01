"""QLoRA: LoRA adapters with PEFT on a 4-bit (NF4 / FP4) or 8-bit bitsandbytes base, on a fused model.

    python recipes/qlora_peft.py                                  # tiny Llama, NF4, random tokens, CPU
    python recipes/qlora_peft.py --compare --quant fp4 --double-quant
    python recipes/qlora_peft.py --checkpoint ./my-model --quant nf4 --compute-dtype bfloat16

The usual flow: ``from_pretrained(quantization_config=BitsAndBytesConfig(...))``,
``prepare_model_for_kbit_training``, ``get_peft_model``, then ``torchfuser.optimize``. The attention and
MLP blocks stay fused: each base weight is dequantised (bitsandbytes' dequantisation, bit for bit) right
before its GEMM and again in the backward, never kept; the report says "fused with LoRA r=16 over NF4
base". Without ``--checkpoint`` the random model from ``--config`` is saved to a temporary directory and
quantised from there (transformers quantises while loading). The default config, ``tiny_fp8.json``, has
every side a multiple of the 64-element quantisation block: bitsandbytes' own CPU kernel dequantises
rows of partial blocks wrongly (docs/performance/NOTES-qlora.md). Needs peft, accelerate, bitsandbytes.
"""
from __future__ import annotations

import argparse
import tempfile

import torch
from peft import LoraConfig, get_peft_model, prepare_model_for_kbit_training
from transformers import AutoModelForCausalLM, BitsAndBytesConfig, Trainer

import torchfuser
from common import (HERE, StepTimer, add_model_args, device, load_model, print_result, random_tokens,
                    train_and_compare, trainer_losses, trainer_timer_callback, training_arguments)

ALL = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


def quantization(args) -> BitsAndBytesConfig:
    if args.quant == "int8":
        return BitsAndBytesConfig(load_in_8bit=True)
    return BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_quant_type=args.quant, bnb_4bit_use_double_quant=args.double_quant,
                              bnb_4bit_compute_dtype=getattr(torch, args.compute_dtype))


def load_quantised(args, path: str):
    return AutoModelForCausalLM.from_pretrained(path, quantization_config=quantization(args), local_files_only=True,
                                                attn_implementation="sdpa", dtype=torch.float32,
                                                device_map={"": device()})


def train(args, fused: bool) -> dict:
    with tempfile.TemporaryDirectory() as saved:
        if not args.checkpoint:  # the random model of --config, saved so that transformers quantises it on loading
            load_model(args).save_pretrained(saved)
        model = load_quantised(args, args.checkpoint or saved)
    model = prepare_model_for_kbit_training(model, use_gradient_checkpointing=args.checkpointing)
    lora = LoraConfig(r=args.rank, lora_alpha=2 * args.rank, target_modules=args.targets, lora_dropout=0.0,
                      init_lora_weights=False)  # B random, not zero: the adapters change the loss from the first step
    torch.manual_seed(args.seed + 1)
    model = get_peft_model(model, lora)
    fused_blocks = 0
    if fused:
        torchfuser.optimize(model, backend=args.backend)
        report = torchfuser.report(model)
        print(report.summary())
        print("\n".join(n for n in report.notes if n.startswith("adapters: ")))  # "... fused with LoRA r=16 over NF4 base"
        fused_blocks = sum(c["fused"] for k, c in report.counts().items() if k in ("attention", "gated_mlp"))
    data = [{"input_ids": ids, "labels": ids} for ids in random_tokens(model.config.vocab_size, 64, args.seq)]
    timer = StepTimer()
    with tempfile.TemporaryDirectory() as scratch:
        training = training_arguments(args, scratch)
        # No autocast: the base GEMMs run in the bnb compute dtype (bf16 on GPUs by --compute-dtype), the adapters
        # in PEFT's fp32. Under autocast the fused path hands quantised projections back to PEFT (counted).
        training.bf16 = False
        trainer = Trainer(model=model, args=training, train_dataset=data, callbacks=[trainer_timer_callback(timer)])
        trainer.train()
    return print_result("fused" if fused else "unfused", trainer_losses(trainer),
                        timer.tokens_per_s(args.batch * args.seq), timer.ms_per_step(), fused_blocks=fused_blocks,
                        quant=args.quant)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_model_args(parser)
    parser.set_defaults(config=str(HERE / "tiny_fp8.json"))
    parser.add_argument("--quant", choices=["nf4", "fp4", "int8"], default="nf4")
    parser.add_argument("--double-quant", action="store_true", help="4-bit: quantise the block scales too")
    parser.add_argument("--compute-dtype", default=None, help="4-bit GEMM dtype (default: bfloat16 on CUDA, else float32)")
    parser.add_argument("--rank", type=int, default=16)
    parser.add_argument("--targets", nargs="+", default=ALL)
    parser.add_argument("--checkpointing", action="store_true", help="HF gradient checkpointing (PEFT's QLoRA default)")
    parser.add_argument("--output", help="where to save the adapter checkpoint (default: nothing is saved)")
    args = parser.parse_args()
    if args.compute_dtype is None:
        args.compute_dtype = "bfloat16" if device().type == "cuda" else "float32"
    train_and_compare(train, args)


if __name__ == "__main__":
    main()
