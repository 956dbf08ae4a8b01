"""benchmarks/context_length.py and the ladder it runs (train_step.py --ladder, benchmarks/ladder.py): the
steps at longer lengths on one model, what ends a ladder, and the line fitted through the measured peaks that
predicts the longest length a setting fits when its steps got too slow to climb there."""
from __future__ import annotations

import argparse
import json
import math
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))

import context_length  # noqa: E402
import train_step  # noqa: E402
import unsloth_variant  # noqa: E402

ARGS = argparse.Namespace(step=16384, margin_gib=2.0)


def _points(seqs, base=20.0, kib=300.0, noise=()):
    return [{"seq": s, "status": "ok", "peak_gib": base + kib * s / 2**20 + (noise[i] if noise else 0), "tokens_per_s": 1000}
            for i, s in enumerate(seqs)]


def test_the_fit_recovers_a_line_and_predicts_the_longest_multiple_that_fits():
    points = _points([16384, 32768, 49152]) + [{"seq": 65536, "status": "budget"}]
    summary = context_length.summarise({"points": points, "total_gib": 140.0}, ARGS)
    assert summary["gib_at_zero"] == pytest.approx(20.0) and summary["kib_per_token"] == pytest.approx(300.0)
    fits = (140.0 - 2.0 - 20.0) / (300.0 / 2**20)  # 412,428 tokens
    assert summary["predicted_longest"] == 16384 * math.floor(fits / 16384) == 409600
    assert summary["longest"] == 409600 and summary["how"].startswith("predicted") and "budget" in summary["how"]
    assert summary["worst_residual_gib"] == pytest.approx(0.0, abs=1e-9)


def test_an_out_of_memory_end_is_measured_not_predicted():
    points = _points([16384, 32768], noise=(0.0, 0.5)) + [{"seq": 49152, "status": "oom"}]
    summary = context_length.summarise({"points": points, "total_gib": 140.0}, ARGS)
    assert summary["longest"] == summary["longest_measured"] == 32768 and summary["how"].startswith("measured")
    assert summary["ended_by"] == "oom"


def test_one_point_or_no_device_memory_gives_no_prediction():
    for result in ({"points": _points([16384]) + [{"seq": 32768, "status": "budget"}], "total_gib": 140.0},
                   {"points": _points([16384, 32768]), "total_gib": None}):
        summary = context_length.summarise(result, ARGS)
        assert "predicted_longest" not in summary and summary["longest"] == summary["longest_measured"]
    failed = context_length.summarise({"points": [{"seq": 16384, "status": "oom"}]}, ARGS)
    assert failed["longest"] == 0 and failed["ended_by"] == "oom"


def test_the_ladder_trains_the_same_model_at_each_longer_length(tmp_path):
    out = tmp_path / "rows.jsonl"
    train_step.main(["--models", "tiny", "--device", "cpu", "--batch", "1", "--seq", "32", "--steps", "1", "--warmup", "0",
                     "--precision", "bf16", "--lora", "4", "--variants", "eager", "--ladder", "48", "64",
                     "--out", str(out)])
    row = json.loads(out.read_text().splitlines()[-1])
    points = row["ladder"]["points"]
    assert [p["seq"] for p in points] == [48, 64] and all(p["status"] == "ok" for p in points)
    assert all(math.isfinite(p["loss"]) and p["tokens_per_s"] > 0 for p in points)


def test_a_budget_stops_the_ladder_before_a_step_that_would_overrun_it(tmp_path):
    out = tmp_path / "rows.jsonl"
    train_step.main(["--models", "tiny", "--device", "cpu", "--batch", "1", "--seq", "32", "--steps", "1", "--warmup", "0",
                     "--precision", "bf16", "--lora", "4", "--variants", "eager", "--ladder", "4096",
                     "--ladder-budget", "1e-6", "--out", str(out)])
    (point,) = json.loads(out.read_text().splitlines()[-1])["ladder"]["points"]
    assert point["seq"] == 4096 and point["status"] == "budget" and point["projected_s"] > 0


def test_unsloth_loads_for_the_longest_length_of_the_ladder():
    args = argparse.Namespace(workload="fixed", seq=16384, ladder=[32768, 65536])
    assert unsloth_variant.longest_row(args) == 65536


def test_explicit_lengths_replace_the_climb(monkeypatch):
    """--lengths: one step at each given length after --start (a confirmation run), not the whole range."""
    seen = {}

    def fake_run(cmd, **kwargs):
        seen["cmd"] = cmd
        raise context_length.subprocess.TimeoutExpired(cmd, 1)

    monkeypatch.setattr(context_length.subprocess, "run", fake_run)
    args = argparse.Namespace(start=16384, step=16384, max=1 << 20, lengths=[278528], model="llama8b", device="cuda",
                              budget=0, quant="nf4", timeout=1)
    result = context_length.run_setting("torchfuser-offload", args)
    ladder = seen["cmd"][seen["cmd"].index("--ladder") + 1:seen["cmd"].index("--ladder-budget")]
    assert ladder == ["278528"] and "error" in result and result["points"] == []
