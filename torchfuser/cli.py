"""The ``torchfuser`` command: ``demo`` (the main job), ``inspect`` and ``bench``."""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from torchfuser.backends import VALID_BACKENDS


def _inspect(target: str, backend: str, as_json: bool) -> int:
    import torch
    from rich.console import Console
    from transformers import AutoConfig, AutoModelForCausalLM

    from torchfuser.api import optimize, report

    path = Path(target)
    if path.suffix == ".json" or path.is_file():
        if not path.is_file():
            raise SystemExit(f"torchfuser inspect: no such config file {target!r}")
        data = json.loads(path.read_text())
        if "model_type" not in data:
            raise SystemExit(f"torchfuser inspect: {target} has no 'model_type' field; it must be a transformers config.json")
        try:
            cfg = AutoConfig.for_model(data.pop("model_type"), **data)
        except Exception as err:  # transformers' validators raise their own error types
            raise SystemExit(f"torchfuser inspect: {target} is not a valid transformers config: {type(err).__name__}: {err}")
    else:
        try:
            cfg = AutoConfig.for_model(target)
        except ValueError:
            raise SystemExit(f"torchfuser inspect: {target!r} is neither a config.json path nor a transformers model type (e.g. llama, qwen2, gpt2)")
    with torch.device("meta"):  # no memory, no weights: only the module structure
        try:
            model = AutoModelForCausalLM.from_config(cfg)
        except ValueError as err:
            raise SystemExit(f"torchfuser inspect: cannot build a causal LM for {cfg.model_type!r}: {err}")
        except (TypeError, AttributeError, KeyError) as err:  # a default config transformers itself cannot build
            raise SystemExit(f"torchfuser inspect: transformers could not build {cfg.model_type!r} from this config "
                             f"({type(err).__name__}: {err}); pass a config.json with the model's sizes instead")
    optimize(model, backend=backend)
    rep = report(model)
    if as_json:
        print(json.dumps(rep.to_dict(), indent=2))
    else:
        Console().print(rep)
    return 0


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="torchfuser", description="Fused, compiled kernels for transformer training.")
    sub = parser.add_subparsers(dest="command", required=True)
    demo = sub.add_parser("demo", help="train a small Llama-style model with and without TorchFuser, side by side")
    demo.add_argument("--device", default=None, help="cpu or cuda (default: cuda if available)")
    demo.add_argument("--steps", type=int, default=30)
    demo.add_argument("--backend", default="auto", choices=VALID_BACKENDS)
    demo.add_argument("--seed", type=int, default=0)
    insp = sub.add_parser("inspect", help="show what would be fused in a model, built on the meta device")
    insp.add_argument("model", help="a transformers model type (llama, qwen2, gpt2, ...) or a config.json path")
    insp.add_argument("--backend", default="auto", choices=VALID_BACKENDS)
    insp.add_argument("--json", action="store_true", help="print the report as JSON")
    from torchfuser import bench

    bench.add_arguments(sub.add_parser("bench", help="train your model with each variant and compare speed, memory, losses"))
    args = parser.parse_args(argv)
    if args.command == "bench":
        return bench.main(args)
    if args.command == "demo":
        from torchfuser import demo as demo_mod

        if args.steps < 4:
            parser.error("--steps must be at least 4 (the first steps are warm-up)")
        demo_mod.run(device=args.device, steps=args.steps, backend=args.backend, seed=args.seed)
        return 0
    return _inspect(args.model, args.backend, args.json)


if __name__ == "__main__":
    sys.exit(main())
