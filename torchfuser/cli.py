"""The ``torchfuser`` command: ``demo`` (the main job), ``inspect`` and ``bench``.

A subcommand is a function ``add(sub)`` that adds its parser to argparse's subparsers ``sub`` and
sets ``run=`` (a function of the parsed arguments that returns the exit code); it is listed in
``COMMANDS``. A mistake of the user's is raised as ``CLIError``: ``main`` prints it as one line on
stderr and returns 2, as argparse does for its own errors; anything else is a bug and keeps its traceback.
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from torchfuser.backends import VALID_BACKENDS


class CLIError(Exception):
    """A mistake in what the user asked for, said in one line."""


def check_device(name: str | None):
    """The torch.device ``name`` names (default: cuda if available), if this machine has it."""
    import torch

    if name is None:
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    try:
        device = torch.device(name)
    except (RuntimeError, ValueError):
        raise CLIError(f"--device {name!r} is not a device (cpu, cuda, cuda:1, ...)") from None
    if device.type == "cuda" and not torch.cuda.is_available():
        raise CLIError(f"--device {name}: this machine has no CUDA device that torch can use")
    if device.type == "cuda" and device.index is not None and device.index >= torch.cuda.device_count():
        raise CLIError(f"--device {name}: this machine has {torch.cuda.device_count()} CUDA device(s)")
    return device


def check_backend(backend: str, device) -> None:
    """Fail before any work when the named ``backend`` cannot run on ``device``."""
    from torchfuser.backends import BackendUnavailable, resolve

    try:
        resolve(backend, device)
    except BackendUnavailable as err:
        raise CLIError(f"--backend {backend}: {err}") from None


def _said(err: Exception) -> str:
    """A third-party error in one line: transformers' messages run on (lists of every config class)."""
    first = str(err).strip().splitlines()[0] if str(err).strip() else ""
    return f"{type(err).__name__}: {first}"


def _add_demo(sub) -> None:
    demo = sub.add_parser("demo", help="train a small Llama-style model with and without TorchFuser, side by side")
    demo.add_argument("--device", default=None, help="cpu or cuda (default: cuda if available)")
    demo.add_argument("--steps", type=int, default=30)
    demo.add_argument("--backend", default="auto", choices=VALID_BACKENDS)
    demo.add_argument("--seed", type=int, default=0)
    demo.set_defaults(run=_run_demo)


def _run_demo(args) -> int:
    from torchfuser import demo

    if args.steps < 4:
        raise CLIError("--steps must be at least 4 (the first steps are warm-up)")
    device = check_device(args.device)
    check_backend(args.backend, device)
    demo.run(device=str(device), steps=args.steps, backend=args.backend, seed=args.seed)
    return 0


def _add_inspect(sub) -> None:
    insp = sub.add_parser("inspect", help="show what would be fused in a model, built on the meta device (no weights)")
    insp.add_argument("model", help="a local checkpoint directory (with config.json), a config.json path, "
                                    "or a transformers model type (llama, qwen2, gpt2, ...)")
    insp.add_argument("--backend", default="auto", choices=VALID_BACKENDS)
    insp.add_argument("--json", action="store_true", help="print the report as JSON")
    insp.set_defaults(run=_run_inspect)


def _config_file(path: Path):
    from transformers import AutoConfig

    try:
        data = json.loads(path.read_text())
    except OSError as err:
        raise CLIError(f"cannot read {path}: {err.strerror}") from None
    except (json.JSONDecodeError, UnicodeDecodeError) as err:
        raise CLIError(f"{path} is not valid JSON ({err})") from None
    if not isinstance(data, dict) or "model_type" not in data:
        raise CLIError(f"{path} has no 'model_type' field; it must be a transformers config.json")
    try:
        return AutoConfig.for_model(data.pop("model_type"), **data)
    except Exception as err:  # transformers' validators raise their own error types
        raise CLIError(f"{path} is not a valid transformers config: {_said(err)}") from None


def _config(target: str):
    """The config a checkpoint directory, a config.json or a model type names."""
    from transformers import AutoConfig

    path = Path(target).expanduser()
    if path.is_dir():
        if not (path / "config.json").is_file():
            raise CLIError(f"{target} has no config.json; inspect takes a checkpoint directory that has one")
        return _config_file(path / "config.json")
    if path.is_file():
        return _config_file(path)
    if path.suffix == ".json" or "/" in target or "\\" in target or target.startswith((".", "~")):
        hub = target.count("/") == 1 and not target.startswith(("/", ".", "~"))
        raise CLIError(f"no such file or directory: {target}" + (
            " (inspect reads local checkpoints; download a Hub model first, e.g. with `hf download`)" if hub else ""))
    try:
        return AutoConfig.for_model(target)
    except ValueError:
        raise CLIError(f"{target!r} is neither a checkpoint directory, a config.json path nor a transformers "
                       "model type (e.g. llama, qwen2, gpt2)") from None


def _run_inspect(args) -> int:
    import torch
    from rich.console import Console
    from transformers import AutoModelForCausalLM

    from torchfuser.api import optimize, report

    cfg = _config(args.model)
    with torch.device("meta"):  # no memory, no weights: only the module structure
        try:
            model = AutoModelForCausalLM.from_config(cfg)
        except ValueError:  # not one of AutoModelForCausalLM's config classes
            raise CLIError(f"cannot build a causal LM for {cfg.model_type!r}: transformers has no causal-LM class "
                           f"for {type(cfg).__name__}") from None
        except (TypeError, AttributeError, KeyError) as err:  # a default config transformers itself cannot build
            raise CLIError(f"transformers could not build {cfg.model_type!r} from this config "
                           f"({_said(err)}); pass a config.json with the model's sizes instead") from None
    optimize(model, backend=args.backend)
    rep = report(model)
    if args.json:
        print(json.dumps(rep.to_dict(), indent=2))
    else:
        Console().print(rep)
    return 0


def _add_bench(sub) -> None:
    from torchfuser import bench

    parser = sub.add_parser("bench", help="train your model with each variant and compare speed, memory, losses")
    bench.add_arguments(parser)
    parser.set_defaults(run=bench.main)


COMMANDS = [_add_demo, _add_inspect, _add_bench]


def _version() -> str:
    import torch

    from torchfuser import __version__

    return f"torchfuser {__version__} (torch {torch.__version__})"


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="torchfuser", description="Fused, compiled kernels for transformer training.")
    parser.add_argument("--version", action="version", version=_version())
    sub = parser.add_subparsers(dest="command", required=True)
    for add in COMMANDS:
        add(sub)
    args = parser.parse_args(argv)
    try:
        return args.run(args)
    except CLIError as err:
        print(f"torchfuser {args.command}: {err}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
