"""QLoRA models for train_step.py's ``--quant nf4|fp4|int8`` (issue 37): every variant then trains LoRA
adapters on a bitsandbytes base (``eager``: PEFT's QLoRA; ``torchfuser``: the same model fused, each base
dequantised per GEMM; ``unsloth`` / ``unsloth-offload``: Unsloth's loader with ``load_in_4bit`` /
``load_in_8bit``, benchmarks/unsloth_variant.py).

The recipe's random model (the run's seed, bf16) is written once per run to a checkpoint folder and loaded
from there with ``BitsAndBytesConfig`` (transformers quantises while loading; nothing is downloaded): the
same quantised weights for every variant. As Unsloth loads QLoRA: the unquantised parameters (embeddings,
norms, LM head) in the run's dtype, compute dtype bf16, PEFT adapters in fp32, no
``prepare_model_for_kbit_training`` (its fp32 copy of the LM head alone is 2 GB on llama8b).
"""
from __future__ import annotations

import atexit
import shutil
import tempfile

QUANTS = ("nf4", "fp4", "int8")
_FOLDERS: dict = {}  # (recipe, seed) → checkpoint folder


def _scratch(nbytes: int) -> str | None:
    """/dev/shm where it holds the weights with room to spare (seconds to write 16 GB, not the disk's half
    minute), else the default temporary folder."""
    try:
        return "/dev/shm" if shutil.disk_usage("/dev/shm").free > nbytes + (8 << 30) else None
    except OSError:
        return None


def checkpoint(recipe: str, seed: int, device, build) -> str:
    """The folder of ``recipe``'s model at ``seed`` in bf16 (written once per run)."""
    import torch

    key = (recipe, seed)
    if key not in _FOLDERS:
        model = build(recipe, torch.device("cpu") if device.type != "cuda" else device, seed, torch.bfloat16)
        folder = tempfile.mkdtemp(prefix=f"tf-qlora-{recipe}-", dir=_scratch(sum(p.numel() * 2 for p in model.parameters())))
        atexit.register(shutil.rmtree, folder, True)
        model.save_pretrained(folder)
        del model
        _FOLDERS[key] = folder
    return _FOLDERS[key]


def config(quant: str):
    import torch
    from transformers import BitsAndBytesConfig

    if quant == "int8":
        return BitsAndBytesConfig(load_in_8bit=True)
    return BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_quant_type=quant, bnb_4bit_use_double_quant=True,
                              bnb_4bit_compute_dtype=torch.bfloat16)


def load(recipe: str, args, device, build, dtype):
    """The quantised model (train mode, base frozen) on ``device``; LoRA is added by the caller."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(
        checkpoint(recipe, args.seed, device, build), quantization_config=config(args.quant), dtype=dtype,
        attn_implementation="sdpa", device_map={"": device}, local_files_only=True)
    for p in model.parameters():
        p.requires_grad_(False)
    if args.grad_checkpointing:  # inputs that need a gradient, as prepare_model_for_kbit_training makes them
        model.enable_input_require_grads()
    return model.train()
