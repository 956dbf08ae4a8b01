"""What each compilation did: rewrites, regions, fallbacks and the graphs after each stage.

Every line also goes to the ``torchfuser.compiler`` logger, so a fallback is never silent.
``torchfuser.jit(fn).explain(*args)`` prints these records.
"""
from __future__ import annotations

import logging
from dataclasses import dataclass, field

log = logging.getLogger("torchfuser.compiler")
_STAGE_LINES = 24  # lines of each MLIR stage in the printed record; Explanation.ir has them all


@dataclass
class Region:
    name: str
    graph: str                      # which graph it belongs to: "forward" / "backward" / "inference"
    ops: list[str]
    compiled_by: str                # "mlir", or "eager (why)"
    fx: str = ""                    # the region's FX code
    stages: dict[str, str] = field(default_factory=dict)  # MLIR after each pipeline stage, once asked for
    # () → stages: computed on demand (explain), since it recompiles the region with every dump on
    stage_ir: object = field(default=None, repr=False, compare=False)


@dataclass
class CompileRecord:
    device: str = "cpu"
    graph_backend: str = ""
    dynamic: bool | None = None
    rewrites: list[str] = field(default_factory=list)   # "rms_norm: x=..., weight=... (kernel mlir)"
    skipped: list[str] = field(default_factory=list)    # candidates matched but not rewritten, with why
    notes: list[str] = field(default_factory=list)      # fallbacks and other decisions
    graphs: dict[str, str] = field(default_factory=dict)  # stage name → FX code
    regions: list[Region] = field(default_factory=list)

    def note(self, line: str, level: int = logging.INFO) -> None:
        self.notes.append(line)
        log.log(level, "%s", line)

    def rewrote(self, line: str) -> None:
        self.rewrites.append(line)
        log.info("rewrite: %s", line)

    def skip(self, line: str) -> None:
        self.skipped.append(line)
        log.info("rewrite skipped: %s", line)

    def ops_in(self, graph: str) -> list[str]:
        """Every call target named in the stage ``graph`` (as FX code), for tests and explain."""
        return [w for w in self.graphs.get(graph, "").split() if "torch.ops." in w]

    def __str__(self) -> str:
        out = [f"torchfuser compile: device={self.device} backend={self.graph_backend} dynamic={self.dynamic}"]
        out.append("rewritten:" if self.rewrites else "rewritten: nothing")
        out += [f"  - {r}" for r in self.rewrites]
        if self.skipped:
            out.append("matched but not rewritten:")
            out += [f"  - {s}" for s in self.skipped]
        if self.notes:
            out.append("notes:")
            out += [f"  - {n}" for n in self.notes]
        for r in self.regions:
            out.append(f"region {r.graph}/{r.name} [{r.compiled_by}]: {', '.join(r.ops)}")
            if r.stages:
                for stage, text in r.stages.items():
                    lines = text.rstrip().splitlines()
                    out.append(f"  --- {stage} ---")
                    out += ["    " + line for line in lines[:_STAGE_LINES]]
                    if len(lines) > _STAGE_LINES:
                        out.append(f"    … {len(lines) - _STAGE_LINES} more lines (explanation.ir({stage!r}))")
            elif r.fx:
                out.append("  --- fx (no MLIR stage dumps exposed by the backend) ---")
                out += ["    " + line for line in r.fx.strip().splitlines()]
        for stage, code in self.graphs.items():
            out.append(f"=== graph after {stage} ===")
            out += ["  " + line for line in code.strip().splitlines()]
        return "\n".join(out)
