"""The recipes run as a user runs them (a subprocess, tiny model, CPU) and the fused run trains as the
unfused one: the same loss at every step, within fp32 tolerance. Each recipe prints ``RESULT {json}``."""
from __future__ import annotations

import importlib.util
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
RECIPES = ROOT / "recipes"


def _run(args: list[str], timeout: float = 120, launcher: list[str] | None = None) -> list[dict]:
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]),
               OMP_NUM_THREADS="1", TOKENIZERS_PARALLELISM="false", HF_HUB_OFFLINE="1", CUDA_VISIBLE_DEVICES="")
    cmd = (launcher or [sys.executable]) + [str(RECIPES / args[0]), *args[1:]]
    proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=timeout)
    assert proc.returncode == 0, f"{' '.join(cmd)} failed ({proc.returncode}):\n{proc.stdout[-3000:]}\n{proc.stderr[-8000:]}"
    results = [json.loads(line[len("RESULT "):]) for line in proc.stdout.splitlines() if line.startswith("RESULT ")]
    assert results, f"no RESULT line:\n{proc.stdout[-3000:]}"
    return results


def _same_training(results: list[dict], steps: int) -> dict:
    by = {r["variant"]: r for r in results}
    fused, unfused = by["fused"], by["unfused"]
    assert len(fused["losses"]) == len(unfused["losses"]) == steps
    assert all(loss == loss and 0 < loss < 20 for loss in fused["losses"]), fused["losses"]  # finite, plausible
    assert fused["losses"] == pytest.approx(unfused["losses"], rel=1e-5, abs=1e-5)
    assert fused["tokens_per_s"] > 0 and unfused["tokens_per_s"] > 0
    return fused


def _needs(*modules):
    missing = [m for m in modules if importlib.util.find_spec(m) is None]
    return pytest.mark.skipif(bool(missing), reason=f"needs {', '.join(missing)}")


@_needs("accelerate")
def test_hf_trainer_fused_trains_as_unfused():
    _same_training(_run(["hf_trainer.py", "--compare", "--steps", "4", "--seq", "64"]), 4)


@_needs("accelerate")
def test_hf_trainer_model_type_and_local_checkpoint(tmp_path):
    """--config <model_type> builds a tiny one; --checkpoint trains saved weights (nothing downloaded)."""
    [result] = _run(["hf_trainer.py", "--config", "qwen2", "--steps", "2", "--seq", "32", "--output", str(tmp_path)])
    assert len(result["losses"]) == 2
    saved = tmp_path / "checkpoint-2"
    assert (saved / "config.json").is_file() and json.loads((saved / "config.json").read_text())["model_type"] == "qwen2"
    [again] = _run(["hf_trainer.py", "--checkpoint", str(saved), "--steps", "2", "--seq", "32"])
    # The checkpoint carries the trained weights: its first loss is below the random model's.
    assert again["losses"][0] < result["losses"][0]


@_needs("accelerate", "peft")
def test_lora_fused_trains_as_unfused():
    _same_training(_run(["lora_peft.py", "--compare", "--steps", "3", "--seq", "64"]), 3)


@_needs("accelerate", "peft", "bitsandbytes")
# The second variant of each recipe (here and below) runs in the slow step: the quick suite keeps one each.
@pytest.mark.parametrize("flags", [pytest.param([], id="nf4"), pytest.param(["--quant", "int8"], id="int8", marks=pytest.mark.slow)])
def test_qlora_fused_trains_as_unfused(flags):
    fused = _same_training(_run(["qlora_peft.py", "--compare", "--steps", "3", "--seq", "64", *flags]), 3)
    assert fused["fused_blocks"] == 4  # both layers' attention and MLP, over their quantised bases


@_needs("accelerate", "trl")
# 11 of the 12 blocks: SFTTrainer computes the LM head and loss with TRL's own fused head (add_fused_lm_head),
# which bypasses lm_head_loss; the report lists it "bypassed" (tests/test_trl_report.py).
@pytest.mark.parametrize("flags, blocks", [
    pytest.param([], 11, id="padded"),
    pytest.param(["--padding-free"], 11, id="padding-free", marks=pytest.mark.slow),
    pytest.param(["--packing"], 11, id="packing", marks=pytest.mark.slow),
    pytest.param(["--lora"], 11, id="lora"),  # SFTTrainer adds the adapters first: the blocks stay fused around them
    pytest.param(["--lora", "--optimize-first"], 11, id="lora-optimize-first", marks=pytest.mark.slow),
])
def test_sft_trl_fused_trains_as_unfused(flags, blocks):
    fused = _same_training(_run(["sft_trl.py", "--compare", "--steps", "3", *flags]), 3)
    assert fused["fused_blocks"] == blocks


@_needs("accelerate", "trl", "peft", "PIL")
def test_vlm_sft_trl_fused_trains_as_unfused():
    """Image + text pairs through SFTTrainer's vision collator, LoRA on the language model: both towers fused
    (the vision attention over cu_seqlens included), the losses the unfused run's."""
    fused = _same_training(_run(["vlm_sft_trl.py", "--compare", "--steps", "3"], timeout=300), 3)
    assert {"varlen_attention", "attention", "gated_mlp", "rms_norm"} <= set(fused["fused_patterns"])


@pytest.mark.parametrize("parallel", ["none", "ddp", pytest.param("fsdp2", marks=pytest.mark.slow)])
def test_torchrun_loop_fused_trains_as_unfused(parallel):
    args = ["torchrun_loop.py", "--compare", "--steps", "3", "--seq", "64", "--parallel", parallel]
    if parallel == "none":
        results = _run(args)
    else:
        torchrun = shutil.which("torchrun", path=str(Path(sys.executable).parent)) or shutil.which("torchrun")
        if torchrun is None:
            pytest.skip("torchrun is not on the PATH")
        results = _run(args, timeout=180, launcher=[torchrun, "--nproc_per_node=2", "--standalone"])
    fused = _same_training(results, 3)
    assert fused["world_size"] == (1 if parallel == "none" else 2)


def test_torchrun_loop_refuses_ddp_without_torchrun():
    proc = subprocess.run([sys.executable, str(RECIPES / "torchrun_loop.py"), "--parallel", "ddp"], cwd=ROOT,
                          capture_output=True, text=True, timeout=180,
                          env=dict(os.environ, PYTHONPATH=str(ROOT)))
    assert proc.returncode != 0 and "torchrun" in proc.stderr


def _same_trl_run(results: list[dict], steps: int) -> dict:
    """The TRL post-training recipes: GRPO's loss is ~0 on-policy by construction, so the gradient norms of
    every step (and GRPO's rewards, which depend on the rollouts) are compared too."""
    by = {r["variant"]: r for r in results}
    fused, unfused = by["fused"], by["unfused"]
    assert len(fused["losses"]) == len(unfused["losses"]) == steps
    assert fused["losses"] == pytest.approx(unfused["losses"], rel=1e-5, abs=1e-6)
    assert len(fused["grad_norms"]) == steps and all(g > 0 for g in fused["grad_norms"]), fused["grad_norms"]
    assert fused["grad_norms"] == pytest.approx(unfused["grad_norms"], rel=1e-4, abs=1e-6)
    assert fused.get("rewards") == unfused.get("rewards")
    assert fused["trl_head"] and fused["fused_blocks"] == 11  # everything but the LM head, which TRL's runs
    return fused


@_needs("accelerate", "trl")
@pytest.mark.parametrize("flags", [pytest.param([], id="ref-model"),
                                   pytest.param(["--lora", "--loss-type", "sigmoid", "sft"], id="lora-mpo",
                                                marks=pytest.mark.slow)])
def test_dpo_trl_fused_trains_as_unfused(flags):
    _same_trl_run(_run(["dpo_trl.py", "--compare", "--steps", "2", "--backend", "reference", *flags]), 2)


@_needs("accelerate", "trl")
@pytest.mark.parametrize("flags", [pytest.param([], id="full"),
                                   pytest.param(["--lora", "--beta", "0.05"], id="lora-kl", marks=pytest.mark.slow)])
def test_grpo_trl_fused_trains_as_unfused(flags):
    fused = _same_trl_run(_run(["grpo_trl.py", "--compare", "--steps", "2", "--backend", "reference", *flags]), 2)
    assert len(fused["rewards"]) == 2
