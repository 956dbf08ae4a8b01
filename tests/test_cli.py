"""The command line: --version, a checkpoint directory for inspect, and user mistakes as one line + exit 2."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import torchfuser
from torchfuser import cli

_QWEN = {"model_type": "qwen2", "num_hidden_layers": 2, "hidden_size": 64, "intermediate_size": 128,
         "num_attention_heads": 4, "num_key_value_heads": 2, "vocab_size": 128}


def _error_line(capsys) -> str:
    captured = capsys.readouterr()
    lines = captured.err.strip().splitlines()
    assert len(lines) == 1 and "Traceback" not in captured.err, captured.err
    return lines[0]


def test_version(capsys):
    with pytest.raises(SystemExit) as info:
        cli.main(["--version"])
    assert info.value.code == 0
    assert capsys.readouterr().out.startswith(f"torchfuser {torchfuser.__version__} (torch ")


def test_inspect_checkpoint_directory(tmp_path, capsys):
    """A checkpoint directory needs only its config.json: the model is built on meta, no weights read."""
    (tmp_path / "config.json").write_text(json.dumps(_QWEN))
    (tmp_path / "model.safetensors").write_bytes(b"not read")
    assert cli.main(["inspect", str(tmp_path), "--json"]) == 0
    data = json.loads(capsys.readouterr().out)
    assert data["model_type"] == "Qwen2ForCausalLM"
    assert data["counts"]["rms_norm"]["fused"] == 5 and data["counts"]["gated_mlp"]["fused"] == 2


def test_inspect_a_named_backend_on_meta(capsys):
    """On meta nothing runs: a backend this machine lacks is what the report says, not an error."""
    assert cli.main(["inspect", "llama", "--backend", "triton", "--json"]) == 0
    data = json.loads(capsys.readouterr().out)
    assert {e["backend"] for e in data["entries"] if e["fused"]} == {"triton"}


def _mistakes(tmp_path):
    bad = tmp_path / "bad"
    bad.mkdir()
    (bad / "config.json").write_text('{"model_type": "llama",')
    listed = tmp_path / "list.json"
    listed.write_text("[1, 2]")
    empty = tmp_path / "empty"
    empty.mkdir()
    vision = tmp_path / "vit"
    vision.mkdir()
    (vision / "config.json").write_text(json.dumps({"model_type": "vit"}))
    cases = {
        "malformed config.json": (["inspect", str(bad)], "is not valid JSON"),
        "json not an object": (["inspect", str(listed)], "has no 'model_type' field"),
        "nonexistent path": (["inspect", str(tmp_path / "nope")], "no such file or directory"),
        "hub id": (["inspect", "meta-llama/Llama-3.2-1B"], "inspect reads local checkpoints"),
        "directory without config.json": (["inspect", str(empty)], "has no config.json"),
        "no causal LM": (["inspect", str(vision)], "cannot build a causal LM for 'vit'"),
        "not a device": (["demo", "--device", "gpu0"], "is not a device"),
        "short demo": (["demo", "--steps", "2"], "at least 4"),
    }
    if not torch.cuda.is_available():
        cases["cuda without CUDA"] = (["demo", "--device", "cuda"], "no CUDA device")
    if not os.environ.get("TRITON_INTERPRET") and not torch.cuda.is_available():
        cases["backend that cannot run"] = (["demo", "--device", "cpu", "--backend", "triton"], "cannot run here")
    return cases


@pytest.mark.parametrize("case", ["malformed config.json", "json not an object", "nonexistent path", "hub id",
                                  "directory without config.json", "no causal LM", "not a device", "short demo",
                                  "cuda without CUDA", "backend that cannot run"])
def test_mistakes_are_one_line_and_exit_2(case, tmp_path, capsys):
    cases = _mistakes(tmp_path)
    if case not in cases:
        pytest.skip("this machine can do it")
    argv, words = cases[case]
    assert cli.main(argv) == 2
    line = _error_line(capsys)
    assert line.startswith(f"torchfuser {argv[0]}: ") and words in line, line


def test_the_installed_command_exits_2_without_a_traceback(tmp_path):
    """As a user runs it: a separate process, its exit code and stderr."""
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).parents[1])}
    done = subprocess.run([sys.executable, "-m", "torchfuser.cli", "inspect", str(tmp_path)],
                          capture_output=True, text=True, env=env, timeout=300)
    assert done.returncode == 2
    assert done.stderr.strip() == f"torchfuser inspect: {tmp_path} has no config.json; inspect takes a checkpoint " \
                                  "directory that has one"


def test_a_subcommand_is_one_function_in_commands(capsys):
    """How `bench` (or any later subcommand) plugs in: add(sub) sets run=; CLIError is its mistake."""
    def run(args):
        if args.fail:
            raise cli.CLIError("asked to")
        return 7

    def add(sub):
        p = sub.add_parser("hello")
        p.add_argument("--fail", action="store_true")
        p.set_defaults(run=run)

    cli.COMMANDS.append(add)
    try:
        assert cli.main(["hello"]) == 7
        assert cli.main(["hello", "--fail"]) == 2
        assert _error_line(capsys) == "torchfuser hello: asked to"
    finally:
        cli.COMMANDS.remove(add)
