"""What the recipes share: the model from --config or --checkpoint, the data, timing, the result line.

Copy this file along with the recipe you take. Nothing here downloads anything: a config is a
``config.json`` (or a ``model_type``, shrunk to a tiny size), a checkpoint is a local directory,
and the data are random tokens or the tiny text below.
"""
from __future__ import annotations

import argparse
import json
import os
import time
from pathlib import Path

import torch

HERE = Path(__file__).resolve().parent
TINY = HERE / "tiny.json"

# Generic size fields of transformers' configs, for ``--config <model_type>``: the type's defaults
# (billions of parameters) shrunk to a model that trains on a CPU in seconds.
_TINY_FIELDS = {
    "vocab_size": 1024, "hidden_size": 128, "n_embd": 128, "d_model": 128, "intermediate_size": 256,
    "n_inner": 256, "num_hidden_layers": 2, "n_layer": 2, "num_attention_heads": 4, "n_head": 4,
    "num_key_value_heads": 2, "head_dim": 32, "num_local_experts": 4, "num_experts": 4, "num_experts_per_tok": 2,
    "moe_intermediate_size": 64, "shared_expert_intermediate_size": 64, "max_position_embeddings": 512,
    "n_positions": 512,
}

TINY_TEXT = """\
The quick brown fox jumps over the lazy dog.
A fused kernel reads its input once and writes its output once.
Norms, rotary embeddings and attention are the usual suspects.
Training on a laptop is slow; training a tiny model is not.
Every parameter keeps its name, so checkpoints load anywhere.
The loss should not change when the modules do.
Short line.
A somewhat longer line that pads the batch and makes padding matter to the loss.
Packing puts several lines in one row; padding-free drops the pad tokens altogether.
Gradients flow through the fused modules as through the originals.
"""


def add_model_args(parser: argparse.ArgumentParser, steps: int = 20, batch: int = 4, seq: int = 128) -> None:
    src = parser.add_mutually_exclusive_group()
    src.add_argument("--config", default=str(TINY),
                     help="a config.json (model_type plus fields) or a model_type (shrunk to a tiny size)")
    src.add_argument("--checkpoint", help="a local directory saved by save_pretrained (its weights are used)")
    parser.add_argument("--steps", type=int, default=steps)
    parser.add_argument("--batch", type=int, default=batch)
    parser.add_argument("--seq", type=int, default=seq)
    parser.add_argument("--lr", type=float, default=1e-3)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--backend", default="auto", help="torchfuser backend: auto, reference, mlir, triton")
    parser.add_argument("--compare", action="store_true", help="also run the unfused model and compare")
    parser.add_argument("--dtype", default=None, help="float32 or bfloat16 (default: bf16 on CUDA, fp32 on the CPU)")


def on_gpus() -> bool:
    """CUDA, with a GPU for every local rank (torchrun's ranks on one GPU machine run on the CPU)."""
    ranks = int(os.environ.get("LOCAL_WORLD_SIZE", 1))
    return torch.cuda.is_available() and ranks <= torch.cuda.device_count()


def device() -> torch.device:
    if on_gpus():
        return torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0)))
    return torch.device("cpu")


def train_and_compare(train, args) -> None:
    """``train(args, fused=True)``, then with ``--compare`` the unfused run and their comparison."""
    fused = train(args, fused=True)
    if args.compare:
        print_comparison(fused, train(args, fused=False))


def training_arguments(args, scratch: str):
    """The Trainer's arguments the recipes share: a step budget, a log line a step, a checkpoint at
    the end only where ``--output`` asks for one, bf16 on GPUs."""
    from transformers import TrainingArguments

    return TrainingArguments(
        output_dir=args.output or scratch, max_steps=args.steps, per_device_train_batch_size=args.batch,
        learning_rate=args.lr, logging_steps=1, save_strategy="steps" if args.output else "no",
        save_steps=args.steps, report_to=[], seed=args.seed, use_cpu=not on_gpus(),
        bf16=dtype(args) == torch.bfloat16, disable_tqdm=True, log_level="warning")


def dtype(args) -> torch.dtype:
    if args.dtype:
        return getattr(torch, args.dtype)
    return torch.bfloat16 if on_gpus() else torch.float32


def load_config(arg: str):
    from transformers import AutoConfig

    path = Path(arg)
    if path.suffix == ".json" or path.is_file():
        fields = json.loads(path.read_text())
        kind = fields.pop("model_type")
    else:  # a model type: its defaults, shrunk
        kind, defaults = arg, AutoConfig.for_model(arg).to_dict()
        fields = {k: v for k, v in _TINY_FIELDS.items() if k in defaults}
    fields.setdefault("attn_implementation", "sdpa")
    return AutoConfig.for_model(kind, **fields)


def load_model(args, seed: int | None = None):
    """The model on the CPU in fp32: the checkpoint's weights, or random ones drawn from ``seed``."""
    from transformers import AutoModelForCausalLM

    if args.checkpoint:
        return AutoModelForCausalLM.from_pretrained(args.checkpoint, local_files_only=True, attn_implementation="sdpa",
                                                    dtype=torch.float32)
    torch.manual_seed(args.seed if seed is None else seed)
    return AutoModelForCausalLM.from_config(load_config(args.config), dtype=torch.float32)


def random_tokens(vocab: int, rows: int, seq: int, seed: int = 0) -> torch.Tensor:
    # Ids from 3 up: low ids are often pad/bos/eos, which some models treat specially.
    return torch.randint(3, vocab, (rows, seq), generator=torch.Generator().manual_seed(seed))


class StepTimer:
    """Wall time of the steps after the first (compilation and warm-up happen at the first)."""

    def __init__(self):
        self.times: list[float] = []
        self._t = None

    def start(self):
        if torch.cuda.is_available():
            torch.cuda.synchronize()
        self._t = time.perf_counter()

    def stop(self):
        if torch.cuda.is_available():
            torch.cuda.synchronize()
        self.times.append(time.perf_counter() - self._t)

    def tokens_per_s(self, tokens_per_step: float) -> float:
        steady = self.times[1:] or self.times
        return tokens_per_step * len(steady) / max(sum(steady), 1e-9)

    def ms_per_step(self) -> float:
        steady = self.times[1:] or self.times
        return 1e3 * sum(steady) / max(len(steady), 1)


def trainer_timer_callback(timer: StepTimer):
    """A transformers TrainerCallback that times each optimizer step with ``timer``."""
    from transformers import TrainerCallback

    class _Timing(TrainerCallback):
        def on_step_begin(self, args, state, control, **kwargs):
            timer.start()

        def on_step_end(self, args, state, control, **kwargs):
            timer.stop()

    return _Timing()


def trainer_losses(trainer) -> list[float]:
    return [entry["loss"] for entry in trainer.state.log_history if "loss" in entry]


def print_result(variant: str, losses: list[float], tokens_per_s: float, ms_per_step: float, **extra) -> dict:
    """One human line and one machine line (``RESULT {json}``, which the tests read)."""
    result = {"variant": variant, "losses": losses, "tokens_per_s": tokens_per_s, "ms_per_step": ms_per_step, **extra}
    first, last = (f"{losses[0]:.4f}", f"{losses[-1]:.4f}") if losses else ("-", "-")
    print(f"{variant:>8}: loss {first} -> {last}, {tokens_per_s:,.0f} tokens/s, {ms_per_step:.1f} ms/step")
    print("RESULT " + json.dumps(result), flush=True)
    return result


def print_comparison(fused: dict, unfused: dict) -> float:
    diff = max((abs(a - b) for a, b in zip(fused["losses"], unfused["losses"])), default=0.0)
    speed = fused["tokens_per_s"] / max(unfused["tokens_per_s"], 1e-9)
    print(f"fused vs unfused: largest loss difference {diff:.2e}, speed {speed:.2f}x "
          "(what this run measured on this machine)")
    return diff


def lora_config(rank: int, seed: int):
    """PEFT LoRA on every linear layer with non-zero B (so the first step already trains the adapters), the
    generator seeded so that the fused and the unfused run start from the same adapters."""
    from peft import LoraConfig

    torch.manual_seed(seed)
    return LoraConfig(r=rank, lora_alpha=2 * rank, target_modules="all-linear", lora_dropout=0.0,
                      init_lora_weights=False)


def trl_result(trainer, fused: bool, timer: StepTimer, tokens: int, **extra) -> dict:
    """Print the report's summary and its LM-head note (fused runs), then the result line of a TRL run."""
    import torchfuser

    rep = torchfuser.report(trainer.model) if fused else None
    if rep is not None:
        print(rep.summary())
        print("\n".join(n for n in rep.notes if "LM head" in n))
    log = trainer.state.log_history
    return print_result("fused" if fused else "unfused", trainer_losses(trainer), timer.tokens_per_s(tokens),
                        timer.ms_per_step(), grad_norms=[e["grad_norm"] for e in log if "grad_norm" in e],
                        fused_blocks=len(rep.fused) if rep else 0,
                        trl_head=bool(rep and any("LM head: TRL's chunked kernels run" in n for n in rep.notes)),
                        **extra)
