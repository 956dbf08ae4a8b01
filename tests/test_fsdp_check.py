"""benchmarks/fsdp_check.py as the GPU runs launch it (torch.distributed.run, two ranks), on the CPU with
gloo and the tiny recipes: FSDP2 with LoRA adapters, DDP with FP8 under bf16 autocast, FSDP2 with fused
MoE blocks. Each run must pass its own fused-vs-unfused check and say in every JSON line what it ran."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch.distributed as dist

ROOT = Path(__file__).resolve().parents[1]
FAST = ["--recipe", "tiny", "--device", "cpu", "--seq", "32", "--batch", "2", "--steps", "2", "--warmup", "1"]

fsdp = pytest.importorskip("torch.distributed.fsdp")
if not (dist.is_available() and hasattr(fsdp, "fully_shard")):
    pytest.skip("torch.distributed FSDP2 (fully_shard) is not available", allow_module_level=True)


def _run(*args: str) -> tuple[list[dict], dict]:
    """(the variants' JSON lines, the summary line) of a two-rank run that must print PASS."""
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]),
               OMP_NUM_THREADS="1", CUDA_VISIBLE_DEVICES="", HF_HUB_OFFLINE="1", TOKENIZERS_PARALLELISM="false")
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2",
           str(ROOT / "benchmarks" / "fsdp_check.py"), *FAST, *args]
    proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=180)
    assert proc.returncode == 0 and "PASS" in proc.stdout.splitlines(), \
        f"{' '.join(cmd)} failed ({proc.returncode}):\n{proc.stdout[-3000:]}\n{proc.stderr[-6000:]}"
    lines = [json.loads(line) for line in proc.stdout.splitlines() if line.startswith("{")]
    rows, summary = [r for r in lines if "variant" in r], next(r for r in lines if "against_eager" in r)
    assert [r["variant"] for r in rows] == ["eager", "torchfuser"]
    assert summary["pass"] and set(summary["against_eager"]) == {"torchfuser"}
    assert all(r["world"] == 2 and r["losses"] and all(0 < x < 20 for x in r["losses"]) for r in rows)
    return rows, summary


def test_fsdp2_with_lora_trains_only_the_adapters():
    rows, _ = _run("--wrap", "fsdp2", "--lora", "4")
    assert all(r["wrap"] == "fsdp2" and r["lora"] == 4 and r["precision"] == "mp-bf16" and r["fp8"] is None for r in rows)
    full = 1024 * 128  # the embedding alone, tied: LoRA trains far fewer
    assert all(0 < r["trained_parameters"] < full for r in rows)
    assert any("LoRA r=4" in n for n in rows[1]["report_notes"])


def test_ddp_with_fp8_rowwise_under_autocast():
    rows, summary = _run("--wrap", "ddp", "--fp8", "rowwise", "--precision", "autocast")
    assert all(r["wrap"] == "ddp" and r["fp8"] == "rowwise" and r["precision"] == "autocast" for r in rows)
    fused = rows[1]
    assert any(n.startswith("fp8: rowwise") for n in fused["report_notes"]), fused["report_notes"]
    assert not fused["report_fallbacks"]  # every projection ran its FP8 GEMMs
    assert summary["grad_tolerance"] == 0.25


def test_fsdp2_with_fused_moe_blocks():
    rows, _ = _run("--wrap", "fsdp2", "--recipe", "tiny_moe")
    assert all(r["recipe"] == "tiny_moe" for r in rows)
    assert rows[1]["fused_patterns"].get("moe") == 2, rows[1]["fused_patterns"]


def test_cuda_graphs_under_fsdp_are_refused():
    proc = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "fsdp_check.py"), "--variants", "torchfuser-graphs"],
                          cwd=ROOT, capture_output=True, text=True, timeout=120,
                          env=dict(os.environ, CUDA_VISIBLE_DEVICES=""))
    assert proc.returncode == 2 and "needs --wrap ddp" in proc.stderr, proc.stderr[-2000:]
