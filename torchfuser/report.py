"""FusionReport: every candidate block the walker looked at, fused or skipped, and why."""
from __future__ import annotations

import copy
import os
import re
from collections import Counter
from dataclasses import dataclass


WIDE = 200  # columns when the output is not a terminal (a pipe, a file, a CI log): no folding at 80


def console(**kwargs):
    """A rich Console as wide as the terminal it writes to. Not a terminal: rich would take 80 columns and
    fold the report's module names; ``WIDE`` instead, unless ``COLUMNS`` says otherwise (a notebook keeps
    rich's own width)."""
    from rich.console import Console

    out = Console(**kwargs)
    if "width" not in kwargs and not out.is_terminal and not out.is_jupyter and not os.environ.get("COLUMNS"):
        out.width = WIDE
    return out


@dataclass(frozen=True)
class Entry:
    name: str  # qualified module name ("" for the model itself)
    pattern: str
    original: str  # class name of the block that was found
    fused: str | None = None  # class name of the replacement, None when skipped
    backend: str | None = None
    reason: str | None = None  # why it was skipped

    @property
    def is_fused(self) -> bool:
        return self.fused is not None


class FusionReport:
    """What ``torchfuser.optimize`` did to a model. ``str()`` gives a plain table; rich renders it."""

    def __init__(self, model_type: str = "", notes: list[str] | None = None):
        self.model_type = model_type
        self.notes = list(notes or [])
        self._entries: dict[str, Entry] = {}
        # {module name: {reason: calls}}: calls a fused block handed to its original forward
        # (filled in by torchfuser.report; the notes say the same in words).
        self.fallbacks: dict[str, dict[str, int]] = {}
        # {module name: calls}: decode-shaped no-grad calls handed to the original modules by choice (modules.decode;
        # filled in by torchfuser.report, a note says the same)
        self.decode_calls: dict[str, int] = {}

    def with_note(self, note: str) -> "FusionReport":
        """A copy with one more note, sharing the entries."""
        other = copy.copy(self)
        other.notes = [*self.notes, note]
        return other

    def add(self, entry: Entry) -> None:
        self._entries[entry.name] = entry

    @property
    def entries(self) -> list[Entry]:
        return list(self._entries.values())

    @property
    def fused(self) -> list[Entry]:
        return [e for e in self.entries if e.is_fused]

    @property
    def skipped(self) -> list[Entry]:
        return [e for e in self.entries if not e.is_fused]

    def counts(self) -> dict[str, dict[str, int]]:
        """{pattern: {"fused": n, "skipped": m}}."""
        fused = Counter(e.pattern for e in self.fused)
        skipped = Counter(e.pattern for e in self.skipped)
        return {p: {"fused": fused[p], "skipped": skipped[p]} for p in sorted(set(fused) | set(skipped))}

    def __len__(self) -> int:
        return len(self._entries)

    def summary(self) -> str:
        if not self._entries:
            return f"{self.model_type or 'model'}: nothing to fuse (no candidate blocks found); model unchanged"
        per = ", ".join(f"{p} {c['fused']}" + (f" (+{c['skipped']} skipped)" if c["skipped"] else "") for p, c in self.counts().items())
        return f"{self.model_type or 'model'}: {len(self.fused)} blocks fused, {len(self.skipped)} skipped — {per}"

    def _rows(self) -> list[tuple[str, str, str, str]]:
        rows = []
        for e in self.entries:
            what = f"{e.original} → {e.fused}" if e.is_fused else e.original
            rows.append((e.name or "(model)", e.pattern, what, e.backend if e.is_fused else f"skipped: {e.reason}"))
        return rows

    def __str__(self) -> str:
        lines = [self.summary()]
        rows = self._rows()
        if rows:
            header = ("module", "pattern", "block", "backend / reason")
            widths = [max(len(r[i]) for r in rows + [header]) for i in range(3)]
            fmt = lambda r: "  ".join(c.ljust(w) for c, w in zip(r[:3], widths)) + "  " + r[3]
            lines += [fmt(header), fmt(tuple("-" * w for w in widths) + ("-" * 16,))]
            lines += [fmt(r) for r in rows]
        lines += [f"note: {n}" for n in self.notes]
        return "\n".join(lines)

    def __repr__(self) -> str:
        return f"<FusionReport {self.summary()}>"

    def grouped(self) -> list[tuple[str, int, tuple[str, str, str, str]]]:
        """Rows that differ only in layer index, merged: [(name with * for indices, count, row)]."""
        groups: dict[tuple, list[str]] = {}
        for row in self._rows():
            # An index anywhere in the name, the last part too: a decoder layer's own row (residual_norm's
            # "model.layers.3") groups like its children's ("model.layers.3.mlp").
            key = (re.sub(r"\.\d+(?=\.|$)", ".*", row[0]),) + row[1:]
            groups.setdefault(key, []).append(row[0])
        return [(key[0], len(names), key) for key, names in groups.items()]

    def __rich__(self):
        from rich.table import Table
        from rich.text import Text

        # Text, not markup: reasons and notes quote brackets (`pip install ".[mlir]"`) that rich would eat.
        table = Table(title=Text(self.summary()), title_justify="left",
                      caption=Text("\n".join(self.notes)) if self.notes else None, caption_justify="left")
        for col in ("module", "n", "pattern", "block", "backend / reason"):
            table.add_column(col, overflow="fold", justify="right" if col == "n" else "left")
        for name, count, row in self.grouped():
            status = Text(row[3], style="yellow" if row[3].startswith("skipped") else "")
            table.add_row(Text(name), str(count), Text(row[1]), Text(row[2]), status)
        return table

    def to_dict(self) -> dict:
        return {
            "model_type": self.model_type,
            "counts": self.counts(),
            "entries": [e.__dict__ for e in self.entries],
            "notes": self.notes,
            "fallbacks": self.fallbacks,
            "decode_calls": getattr(self, "decode_calls", {}),  # (a report pickled before it had them)
        }
