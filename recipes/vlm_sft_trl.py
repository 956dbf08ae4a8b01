"""Vision-language fine-tuning with TRL's SFTTrainer, LoRA on the language model, and TorchFuserCallback.

    python recipes/vlm_sft_trl.py --compare                 # tiny Qwen2.5-VL-shaped model, generated images, CPU
    python recipes/vlm_sft_trl.py --checkpoint DIR --compare   # a local checkpoint and its processor (a GPU run)
    python recipes/vlm_sft_trl.py --config config.json --processor DIR   # random weights of a real shape

The data are image + text pairs: images drawn here (coloured squares and stripes on noise) and a caption
naming what is drawn, as a plain-text data set (``"images"`` and ``"text"`` columns) whose text holds the
image placeholder; SFTTrainer's vision collator runs the processor, which expands the placeholder into the
image's tokens and makes ``pixel_values`` and ``image_grid_thw``. Nothing is downloaded: without
``--checkpoint`` the processor is built here (a character tokenizer with Qwen-VL's vision tokens, and
Qwen2-VL's image processor at small sizes). LoRA adapters (r=8) sit on the language model's
projections only; the vision tower trains nothing and runs fused all the same.
(This recipe needs ``trl``, ``peft`` and Pillow.)
"""
from __future__ import annotations

import argparse
import tempfile

import numpy as np
import torch
from datasets import Dataset
from PIL import Image
from trl import SFTConfig, SFTTrainer

import torchfuser
from common import StepTimer, dtype, print_result, train_and_compare, trainer_losses, trainer_timer_callback

COLOURS = {"red": (220, 40, 40), "green": (40, 180, 60), "blue": (40, 70, 220), "yellow": (230, 210, 40)}
SHAPES = ("square", "stripes")
VISION_TOKENS = ["<|vision_start|>", "<|vision_end|>", "<|image_pad|>", "<|video_pad|>"]
CHARS = "abcdefghijklmnopqrstuvwxyz .,"
SIDE = 112  # image side in pixels: 8 × 8 patches of 14, 16 tokens after the 2 × 2 merge


def draw(colour: str, shape: str, rng: np.random.Generator) -> Image.Image:
    pixels = rng.integers(0, 60, (SIDE, SIDE, 3), dtype=np.uint8)
    if shape == "square":
        pixels[28:84, 28:84] = COLOURS[colour]
    else:
        pixels[::16][:8] = COLOURS[colour]
        pixels[8::16][:8] = COLOURS[colour]
    return Image.fromarray(pixels)


def dataset(rows: int, seed: int, placeholder: str) -> Dataset:
    rng = np.random.default_rng(seed)
    images, texts = [], []
    for i in range(rows):
        colour, shape = list(COLOURS)[i % len(COLOURS)], SHAPES[(i // len(COLOURS)) % len(SHAPES)]
        images.append([draw(colour, shape, rng)])
        texts.append(f"{placeholder}a {colour} {shape}.")
    return Dataset.from_dict({"images": images, "text": texts})


def tiny_processor():
    """Qwen2.5-VL's processor over a character tokenizer with the vision tokens (built here, nothing downloaded)."""
    from tokenizers import Regex, Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast, Qwen2_5_VLProcessor
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil

    specials = ["<pad>", "<s>", "</s>", "<unk>", *VISION_TOKENS]
    vocab = {t: i for i, t in enumerate(specials + sorted(set(CHARS)))}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Split(Regex(r"<\|[a-z_]+\|>|."), behavior="isolated")
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=tok, pad_token="<pad>", bos_token="<s>", eos_token="</s>",
                                        unk_token="<unk>", additional_special_tokens=VISION_TOKENS)

    class Processor(Qwen2_5_VLProcessor):
        def check_argument_for_proper_class(self, name, arg):
            # No video processor (it needs torchvision): images only.
            return None if name == "video_processor" and arg is None else super().check_argument_for_proper_class(name, arg)

    images = Qwen2VLImageProcessorPil(size={"shortest_edge": 56 * 56, "longest_edge": SIDE * SIDE})
    return Processor(image_processor=images, tokenizer=tokenizer, video_processor=None)


def tiny_model(processor, seed: int):
    from transformers import Qwen2_5_VLConfig, Qwen2_5_VLForConditionalGeneration

    ids = {t: processor.tokenizer.convert_tokens_to_ids(t) for t in VISION_TOKENS}
    text = dict(vocab_size=len(processor.tokenizer), hidden_size=128, intermediate_size=256, num_hidden_layers=2,
                num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
                rope_parameters={"rope_type": "default", "rope_theta": 1e6, "mrope_section": [4, 6, 6]})
    vision = dict(depth=2, hidden_size=64, intermediate_size=128, num_heads=4, out_hidden_size=128,
                  fullatt_block_indexes=[1], window_size=56)
    cfg = Qwen2_5_VLConfig(text_config=text, vision_config=vision, image_token_id=ids["<|image_pad|>"],
                           video_token_id=ids["<|video_pad|>"], vision_start_token_id=ids["<|vision_start|>"],
                           vision_end_token_id=ids["<|vision_end|>"], attn_implementation="sdpa")
    torch.manual_seed(seed)
    return Qwen2_5_VLForConditionalGeneration(cfg).float()


def load(args):
    from transformers import AutoConfig, AutoModelForImageTextToText, AutoProcessor

    if args.checkpoint:
        processor = AutoProcessor.from_pretrained(args.checkpoint, local_files_only=True)
        model = AutoModelForImageTextToText.from_pretrained(args.checkpoint, local_files_only=True,
                                                            attn_implementation="sdpa", dtype=dtype(args))
        return model, processor
    if args.config:  # random weights of a real shape, with that model's processor (its image tokens, its ids)
        if not args.processor:
            raise SystemExit("--config needs --processor DIR: the model's processor (its tokenizer's image token ids)")
        processor = AutoProcessor.from_pretrained(args.processor, local_files_only=True)
        cfg = AutoConfig.from_pretrained(args.config)
        torch.manual_seed(args.seed)
        model = AutoModelForImageTextToText.from_config(cfg, attn_implementation="sdpa", dtype=dtype(args))
        return model, processor
    processor = tiny_processor()
    return tiny_model(processor, args.seed), processor


def train(args, fused: bool) -> dict:
    from peft import LoraConfig

    model, processor = load(args)
    placeholder = "<|vision_start|><|image_pad|><|vision_end|>"
    data = dataset(args.rows, args.seed, placeholder)
    # The language model's projections only: the vision tower and the merger stay frozen.
    lora = LoraConfig(r=8, lora_alpha=16, lora_dropout=0.0, init_lora_weights=False,
                      target_modules=r".*language_model.*\.(q_proj|k_proj|v_proj|o_proj|gate_proj|up_proj|down_proj)")
    torch.manual_seed(args.seed + 1)  # the adapters' initial weights, the same for both runs
    timer = StepTimer()
    callbacks = [trainer_timer_callback(timer)] + ([torchfuser.TorchFuserCallback(backend=args.backend)] if fused else [])
    with tempfile.TemporaryDirectory() as scratch:
        config = SFTConfig(output_dir=scratch, max_steps=args.steps, per_device_train_batch_size=args.batch,
                           learning_rate=args.lr, logging_steps=1, save_strategy="no", report_to=[], seed=args.seed,
                           use_cpu=not torch.cuda.is_available(), bf16=dtype(args) == torch.bfloat16, max_length=None,
                           gradient_checkpointing=False, remove_unused_columns=False, dataset_num_proc=1, disable_tqdm=True, log_level="warning")
        trainer = SFTTrainer(model=model, args=config, train_dataset=data, processing_class=processor,
                             peft_config=lora, callbacks=callbacks)
        if fused:
            print(torchfuser.report(trainer.model).summary())
        trainer.train()
    rep = torchfuser.report(trainer.model) if fused else None
    # Text tokens (image tokens included) per step, from the trainer's own count.
    seen = [e["num_tokens"] for e in trainer.state.log_history if "num_tokens" in e]
    tokens = (seen[-1] if seen else 0) / max(trainer.state.global_step, 1)
    return print_result("fused" if fused else "unfused", trainer_losses(trainer), timer.tokens_per_s(tokens),
                        timer.ms_per_step(), fused_blocks=len(rep.fused) if rep else 0,
                        fused_patterns=sorted({e.pattern for e in rep.fused}) if rep else [])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    src = parser.add_mutually_exclusive_group()
    src.add_argument("--config", help="a config.json of an image-text-to-text model (random weights)")
    src.add_argument("--checkpoint", help="a local directory with the model and its processor")
    parser.add_argument("--processor", help="with --config: a local directory holding the model's processor")
    parser.add_argument("--steps", type=int, default=6)
    parser.add_argument("--batch", type=int, default=2)
    parser.add_argument("--rows", type=int, default=32, help="image + text pairs in the data set")
    parser.add_argument("--lr", type=float, default=1e-3)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--backend", default="auto", help="torchfuser backend: auto, reference, mlir, triton")
    parser.add_argument("--compare", action="store_true", help="also run the unfused model and compare")
    parser.add_argument("--dtype", default=None, help="float32 or bfloat16 (default: bf16 on CUDA, fp32 on the CPU)")
    train_and_compare(train, parser.parse_args())


if __name__ == "__main__":
    main()
