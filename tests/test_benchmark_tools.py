"""The benchmark tools users run: ``benchmarks/ops.py --ops moe`` (the MoE expert path) and
``benchmarks/fp8_convergence.py`` (its data, its smoothing and gaps, a tiny run end to end), on the CPU."""
from __future__ import annotations

import json
import math
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))

import fp8_convergence as conv  # noqa: E402
import ops as ops_bench  # noqa: E402


def test_ops_moe_writes_the_expert_path_rows(tmp_path):
    out = tmp_path / "moe.jsonl"
    ops_bench.main(["--device", "cpu", "--ops", "moe", "--out", str(out)])
    rows = [json.loads(line) for line in out.read_text().splitlines()]
    parts = {r["part"] for r in rows}
    assert {"grouped GEMM gate_up", "grouped GEMM down", "permute (gather rows by expert)"} <= parts
    gemm = next(r for r in rows if r["part"] == "grouped GEMM gate_up")
    assert gemm["grouped_ms"] > 0 and gemm["dense_ms"] > 0
    assert any(p.startswith("moe_experts forward + backward") for p in parts)


def test_bigram_data_has_the_entropy_it_reports():
    successors, probs = conv.bigram(64, 4, seed=0)
    assert successors.shape == probs.shape == (64, 4)
    torch.testing.assert_close(probs.sum(-1), torch.ones(64, dtype=probs.dtype))
    h = conv.entropy_rate(successors, probs)
    assert 0 < h < math.log(4) + 1e-9  # at most uniform over the 4 successors
    data = conv.sample(successors, probs, 3, 2, 50, seed=0, device="cpu")
    assert data.shape == (3, 2, 50) and int(data.max()) < 64
    # every next token is one of its predecessor's successors
    prev, nxt = data[..., :-1].flatten(), data[..., 1:].flatten()
    assert (successors[prev] == nxt[:, None]).any(-1).all()


def test_smoothing_is_a_trailing_moving_average():
    assert conv.smooth([1.0, 3.0, 5.0, 7.0], 2) == [1.0, 2.0, 4.0, 6.0]


def test_a_tiny_fp8_convergence_run_writes_curves_and_gaps(tmp_path, monkeypatch):
    out = tmp_path / "conv.json"
    monkeypatch.setattr(sys, "argv", ["fp8_convergence.py", "--model", "tiny", "--device", "cpu", "--steps", "6",
                                      "--batch", "2", "--seq", "32", "--warmup", "2", "--window", "2",
                                      "--variants", "bf16", "fp8-rowwise", "--out", str(out)])
    conv.main()
    result = json.loads(out.read_text())
    fp8 = result["curves"]["fp8-rowwise"]
    assert len(fp8["losses"]) == len(fp8["smoothed"]) == len(fp8["relative_gap"]) == 6
    assert fp8["notes"] and fp8["notes"][0].startswith("fp8: rowwise")  # it ran FP8 GEMMs
    assert math.isfinite(fp8["max_gap_after_warmup"]) and isinstance(fp8["passed"], bool)


def test_host_profile_reports_a_step_by_package():
    """benchmarks/profiling.host_profile on a fused tiny model's step: wall time a step, torchfuser's share of the
    Python time, and the functions that take it."""
    from transformers import LlamaConfig, LlamaForCausalLM

    import torchfuser
    from profiling import host_profile

    torch.manual_seed(0)
    model = torchfuser.optimize(LlamaForCausalLM(LlamaConfig(
        hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2, num_key_value_heads=1,
        vocab_size=64)), backend="reference")
    ids = torch.randint(0, 64, (1, 8))
    report = host_profile(lambda: model(input_ids=ids, labels=ids).loss.backward(), 2)
    lines = report.splitlines()
    assert lines[0].startswith("Host time a step (2 steps") and float(lines[0].split("wall ")[1].split()[0]) > 0
    shares = {line.split(None, 1)[0]: line for line in lines[2:] if line.startswith("  ") and " ms" in line}
    assert "torchfuser" in shares and "transformers" in shares
    assert any("torchfuser/modules/" in line for line in lines[lines.index("Functions by own time (ms a step, calls a step):"):])
