"""The MLIR backend's compiler, one named stage per step; any stage's IR can be printed.

    capture   reference fn → ATen FX graphs (make_fx / torch.func.vjp)   capture.py
    import    FX → torch dialect (torch-mlir FX importer)                importer.py
    linalg    torch → linalg-on-tensors (torch-mlir pipelines)           importer.py
    fuse      elementwise + producer/consumer fusion of each body        passes.py
    wrapper   @kernel: row-chunk loops, destination passing; exp/tanh      wrapper.py
              as vectorisable arithmetic                                 mathlib.py
    inline, bufferize, loops (tiling, vectorisation), llvm               passes.py
    jit       LLVM → machine code (MLIR ExecutionEngine)                 jit.py

    >>> from torchfuser.backends.mlir import pipeline
    >>> art = pipeline.compile_captured(cap, dump={"linalg", "loops"})   # prints those stages
"""
from __future__ import annotations

import os
import sys
import time
from dataclasses import dataclass, field

from . import fastmath, importer, mathlib, passes, wrapper
from .capture import Captured

STAGES = ("capture", "import", "linalg", "fuse", "wrapper", "inline", "bufferize", "loops", "llvm", "jit")


@dataclass
class Artifact:
    """A compiled kernel before JIT: the final LLVM-dialect module text plus stage timings."""

    llvm_ir: str
    timings: dict = field(default_factory=dict)
    ir: dict = field(default_factory=dict)   # stage → IR text, for the stages asked for


def _dump_set(dump) -> set:
    env = os.environ.get("TORCHFUSER_MLIR_DUMP", "")
    asked = set(dump or ()) | {s for s in env.split(",") if s}
    return set(STAGES) if "all" in asked else asked


def _keep(art: Artifact, stage: str, text_fn, dump: set, out) -> None:
    if stage in dump:
        text = text_fn()
        art.ir[stage] = text
        if out is not None:
            print(f"// ----- {stage} -----\n{text}", file=out)


def run_passes(module, pipeline: str, what: str) -> None:
    from torch_mlir.compiler_utils import run_pipeline_with_repro_report

    run_pipeline_with_repro_report(module, pipeline, f"torchfuser mlir: {what}")


def compile_captured(cap: Captured, *, vector: int = 16, dump=None, out=sys.stderr) -> Artifact:
    """Run every stage after capture; returns the LLVM-dialect module text."""
    from torch_mlir import ir

    dump = _dump_set(dump)
    art = Artifact(llvm_ir="")
    _keep(art, "capture", cap.print_graphs, dump, out)
    t = time.perf_counter()
    ctx = importer.context()
    module = importer.import_graphs(cap.graphs, ctx)
    _keep(art, "import", lambda: str(module), dump, out)
    importer.to_linalg(module)
    _keep(art, "linalg", lambda: str(module), dump, out)
    art.timings["import+linalg"] = time.perf_counter() - t
    t = time.perf_counter()
    with ctx:
        run_passes(module, passes.FUSE, "fuse")
    _keep(art, "fuse", lambda: str(module), dump, out)
    text = str(module)
    text = text.replace("func.func @body_", "func.func private @body_")
    text = mathlib.substitute(text)
    text = text.rstrip().rstrip("}") + wrapper.kernel_text(cap) + "\n}\n"
    with ctx:
        module = ir.Module.parse(text)
    _keep(art, "wrapper", lambda: str(module), dump, out)
    for name, pipe in passes.stages(vector):
        with ctx:
            if name == "llvm":
                fastmath.apply(module)
            run_passes(module, pipe, name)
        _keep(art, name, lambda: str(module), dump, out)
    art.timings["passes"] = time.perf_counter() - t
    art.llvm_ir = str(module)
    return art
