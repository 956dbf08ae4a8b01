"""Unsloth as train_step variants: ``unsloth`` (``FastLanguageModel``, no checkpointing) and
``unsloth-offload`` (Unsloth's offloaded gradient checkpointing, ``use_gradient_checkpointing="unsloth"``).

Unsloth patches transformers, PEFT and TRL for the whole process when it is imported, so each of
these variants runs in a process of its own and the other variants of the run stay unpatched:

1. the parent (``train_step.main`` → ``run_isolated``) builds the recipe's model from the run's seed,
   as every variant does, writes its weights (``save_pretrained``) and a tokenizer of the full
   vocabulary to a checkpoint folder, adds PEFT's LoRA adapters as ``--lora`` does and takes the
   loss of the first batch twice: bf16, as the PEFT eager variant's first step computes it, and with
   the same weights in fp32 (the reference of the numerics rule);
2. a worker (``python benchmarks/unsloth_variant.py --worker SPEC``) imports Unsloth before anything
   else, loads that checkpoint with ``FastLanguageModel.from_pretrained`` and adds adapters with
   ``get_peft_model`` (the settings of ``workloads.add_lora``: r, α = 2r, q/k/v/o/gate/up/down,
   dropout 0, no bias), then trains through ``train_step.run_variant``: the loop, optimizer, batches,
   timing and peak memory of the other variants;
3. the parent merges the worker's JSON row with the first step's losses (``loss_first_step``) and
   whether Unsloth's loss is within the bf16 rule of docs/numerics.md (``loss_parity``).

On the GPU machine nothing can be downloaded: the wheels travel in ``.whl``
(benchmarks/fetch_unsloth_wheels.sh, benchmarks/unsloth_wheels.md); without them the variants are
skipped with the reason.
"""
from __future__ import annotations

import argparse
import atexit
import contextlib
import ctypes
import gc
import importlib.util
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
from collections import deque
from pathlib import Path

VARIANTS = ("unsloth", "unsloth-offload")
# use_gradient_checkpointing, in from_pretrained and get_peft_model alike (its default is "unsloth").
CHECKPOINTING = {"unsloth": False, "unsloth-offload": "unsloth"}
# FastLanguageModel's own fast paths (loader.py dispatches these; other types go to its generic FastModel).
FAMILIES = ("llama", "mistral", "qwen2", "qwen3")
TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
BF16_ATOL = 1e-2  # tests/numerics.py ATOL[torch.bfloat16]
# Unsloth's offloaded checkpointing falls back to plain checkpointing below this max_seq_length
# (apply_unsloth_gradient_checkpointing): loads ask for at least this so a short smoke run exercises it.
_MIN_MAX_SEQ = 512
_HERE = Path(__file__).resolve()


def longest_row(args) -> int:
    """The longest row of the run's batches (workloads.py): packed rows are PACK tokens."""
    import workloads

    return workloads.PACK if args.workload == "packed" else max([args.seq, *(getattr(args, "ladder", None) or [])])


def skip_reason(config, args, device) -> str | None:
    """Why the unsloth variants cannot run for this model and run, or None."""
    if device.type != "cuda":
        return "Unsloth needs a CUDA GPU"
    if not args.lora:
        return "the unsloth variants train LoRA adapters: pass --lora R"
    if args.precision != "bf16":
        return "the unsloth variants load bf16 weights, as Unsloth trains: pass --precision bf16"
    if getattr(args, "quant", None) == "fp4":
        return "Unsloth's loader quantises to NF4 (load_in_4bit) or int8, not FP4"
    if config.model_type not in FAMILIES:
        return f"model type {config.model_type!r} is not one of FastLanguageModel's fast paths ({', '.join(FAMILIES)})"
    if importlib.util.find_spec("unsloth") is None:
        return "unsloth is not installed (carry the wheels of benchmarks/fetch_unsloth_wheels.sh in .whl)"
    return None


# ---------------------------------------------------------------------------------------------- parent


_CHECKPOINTS: dict = {}  # (recipe, seed, lora, workload, batch, seq) → (folder, first-step losses)


def _scratch(nbytes: int) -> str | None:
    """/dev/shm when it holds the weights with room to spare (writing and reading 16 GB there takes
    seconds, not the half-minute of the disk), else the default temporary folder."""
    try:
        if shutil.disk_usage("/dev/shm").free > nbytes + (8 << 30):
            return "/dev/shm"
    except OSError:
        pass
    return None


def write_tokenizer(vocab_size: int, folder) -> None:
    """A word-level tokenizer of exactly ``vocab_size`` tokens (t4, t5, … plus four specials), built
    here with ``tokenizers``: FastLanguageModel.from_pretrained loads a tokenizer with the model, and
    nothing can be downloaded. Its pad token is one of the vocabulary's, so nothing is resized."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    specials = ["<unk>", "<s>", "</s>", "<pad>"]
    vocab = {t: i for i, t in enumerate(specials)}
    vocab.update((f"t{i}", i) for i in range(len(specials), vocab_size))
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="<unk>", bos_token="<s>", eos_token="</s>",
                                   pad_token="<pad>", model_max_length=1 << 20)
    fast.save_pretrained(folder)


def prepare_checkpoint(recipe, args, device, build, batches):
    """The checkpoint folder of ``recipe``'s model at the run's seed (the weights every variant starts
    from) and the first batch's loss of the PEFT model (bf16, as the eager variant's first step; and
    the same weights in fp32), once per recipe and run."""
    import torch
    import workloads

    key = (recipe, args.seed, args.lora, args.workload, args.batch, args.seq)
    if key in _CHECKPOINTS:
        return _CHECKPOINTS[key]
    model = build(recipe, device, args.seed, torch.bfloat16)
    # HF's RoPE takes any position; Unsloth would truncate rows past max_seq_length and rescale RoPE
    # for one past max_position_embeddings. Only the saved config changes: the weights are the same.
    model.config.max_position_embeddings = max(model.config.max_position_embeddings, longest_row(args))
    nbytes = sum(p.numel() * p.element_size() for p in model.parameters())
    folder = tempfile.mkdtemp(prefix=f"tf-unsloth-{recipe}-", dir=_scratch(nbytes))
    atexit.register(shutil.rmtree, folder, True)
    model.save_pretrained(folder)
    write_tokenizer(model.config.vocab_size, folder)
    # context_length.py's ladder: lengths past the fp32 reference's memory, and no parity asked of it
    losses = {"peft_eager_bf16": None, "reference_fp32": None} if getattr(args, "ladder", None) else \
        _peft_losses(workloads.add_lora(model, args.lora, args.seed), batches(args, model.config.vocab_size, device)[0])
    del model
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()
    _CHECKPOINTS[key] = folder, losses
    return _CHECKPOINTS[key]


def _peft_losses(model, batch: dict) -> dict:
    """The first batch's loss of the PEFT model in bf16 and of the same weights in fp32 (None if it does not fit)."""
    import torch

    inputs = {k: v for k, v in batch.items() if k != "tokens"}
    losses = {}
    with torch.no_grad():
        losses["peft_eager_bf16"] = model(**inputs, use_cache=False).loss.item()
        tf32 = torch.backends.cuda.matmul.allow_tf32
        torch.backends.cuda.matmul.allow_tf32 = False
        try:  # the same (bf16-rounded) weights in fp32 (the adapters are fp32 already): 2× the memory
            losses["reference_fp32"] = model.float()(**inputs, use_cache=False).loss.item()
        except torch.cuda.OutOfMemoryError:
            losses["reference_fp32"] = None
        finally:
            torch.backends.cuda.matmul.allow_tf32 = tf32
    return losses


def parity(unsloth_loss: float, losses: dict) -> dict:
    """docs/numerics.md's rule on the first step's loss: |unsloth − ref| ≤ 2·|PEFT bf16 − ref| + atol."""
    ref = losses["reference_fp32"]
    if ref is None:  # the fp32 reference did not fit
        return {"within_rule": None}
    err, base = abs(unsloth_loss - ref), abs(losses["peft_eager_bf16"] - ref)
    return {"unsloth_error": err, "peft_error": base, "atol": BF16_ATOL, "within_rule": err <= 2 * base + BF16_ATOL}


def run_isolated(recipe, variant, args, device, build, batches) -> dict:
    """One unsloth variant in a worker process; its JSON row with the first step's losses merged in."""
    import torch

    folder, losses = prepare_checkpoint(recipe, args, device, build, batches)
    with tempfile.TemporaryDirectory(prefix="tf-unsloth-run-") as tmp:
        spec, out = Path(tmp) / "spec.json", Path(tmp) / "row.json"
        spec.write_text(json.dumps({"recipe": recipe, "variant": variant, "device": str(device), "out": str(out),
                                    "parent": os.getpid(), "args": {**vars(args), "unsloth_checkpoint": folder}}))
        env = {**os.environ, "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1",
               "UNSLOTH_DISABLE_STATISTICS": "1", "UNSLOTH_COMPILE_LOCATION": str(Path(tmp) / "compiled"),
               "PYTHONUNBUFFERED": "1", "TOKENIZERS_PARALLELISM": "false"}
        if device.type == "cuda":
            torch.cuda.synchronize()
            torch.cuda.empty_cache()
        tail: deque = deque(maxlen=25)
        proc = subprocess.Popen([sys.executable, str(_HERE), "--worker", str(spec)], env=env, cwd=str(_HERE.parents[1]),
                                stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, errors="replace")
        for line in proc.stdout:
            print(f"[{variant}] {line}", end="", flush=True)
            tail.append(line.rstrip())
        rc = proc.wait()
        if rc != 0 or not out.exists():
            last = next((t for t in reversed(tail) if t.strip()), "")
            raise RuntimeError(f"the {variant} worker exited with {rc}: {last}")
        row = json.loads(out.read_text())
    if "error" not in row:
        first = row["loss_first_step"]["unsloth"]
        row["loss_first_step"].update(losses)
        # PEFT's losses are of the unquantised model: against a quantised Unsloth model they are no rule's reference.
        row["loss_parity"] = parity(first, losses) if not getattr(args, "quant", None) and losses["peft_eager_bf16"] \
            is not None else {"within_rule": None}
    return row


def cleanup() -> None:
    for folder, _ in _CHECKPOINTS.values():
        shutil.rmtree(folder, ignore_errors=True)
    _CHECKPOINTS.clear()


# ---------------------------------------------------------------------------------------------- worker


def _refuse_ldconfig():
    """Unsloth's import runs ``os.system("ldconfig …")`` as root when it finds CUDA not linked
    (_gpu_init.py), which would rewrite the machine's library cache: refuse those commands, for the
    worker's whole life (it is a process of its own)."""
    system = os.system

    def guarded(command):
        if "ldconfig" in str(command):
            print(f"unsloth_variant: refused os.system({command!r})", file=sys.stderr, flush=True)
            return 1
        return system(command)

    os.system = guarded


def import_unsloth():
    """Unsloth, imported before transformers and PEFT (it patches them as it is imported)."""
    assert "transformers" not in sys.modules and "peft" not in sys.modules, "import unsloth first"
    for name, value in (("HF_HUB_OFFLINE", "1"), ("UNSLOTH_DISABLE_STATISTICS", "1")):
        os.environ.setdefault(name, value)
    os.environ.setdefault("UNSLOTH_COMPILE_LOCATION", tempfile.mkdtemp(prefix="tf-unsloth-compiled-"))
    _refuse_ldconfig()
    import unsloth

    return unsloth


def load(variant: str, args):
    """The Unsloth model of ``args.unsloth_checkpoint`` with LoRA adapters, as ``--lora`` builds PEFT's."""
    import torch
    from unsloth import FastLanguageModel

    checkpointing = CHECKPOINTING[variant]
    # Unsloth truncates inputs past max_seq_length, and rescales RoPE for a max_seq_length past the
    # config's max_position_embeddings (prepare_checkpoint wrote it at least the longest row).
    config = json.loads((Path(args.unsloth_checkpoint) / "config.json").read_text())
    max_seq = min(max(longest_row(args), _MIN_MAX_SEQ), config["max_position_embeddings"])
    model, _tokenizer = FastLanguageModel.from_pretrained(
        model_name=args.unsloth_checkpoint, max_seq_length=max_seq, dtype=torch.bfloat16,
        load_in_4bit=getattr(args, "quant", None) == "nf4", load_in_8bit=getattr(args, "quant", None) == "int8",
        full_finetuning=False, use_gradient_checkpointing=checkpointing,
        use_exact_model_name=True, local_files_only=True, random_state=args.seed + 2)
    model = FastLanguageModel.get_peft_model(
        model, r=args.lora, lora_alpha=2 * args.lora, target_modules=TARGETS, lora_dropout=0.0, bias="none",
        use_gradient_checkpointing=checkpointing, random_state=args.seed + 2, use_rslora=False, loftq_config=None)
    return FastLanguageModel.for_training(model)  # train mode, keeping the checkpointing chosen above


def _die_with_parent(parent: int) -> None:
    """A SIGTERM when the parent dies (a stage's timeout kills only the parent), so that no orphan
    goes on training on the GPU."""
    with contextlib.suppress(Exception):
        ctypes.CDLL(None).prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG
    if os.getppid() != parent:  # it died before the line above
        sys.exit("unsloth_variant: the parent process is gone")


def worker(spec_path: str) -> None:
    spec = json.loads(Path(spec_path).read_text())
    _die_with_parent(spec["parent"])
    import_unsloth()
    sys.modules.setdefault("unsloth_variant", sys.modules[__name__])
    import torch
    import train_step

    args = argparse.Namespace(**spec["args"])
    try:
        row = train_step.run_variant(spec["recipe"], spec["variant"], args, torch.device(spec["device"]))
    except Exception as err:  # the parent reports it as the variant's error row
        import traceback

        traceback.print_exc()
        row = {"model": spec["recipe"], "variant": spec["variant"], "error": f"{type(err).__name__}: {err}"}
    Path(spec["out"]).write_text(json.dumps(row))


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description="The worker of train_step's unsloth variants (run by train_step).")
    parser.add_argument("--worker", required=True, metavar="SPEC", help="the JSON spec train_step wrote")
    worker(parser.parse_args().worker)
