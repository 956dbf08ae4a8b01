"""Stages 2 and 3, import and linalg: FX graphs → torch dialect → linalg-on-tensors.

Uses torch-mlir's FX importer (the same one behind ``torch_mlir.fx.stateless_fx_import``)
and its two upstream pipelines: torch-dynamo export cleanup to the torch backend contract,
then torch → linalg-on-tensors. Every body lands in one module as a private function
``@body_<rows>`` so that the wrapper stage can call and later inline them.
"""
from __future__ import annotations

import logging
from typing import Mapping

import torch

log = logging.getLogger("torchfuser")


def _to_log(diagnostic) -> bool:
    # MLIR prints unhandled diagnostics to stderr; a failure here already reaches the caller as an
    # exception (and a region that cannot compile falls back with a note), so they go to the log.
    log.debug("mlir: %s", diagnostic)
    return True


def context():
    from torch_mlir import ir
    from torch_mlir.dialects import torch as torch_d

    ctx = ir.Context()
    torch_d.register_dialect(ctx)
    ctx.attach_diagnostic_handler(_to_log)
    return ctx


def import_graphs(graphs: Mapping[int, torch.fx.GraphModule], ctx=None):
    """Stage ``import``: a module with one torch-dialect function per graph."""
    from torch_mlir.extras.fx_importer import FxImporter

    importer = FxImporter(context=ctx or context())
    for rows, gm in graphs.items():
        importer.import_stateless_graph(gm.graph, func_name=f"body_{rows}")
    return importer.module


TORCH_CLEANUP = "builtin.module(func.func(torch-match-quantized-custom-ops), torchdynamo-export-to-torch-backend-pipeline)"
TORCH_TO_LINALG = "builtin.module(torch-backend-to-linalg-on-tensors-backend-pipeline{allow-non-finites=true})"


def to_linalg(module) -> None:
    """Stage ``linalg``: torch dialect → linalg-on-tensors, in place."""
    from torch_mlir.compiler_utils import run_pipeline_with_repro_report

    run_pipeline_with_repro_report(module, TORCH_CLEANUP, "torch-mlir: FX import → torch backend contract")
    run_pipeline_with_repro_report(module, TORCH_TO_LINALG, "torch-mlir: torch → linalg-on-tensors")
