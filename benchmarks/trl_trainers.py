"""TRL's post-training trainers, whole optimizer steps: TRL alone, TRL with ``use_liger_kernel=True``, and TRL
with ``TorchFuserCallback`` (issue 39's targets; docs/performance/NOTES-trl.md).

    python benchmarks/trl_trainers.py --workload dpo --out trl.jsonl        # Llama-3-8B shapes, LoRA r16, 4 pairs × 2048
    python benchmarks/trl_trainers.py --workload grpo --out trl.jsonl       # Qwen2.5-1.5B, full, 16 completions × 1024
    python benchmarks/trl_trainers.py --workload distill --out trl.jsonl    # 1.5B student, 7B teacher, 8 × 1024
    python benchmarks/trl_trainers.py --workload dpo --model tiny --teacher tiny --seq 64 --steps 2 --device cpu  # smoke

Random weights from recipes/<config>.json, bf16 on the GPU, text of random characters through a character
tokenizer (every sequence exactly as long as asked; nothing downloaded). Each variant runs in a process of its
own (``use_liger_kernel=True`` patches transformers' classes for the whole process, and the peak memory is the
process's), builds its trainer from the same seed, runs ``--warmup`` steps, then times ``--steps`` optimizer steps (synchronised
at each step's ends) and reads the peak memory of the timed steps. One JSON line per variant.

GRPO and distillation time the **training half**: the rollouts are replaced by fixed random completions of
exactly ``--completion`` tokens (the trainer's ``_generate_single_turn``), so the step is scoring, loss,
backward and optimizer, as the issue's targets ask. Rollout speed with ``generate`` is
benchmarks/probes/generate_rollouts.py.
"""
from __future__ import annotations

import argparse
import importlib.util
import json
import random
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT), str(ROOT / "recipes"), str(ROOT / "benchmarks")]

import torchfuser  # noqa: E402
from profiling import gpu_idle, write_tables  # noqa: E402

WORKLOADS = {  # model, teacher, LoRA rank, rows per optimizer step, prompt and completion tokens
    "dpo": dict(model="llama8b", lora=16, rows=4, prompt=512, completion=1536),
    "grpo": dict(model="qwen15b", lora=0, rows=16, prompt=128, completion=1024),
    "distill": dict(model="qwen15b", teacher="qwen7b", lora=0, rows=8, prompt=128, completion=1024),
}
ALPHABET = "abcdefghijklmnopqrstuvwxyz ABCDEFGHIJKLMNOPQRSTUVWXYZ.,;:!?0123456789"


def build(config: str, dtype, device, vocab_size: int | None = None):
    """A model of recipes/<config>.json with random weights; ``vocab_size`` overrides the recipe's (a distillation
    teacher must share the student's vocabulary: Qwen2.5-7B's is 152064, 1.5B's 151936)."""
    from transformers import AutoModelForCausalLM

    from common import load_config

    path = config if config.endswith(".json") else str(ROOT / "recipes" / f"{config}.json")
    cfg = load_config(path)
    if vocab_size is not None:
        cfg.vocab_size = vocab_size
    cfg._attn_implementation = "sdpa"
    torch.manual_seed(0)
    with torch.device(device):
        return AutoModelForCausalLM.from_config(cfg, dtype=dtype)


def text(n: int, rng: random.Random) -> str:
    return "".join(rng.choice(ALPHABET) for _ in range(n))


def dataset(workload: str, rows: int, prompt: int, completion: int):
    from datasets import Dataset

    rng = random.Random(0)
    n = rows * 64
    if workload == "dpo":
        return Dataset.from_dict({"prompt": [text(prompt, rng) for _ in range(n)],
                                  "chosen": [text(completion, rng) for _ in range(n)],
                                  "rejected": [text(completion, rng) for _ in range(n)]})
    return Dataset.from_dict({"prompt": [text(prompt, rng) for _ in range(n)]})


def fixed_rollouts(cls, completion: int, vocab: int):
    """``cls`` whose rollouts are random completions of exactly ``completion`` tokens (no generate)."""
    class Fixed(cls):
        def _generate_single_turn(self, prompt_ids, *args, **kwargs):
            gen = torch.Generator().manual_seed(self.state.global_step)
            # prompt_ids holds one row per completion already (the sampler repeats each prompt per generation)
            ids = torch.randint(4, vocab, (len(prompt_ids), completion), generator=gen).tolist()
            return (ids, None) if cls.__name__ == "GRPOTrainer" else ids
    Fixed.__name__ = cls.__name__
    return Fixed


class _Timer:
    """Times every optimizer step after ``warmup``; with ``profile`` (a path), the last step also runs under the
    profiler (after the timing: its overhead is not in the times) and its tables are written there."""

    def __init__(self, warmup: int, cuda: bool, last: int, profile: Path | None = None):
        self.warmup, self.cuda, self.last, self.profile = warmup, cuda, last, profile
        self.times, self._t, self._prof = [], None, None

    def callback(self):
        from transformers import TrainerCallback

        timer = self

        class Timing(TrainerCallback):
            def on_step_begin(self, args, state, control, **kwargs):
                if timer.cuda:
                    torch.cuda.synchronize()
                    if state.global_step == timer.warmup:
                        torch.cuda.reset_peak_memory_stats()
                if timer.profile and state.global_step == timer.last:
                    timer._prof = torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU] + (
                        [torch.profiler.ProfilerActivity.CUDA] if timer.cuda else []))
                    timer._prof.__enter__()
                timer._t = time.perf_counter()

            def on_step_end(self, args, state, control, **kwargs):
                if timer.cuda:
                    torch.cuda.synchronize()
                if state.global_step > timer.warmup and timer._prof is None:
                    timer.times.append((time.perf_counter() - timer._t) * 1e3)
                if timer._prof is not None:
                    timer._prof.__exit__(None, None, None)
                    key = "self_cuda_time_total" if timer.cuda else "self_cpu_time_total"
                    write_tables(timer._prof, timer.profile, (key,), 90, 200, gpu_idle(timer._prof) if timer.cuda else "")
                    timer._prof = None
        return Timing()


def run(variant: str, args) -> dict:
    import trl

    from sft_trl import char_tokenizer

    spec = WORKLOADS[args.workload]
    cuda = args.device.startswith("cuda")
    dtype = torch.bfloat16 if cuda else torch.float32
    model = build(args.model or spec["model"], dtype, args.device)
    tokenizer = char_tokenizer(ALPHABET)
    lora = spec["lora"] if args.lora is None else args.lora
    peft_config = None
    if lora:
        from peft import LoraConfig

        peft_config = LoraConfig(r=lora, lora_alpha=2 * lora, target_modules="all-linear", lora_dropout=0.0)
    rows, prompt, completion = args.rows or spec["rows"], args.prompt or spec["prompt"], args.completion or spec["completion"]
    per_device = min(rows, args.micro_batch)
    common = dict(output_dir=tempfile.mkdtemp(), max_steps=args.warmup + args.steps + bool(args.profile_dir), per_device_train_batch_size=per_device,
                  gradient_accumulation_steps=rows // per_device, learning_rate=1e-6, logging_steps=1, save_strategy="no",
                  report_to=[], seed=0, use_cpu=not cuda, bf16=cuda, gradient_checkpointing=args.grad_checkpointing,
                  disable_tqdm=True, log_level="warning", use_liger_kernel=variant == "trl+liger")
    profile = Path(args.profile_dir) / f"profile-{args.workload}-{variant.replace('+', '_')}.txt" if args.profile_dir else None
    # one more step when profiled: the profiled step is not timed
    timer = _Timer(args.warmup, cuda, args.warmup + args.steps, profile)
    callbacks = [timer.callback()]
    if variant.startswith("torchfuser"):
        callbacks.append(torchfuser.TorchFuserCallback(verbose=False, **json.loads(args.tf_kwargs)))
    data = dataset(args.workload, rows, prompt, completion)
    vocab = len(tokenizer)
    if args.workload == "dpo":
        trainer = trl.DPOTrainer(model=model, args=trl.DPOConfig(max_length=prompt + completion, dataset_num_proc=1,
                                                                 **common),
                                 train_dataset=data, processing_class=tokenizer, peft_config=peft_config,
                                 callbacks=callbacks)
    elif args.workload == "grpo":
        cls = fixed_rollouts(trl.GRPOTrainer, completion, vocab)
        config = trl.GRPOConfig(num_generations=args.num_generations, max_completion_length=completion,
                                steps_per_generation=rows // per_device, **common)
        trainer = cls(model=model, reward_funcs=lambda completions, **kw: [float(c.count("a")) for c in completions],
                      args=config, train_dataset=data, processing_class=tokenizer, peft_config=peft_config,
                      callbacks=callbacks)
    else:
        teacher = build(args.teacher or spec["teacher"], dtype, args.device, model.config.vocab_size)
        if variant == "torchfuser+teacher":  # the callback fuses the model being trained; a user can fuse the teacher
            torchfuser.optimize(teacher)
        cls = fixed_rollouts(trl.DistillationTrainer, completion, vocab)
        trainer = cls(model=model, teacher_model=teacher, args=trl.DistillationConfig(max_completion_length=completion,
                                                                                     **common),
                      train_dataset=data, processing_class=tokenizer, peft_config=peft_config, callbacks=callbacks)
    trainer.train()
    row = dict(bench="trl_trainers", workload=args.workload, variant=variant, model=args.model or spec["model"],
               lora=lora, rows=rows, prompt=prompt, completion=completion, micro_batch=per_device,
               device=torch.cuda.get_device_name() if cuda else "cpu", torch=torch.__version__, trl=trl.__version__,
               ms_per_step=round(statistics.median(timer.times), 2) if timer.times else None,
               ms_rounds=[round(t, 2) for t in timer.times],
               losses=[e["loss"] for e in trainer.state.log_history if "loss" in e])
    if cuda:
        row["peak_gib"] = round(torch.cuda.max_memory_allocated() / 2**30, 2)
    if variant.startswith("torchfuser"):
        rep = torchfuser.report(trainer.model)
        row["fused"] = rep.summary()
        if variant == "torchfuser+teacher":
            row["teacher_fused"] = torchfuser.report(teacher).summary()
        row["lm_head"] = [n for n in rep.notes if n.startswith("lm_head_loss")]
    return row


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--workload", choices=list(WORKLOADS), required=True)
    parser.add_argument("--variants", nargs="+", default=["trl", "trl+liger", "torchfuser"],
                        choices=["trl", "trl+liger", "torchfuser", "torchfuser+teacher"])
    parser.add_argument("--model", help="recipes/<name>.json (default: the workload's)")
    parser.add_argument("--teacher")
    parser.add_argument("--lora", type=int, help="LoRA rank (0: full fine-tuning; default: the workload's)")
    parser.add_argument("--rows", type=int, help="sequences (pairs for DPO) per optimizer step")
    parser.add_argument("--prompt", type=int)
    parser.add_argument("--completion", type=int)
    parser.add_argument("--seq", type=int, help="shortcut: prompt = seq/4, completion = the rest")
    parser.add_argument("--micro-batch", type=int, default=4, help="per-device batch; the rest is accumulation")
    parser.add_argument("--num-generations", type=int, default=8)
    parser.add_argument("--grad-checkpointing", action="store_true")
    parser.add_argument("--tf-kwargs", default="{}", help="optimize's keywords for the torchfuser variant (JSON)")
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--profile-dir", help="profile one more step after the timed ones; its table goes here")
    parser.add_argument("--out")
    args = parser.parse_args()
    if args.seq:
        args.prompt, args.completion = args.seq // 4, args.seq - args.seq // 4
    if len(args.variants) > 1:  # one process per variant: Liger's patches and the peak memory are process-wide
        for variant in args.variants:
            at = sys.argv.index("--variants") if "--variants" in sys.argv else len(sys.argv)
            rest = [a for i, a in enumerate(sys.argv[1:], 1) if i < at or (i > at and not _variant_arg(sys.argv, at, i))]
            subprocess.run([sys.executable, sys.argv[0], *rest, "--variants", variant], check=False)
        return
    for variant in args.variants:
        if variant == "trl+liger" and importlib.util.find_spec("liger_kernel") is None:
            row = dict(bench="trl_trainers", workload=args.workload, variant=variant, skipped="liger-kernel not installed")
        else:
            try:
                row = run(variant, args)
            except torch.OutOfMemoryError:
                row = dict(bench="trl_trainers", workload=args.workload, variant=variant, error="out of memory")
        print(json.dumps(row), flush=True)
        if args.out:
            with open(args.out, "a") as f:
                f.write(json.dumps(row) + "\n")
        if torch.cuda.is_available():
            torch.cuda.empty_cache()


def _variant_arg(argv: list[str], at: int, i: int) -> bool:
    """Whether argv[i] is one of the names following ``--variants`` (at ``at``)."""
    return all(not argv[j].startswith("--") for j in range(at + 1, i + 1))


if __name__ == "__main__":
    main()
