"""Stage ``fastmath``: mark float arithmetic reassociable and contractible.

Why: an fp32 row sum written as a loop is a chain of dependent adds; with ``reassoc`` LLVM's
vectoriser splits it into vector partial sums (and ``contract`` gives FMAs). The results are
sums in a different order, well inside the tolerance the tests hold every backend to. No
``nnan``/``ninf``: infinities and NaNs keep their IEEE meaning.
"""
from __future__ import annotations

OPS = {"arith.addf", "arith.subf", "arith.mulf", "arith.divf", "arith.negf"}
FLAGS = "#arith.fastmath<reassoc,contract>"


def apply(module) -> None:
    from torch_mlir import ir

    flags = ir.Attribute.parse(FLAGS, module.context)

    def visit(op):
        if op.name in OPS:
            op.attributes["fastmath"] = flags
        return ir.WalkResult.ADVANCE

    module.operation.walk(visit)
