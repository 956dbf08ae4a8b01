"""The ``torchfuser`` command: ``demo`` (the main job), ``inspect`` and ``bench``.

A subcommand is a function ``add(sub)`` that adds its parser to argparse's subparsers ``sub`` and
sets ``run=`` (a function of the parsed arguments that returns the exit code); it is listed in
``COMMANDS``. A mistake of the user's is raised as ``CLIError``: ``main`` prints it as one line on
stderr; anything else is a bug and keeps its traceback.

Exit codes, the same for every subcommand:

- 0: done;
- 2: a usage or input mistake (a bad option, a model or config that cannot be read or built, a device
  or backend this machine lacks): one line on stderr, as argparse does for its own errors;
- 1: the run itself failed (an unexpected error, with its traceback).

``torchfuser --version`` is answered before the subcommands' parsers are built; it reads the versions of torch and
transformers from the installed packages' metadata (importing the package itself still imports torch).
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from torchfuser._version import __version__
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


def _said(err: Exception, lines: int = 3, width: int = 300) -> str:
    """A third-party error on one line, with its reason. transformers' messages run on (lists of every
    config class) but put the cause on a later line (a validation error names the validator first,
    then the ValueError that failed): the first ``lines`` non-empty lines, each cut at ``width``."""
    said = [line.strip() for line in str(err).splitlines() if line.strip()]
    cut = [line if len(line) <= width else line[:width - 1] + "…" for line in said[:lines]]
    return f"{type(err).__name__}: {' '.join(cut)}" + (" …" if len(said) > lines else "")


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


def _model_facts(cfg, model) -> dict:
    """What inspect built: the config's model type, the class, its decoder layers and parameters."""
    text = cfg.get_text_config() if hasattr(cfg, "get_text_config") else cfg
    params = list(model.parameters())  # each shared (tied) parameter once
    return {"model_type": cfg.model_type, "model_class": type(model).__name__,
            "num_hidden_layers": getattr(text, "num_hidden_layers", None),
            "parameters": sum(p.numel() for p in params),
            "parameter_bytes": sum(p.numel() * p.element_size() for p in params)}


def _size(n: float, units=("", "K", "M", "B", "T"), step=1000.0) -> str:
    for unit in units:
        if abs(n) < step or unit == units[-1]:
            return f"{n:.0f}{unit}" if unit == units[0] else f"{n:.2f}{unit}"
        n /= step


def _run_inspect(args) -> int:
    import torch
    from transformers import AutoModelForCausalLM

    from torchfuser.api import optimize, report
    from torchfuser.report import console

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
    facts = _model_facts(cfg, model)
    optimize(model, backend=args.backend)
    rep = report(model)
    if args.json:
        data = rep.to_dict()
        data.pop("model_type")  # the report's is the class name: model_class here, and the config's type
        print(json.dumps({**facts, **data}, indent=2))
    else:
        out = console()
        layers = f"{facts['num_hidden_layers']} layers, " if facts["num_hidden_layers"] is not None else ""
        out.print(f"[bold]{facts['model_type']}[/] ({facts['model_class']}): {layers}"
                  f"{_size(facts['parameters'])} parameters, {facts['parameter_bytes'] / 2**30:,.2f} GiB of weights "
                  f"as built (on the meta device: nothing allocated)")
        out.print(rep)
    return 0


def _add_bench(sub) -> None:
    from torchfuser import bench

    parser = sub.add_parser("bench", help="train your model with each variant and compare speed, memory, losses")
    bench.add_arguments(parser)
    parser.set_defaults(run=bench.main)


COMMANDS = [_add_demo, _add_inspect, _add_bench]


def _version() -> str:
    """From the installed distributions' metadata: importing torch and transformers takes seconds."""
    from importlib import metadata

    def installed(name):
        try:
            return metadata.version(name)
        except metadata.PackageNotFoundError:
            return "not installed"

    return f"torchfuser {__version__} (torch {installed('torch')}, transformers {installed('transformers')})"


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    if argv[:1] in (["--version"], ["-V"]):  # before the subcommands' parsers, which import torch
        print(_version())
        return 0
    parser = argparse.ArgumentParser(prog="torchfuser", description="Fused, compiled kernels for transformer training.",
                                     epilog="exit codes: 0 done, 2 a usage or input mistake (one line on stderr), "
                                            "1 the run failed")
    parser.add_argument("-V", "--version", action="version", version=_version())
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
    # Run as `python -m torchfuser.cli`, this file is __main__: the imported module's main, so that the
    # CLIError a subcommand module imports (torchfuser.cli.CLIError) is the class caught there.
    from torchfuser.cli import main as _main

    sys.exit(_main())
