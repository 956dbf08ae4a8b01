"""What ``Jitted.explain`` returns: the compile records of one fresh compilation, printable."""
from __future__ import annotations


class Explanation:
    def __init__(self, records):
        self.records = list(records)
        for region in self.regions:  # each compiled region's IR after every MLIR pipeline stage
            if region.stage_ir is not None and not region.stages:
                region.stages = region.stage_ir()

    @property
    def regions(self):
        return [r for rec in self.records for r in rec.regions]

    @property
    def rewrites(self):
        return [r for rec in self.records for r in rec.rewrites]

    def ir(self, stage: str) -> str:
        """Every region's MLIR after pipeline ``stage`` ("capture", "import", "linalg", "fuse",
        "wrapper", "inline", "bufferize", "loops", "llvm"), joined."""
        return "\n".join(r.stages.get(stage, "") for r in self.regions)

    def graph(self, stage: str) -> str:
        """The FX code after ``stage`` ("dynamo", "capture", "rewrite", "forward", "backward",
        "forward regions", ...) of every graph compiled, joined."""
        return "\n".join(rec.graphs.get(stage, "") for rec in self.records)

    def __str__(self) -> str:
        if not self.records:
            return "torchfuser.explain: nothing was compiled (no tensor ops reached Dynamo)"
        parts = [f"torchfuser.explain: {len(self.records)} graph(s) compiled"]
        parts += [f"--- graph {i} ---\n{rec}" for i, rec in enumerate(self.records)]
        return "\n".join(parts)

    __repr__ = __str__
