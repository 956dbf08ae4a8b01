"""The probes' JSON-lines output: ``emit(**row)`` writes the row, with the run's environment, to the file
(appended) and, where ``show(row)`` says so, to stdout."""
from __future__ import annotations

import json


def emitter(path: str | None, env: dict, show=lambda row: True):
    out = open(path, "a") if path else None  # noqa: SIM115 (kept open for the probe's run; flushed a line at a time)

    def emit(**row):
        line = json.dumps({**row, **env})
        if show(row):
            print(line, flush=True)
        if out:
            out.write(line + "\n")
            out.flush()

    return emit
