"""The command line: --version, a checkpoint directory for inspect, what inspect says it built, and user
mistakes as one line + exit 2 in every subcommand."""
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


def _env():
    return {**os.environ, "PYTHONPATH": str(Path(__file__).parents[1])}


def test_version(capsys):
    assert cli.main(["--version"]) == 0
    assert capsys.readouterr().out.startswith(f"torchfuser {torchfuser.__version__} (torch ")


def test_version_is_written_once():
    """pyproject.toml reads the version from torchfuser/_version.py; the package and the CLI import it."""
    from torchfuser import _version

    root = Path(__file__).parents[1]
    pyproject = (root / "pyproject.toml").read_text()
    assert 'dynamic = ["version"]' in pyproject and 'attr = "torchfuser._version.__version__"' in pyproject
    assert "\nversion =" not in pyproject.split("[tool.setuptools.dynamic]")[0]
    assert torchfuser.__version__ == _version.__version__ == cli.__version__


def test_inspect_checkpoint_directory(tmp_path, capsys):
    """A checkpoint directory needs only its config.json: the model is built on meta, no weights read."""
    (tmp_path / "config.json").write_text(json.dumps(_QWEN))
    (tmp_path / "model.safetensors").write_bytes(b"not read")
    assert cli.main(["inspect", str(tmp_path), "--json"]) == 0
    data = json.loads(capsys.readouterr().out)
    assert data["model_type"] == "qwen2" and data["model_class"] == "Qwen2ForCausalLM"
    assert data["counts"]["rms_norm"]["fused"] == 5 and data["counts"]["gated_mlp"]["fused"] == 2


def test_inspect_says_what_it_built(tmp_path, capsys):
    """The config's model type, the class, the decoder layers and the parameters (tied ones once)."""
    from transformers import AutoConfig, AutoModelForCausalLM

    (tmp_path / "config.json").write_text(json.dumps(_QWEN))
    assert cli.main(["inspect", str(tmp_path), "--json"]) == 0
    data = json.loads(capsys.readouterr().out)
    fields = {k: v for k, v in _QWEN.items() if k != "model_type"}
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(AutoConfig.for_model("qwen2", **fields))
    params = sum(p.numel() for p in model.parameters())
    assert data["num_hidden_layers"] == 2 and data["parameters"] == params and data["parameter_bytes"] == 4 * params
    assert cli.main(["inspect", str(tmp_path)]) == 0
    first = capsys.readouterr().out.splitlines()[0]
    assert first.startswith("qwen2 (Qwen2ForCausalLM): 2 layers, ") and f"{params / 1e3:.2f}K parameters" in first, first


def test_inspect_table_is_wide_and_grouped(capsys, monkeypatch):
    """Not a terminal (here: captured): a wide table, not rich's 80 columns that folded module names; a
    decoder layer's own residual_norm row grouped over the layers like its children's rows."""
    monkeypatch.delenv("COLUMNS", raising=False)
    assert cli.main(["inspect", "llama"]) == 0
    lines = capsys.readouterr().out.splitlines()
    rows = {line.split("│")[1].strip(): line.split("│")[2:4] for line in lines if line.count("│") == 6}
    assert rows["model.layers.*"][0].strip() == "32" and rows["model.layers.*"][1].strip() == "residual_norm", rows
    assert rows["model.layers.*.post_attention_layernorm"][0].strip() == "32"  # whole, not folded
    assert not any(name.startswith("model.layers.") and name[len("model.layers."):].isdigit() for name in rows)


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
        "bench: unknown variant": (["bench", "llama", "--device", "cpu", "--variants", "fast"], "unknown variant 'fast'"),
        "bench: not a model type": (["bench", "no_such_type", "--device", "cpu"], "neither a config.json"),
    }
    if not torch.cuda.is_available():
        cases["cuda without CUDA"] = (["demo", "--device", "cuda"], "no CUDA device")
    if not os.environ.get("TRITON_INTERPRET") and not torch.cuda.is_available():
        cases["backend that cannot run"] = (["demo", "--device", "cpu", "--backend", "triton"], "cannot run here")
    return cases


@pytest.mark.parametrize("case", ["malformed config.json", "json not an object", "nonexistent path", "hub id",
                                  "directory without config.json", "no causal LM", "not a device", "short demo",
                                  "cuda without CUDA", "backend that cannot run", "bench: unknown variant",
                                  "bench: not a model type"])
def test_mistakes_are_one_line_and_exit_2(case, tmp_path, capsys):
    cases = _mistakes(tmp_path)
    if case not in cases:
        pytest.skip("this machine can do it")
    argv, words = cases[case]
    assert cli.main(argv) == 2
    line = _error_line(capsys)
    assert line.startswith(f"torchfuser {argv[0]}: ") and words in line, line


@pytest.mark.parametrize("argv, said", [
    (["inspect", "{tmp}"], "torchfuser inspect: {tmp} has no config.json; inspect takes a checkpoint directory that has one"),
    (["demo", "--steps", "2"], "torchfuser demo: --steps must be at least 4 (the first steps are warm-up)"),
    (["bench", "llama", "--device", "cpu", "--variants", "fast"], "torchfuser bench: unknown variant 'fast'; choose from "),
])
def test_the_installed_command_exits_2_without_a_traceback(tmp_path, argv, said):
    """As a user runs it: a separate process, its exit code and stderr; the same code in every subcommand."""
    argv = [a.format(tmp=tmp_path) for a in argv]
    done = subprocess.run([sys.executable, "-m", "torchfuser.cli", *argv], capture_output=True, text=True,
                          env=_env(), timeout=300)
    assert done.returncode == 2, done.stderr
    # Ours is one line, the last; what other installed packages print at import (torchao's library-load
    # messages where its CUDA extensions cannot load) comes before it and is not ours.
    lines = done.stderr.strip().splitlines()
    assert "Traceback" not in done.stderr and lines[-1].startswith(said.format(tmp=tmp_path)), done.stderr
    assert sum(line.startswith("torchfuser") for line in lines) == 1, done.stderr


@pytest.mark.parametrize("command", ["inspect", "bench"])
def test_a_config_transformers_rejects_keeps_the_reason(tmp_path, capsys, command):
    """transformers' validation error names its validator on the first line and the reason on the next."""
    path = tmp_path / "config.json"
    path.write_text(json.dumps({**_QWEN, "model_type": "llama", "hidden_size": 64, "num_attention_heads": 5}))
    argv = [command, str(path)] + (["--device", "cpu"] if command == "bench" else [])
    assert cli.main(argv) == 2
    line = _error_line(capsys)
    assert line.startswith(f"torchfuser {command}: ") and "is not a valid transformers config" in line, line
    assert "not a multiple of the number of attention heads" in line, line


def test_said_keeps_a_few_lines_each_cut():
    err = ValueError("Unrecognized configuration class X\nModel type should be one of " + "A, " * 500 + "\n\nmore\nand more")
    said = cli._said(err)
    assert said.startswith("ValueError: Unrecognized configuration class X Model type should be one of A, ")
    assert "more" in said and said.endswith("…") and len(said) < 700 and "\n" not in said


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
