"""The notebook walkthroughs stay true: every code cell runs, in order, and its checks pass."""
from __future__ import annotations

import json
import sys
import types
from pathlib import Path

import pytest
import torch

from numerics import needs_mlir

NOTEBOOKS = sorted((Path(__file__).parents[1] / "notebooks").glob("*.ipynb"))
# Walkthroughs of what the MLIR backend compiles: where torch-mlir is missing they cannot run.
NEEDS_MLIR = {"02_compiler.ipynb"}


@pytest.mark.parametrize("path", [pytest.param(p, marks=needs_mlir) if p.name in NEEDS_MLIR else p for p in NOTEBOOKS],
                         ids=lambda p: p.name)
def test_notebook_runs(path):
    cells = json.loads(path.read_text())["cells"]
    code = [("".join(c["source"]), i) for i, c in enumerate(cells) if c["cell_type"] == "code"]
    assert code, f"{path.name} has no code cells"
    # As in a kernel, the cells' globals are a module's that sys.modules knows: Dynamo (torch 2.11)
    # imports the module a compiled frame's globals name.
    module = types.ModuleType("__notebook__")
    sys.modules[module.__name__] = module
    scope = module.__dict__
    # A notebook starts in a fresh kernel: no compiled frames left by earlier tests, whose
    # recompilations of the same transformers code could exhaust torch.compile's cache limit.
    torch._dynamo.reset()
    try:
        for source, index in code:
            exec(compile(source, f"{path.name}[cell {index}]", "exec"), scope)
    finally:
        sys.modules.pop(module.__name__, None)


def test_there_are_notebooks():
    assert NOTEBOOKS
