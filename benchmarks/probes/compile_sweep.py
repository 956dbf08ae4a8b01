"""Every architecture-test family through a compile path on the CPU: loss and every gradient against
the same model uncompiled, and which graph rewrites ran (causal mask, grouped k/v).

    python benchmarks/probes/compile_sweep.py --path optimize-inductor      # torch.compile(optimize(model))
    python benchmarks/probes/compile_sweep.py --path backend                # torch.compile(model, backend="torchfuser")
    python benchmarks/probes/compile_sweep.py --path optimize-backend --families llama qwen2
    python benchmarks/probes/compile_sweep.py --path backend --graph-backend inductor   # as on a GPU

A check for NOTES-compiler.md, not a test (tests/test_compiler.py holds five of these families). A
gradient whose exact value is zero (a key bias: softmax ignores what it adds to a whole row) is
rounding noise on both sides; the largest gradient difference is reported relative to the largest
reference gradient of the same parameter, over parameters whose gradients are not all below 1e-8.
"""
from __future__ import annotations

import argparse
import copy
import json
import sys
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[2]
sys.path[:0] = [str(ROOT), str(ROOT / "tests")]

import torchfuser  # noqa: E402
from torchfuser.compiler import backend as compile_backend, inductor_pass  # noqa: E402
from test_architectures import ARCHS, make  # noqa: E402

PATHS = ("optimize-inductor", "backend", "optimize-backend")


def compiled(model, path, graph_backend):
    if path.startswith("optimize"):
        torchfuser.optimize(model, backend="reference")
    ref = copy.deepcopy(model)
    if path == "optimize-inductor":
        return torch.compile(model), ref
    options = {"kernels": "reference", "backend": graph_backend}
    return torch.compile(model, backend="torchfuser", options=options), ref


def check(family: str, path: str, graph_backend: str = "auto") -> dict:
    from torch._functorch import config as functorch_config
    from torch._inductor import config

    torch._dynamo.reset()
    model = make(family)
    fn, ref = compiled(model, path, graph_backend)
    ids = torch.randint(3, 128, (2, 12))
    inductor_pass.RECENT.clear()
    compile_backend.RECENT.clear()
    with config.patch(fx_graph_cache=False), functorch_config.patch(enable_autograd_cache=False):
        loss = fn(input_ids=ids, labels=ids, use_cache=False).loss
        loss.backward()
    want = ref(input_ids=ids, labels=ids, use_cache=False).loss
    want.backward()
    worst, where = 0.0, None
    for (name, p), q in zip(model.named_parameters(), ref.parameters()):
        scale = q.grad.abs().max().item()
        if scale < 1e-8:
            continue
        rel = (p.grad - q.grad).abs().max().item() / scale
        if rel > worst:
            worst, where = rel, name
    rewrites = [line for r in [*inductor_pass.RECENT, *compile_backend.RECENT] for line in r.rewrites]
    return {"family": family, "path": path, "graph_backend": graph_backend, "loss_rel": abs(loss.item() - want.item()) / abs(want.item()),
            "grad_rel": worst, "worst_param": where,
            "rewrites": sorted({line.split(" scaled_dot")[0] for line in rewrites if "scaled_dot" in line})}


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--path", choices=PATHS, default="optimize-inductor")
    parser.add_argument("--graph-backend", default="auto", choices=("auto", "mlir", "inductor"),
                        help='the torchfuser backend\'s graph backend (paths "backend", "optimize-backend")')
    parser.add_argument("--families", nargs="+", default=list(ARCHS), choices=list(ARCHS))
    parser.add_argument("--out", help="append JSON lines here")
    args = parser.parse_args()
    rows = []
    for family in args.families:
        try:
            row = check(family, args.path, args.graph_backend)
        except Exception as err:  # one failing family must not hide the others
            row = {"family": family, "path": args.path, "error": f"{type(err).__name__}: {err}"[:300]}
        rows.append(row)
        print(json.dumps(row), flush=True)
    if args.out:
        with open(args.out, "a") as f:
            f.writelines(json.dumps(r) + "\n" for r in rows)
    bad = [r["family"] for r in rows if "error" in r or r["grad_rel"] > 1e-4 or r["loss_rel"] > 1e-5]
    print(f"{len(rows) - len(bad)}/{len(rows)} within 1e-5 (loss) and 1e-4 (gradients)" + (f"; not: {bad}" if bad else ""))
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
