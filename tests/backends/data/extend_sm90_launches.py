"""Extend sm90_launches.json with launches recorded after all the others, never changing one already there.

    python tests/backends/data/extend_sm90_launches.py "extended (not changed) for ..."        # check, print
    python tests/backends/data/extend_sm90_launches.py "extended (not changed) for ..." --write

Records the H200's launches as test_triton_targets.test_sm90_launch_choices_unchanged does, fails unless
the recording's entries are exactly the first ones now (in order, unchanged), prints the new ones and,
with --write, appends them and the note's clause, in the file's own format (one launch a line). A change
to an earlier entry is a re-recording, to be made and explained by hand, not with this script.
"""
from __future__ import annotations

import json
import os
import sys

from torchfuser.backends.triton import _crosscompile as cc, targets

PATH = os.path.join(os.path.dirname(os.path.abspath(__file__)), "sm90_launches.json")


def _dump(note: str, launches: list) -> str:
    rows = ",\n".join(json.dumps(d, sort_keys=True) for d in launches)
    return '{"note": ' + json.dumps(note) + ',\n"launches": [\n' + rows + "\n]}\n"


def main(clause: str, write: bool) -> None:
    raw = open(PATH).read()
    old = json.loads(raw)
    assert _dump(old["note"], old["launches"]) == raw, "the file is not in the format this script writes"
    with targets.simulate("sm_90"):
        launches = cc.record_launches(unique=False)
    now, seen = [], set()
    for launch in launches:  # as test_triton_targets._unique_described
        d = json.dumps(launch.describe(), sort_keys=True)
        if d not in seen:
            seen.add(d)
            now.append(json.loads(d))
    n = len(old["launches"])
    changed = [i for i, (a, b) in enumerate(zip(now, old["launches"])) if a != b]
    if len(now) < n or changed:
        sys.exit(f"recorded entries changed (first at {changed[:5]}) or dropped ({len(now)} < {n}): not an extension")
    print(f"{n} recorded entries unchanged; {len(now) - n} new:")
    for d in now[n:]:
        print("  ", d["op"], d["kernel"], d["grid"], d["args"][0], d["kwargs"])
    if write and len(now) > n:
        note = old["note"] if clause in old["note"] else f"{old['note']}; {clause}"
        open(PATH, "w").write(_dump(note, now))
        print("written")


if __name__ == "__main__":
    main(sys.argv[1], "--write" in sys.argv[2:])
