"""The notebooks stay true: every one runs, and its committed outputs are what a fresh run prints.

Each notebook runs once per session, in a fresh process as in a new Jupyter kernel
(notebooks/nbrun.py), two at a time; both tests of a notebook use that one run. The outputs are
compared exactly, but for timings (nbrun.mask_timings) and the bytes of images. When they differ, regenerate:
``python notebooks/make_walkthroughs.py [NAME…]``, and commit what changed.
"""
from __future__ import annotations

import base64
import json
import os
import sys
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path

import pytest

from numerics import _NO_MLIR, needs_mlir

NB_DIR = Path(__file__).parents[1] / "notebooks"
sys.path.insert(0, str(NB_DIR))
import make_walkthroughs  # noqa: E402
import nbrun  # noqa: E402

NOTEBOOKS = sorted(NB_DIR.glob("*.ipynb"))
# Walkthroughs of what the MLIR backend compiles: where torch-mlir is missing they cannot run.
NEEDS_MLIR = {"02_compiler.ipynb"}

_runs: dict[Path, Future] = {}
_pool: ThreadPoolExecutor | None = None


@pytest.fixture(scope="module", autouse=True)
def _start_runs(request):
    """Starts the runs the selected tests need, two at a time: most of a run is one process importing torch."""
    global _pool
    ours = [item for item in request.session.items if getattr(item, "module", None) is sys.modules[__name__]]
    wanted = {item.callspec.params["path"] for item in ours if "path" in getattr(getattr(item, "callspec", None), "params", {})}
    if any(item.name == "test_check_catches_a_changed_output" for item in ours):
        wanted.add(NB_DIR / "03_llama.ipynb")
    if _NO_MLIR is not None:
        wanted -= {NB_DIR / n for n in NEEDS_MLIR}
    _pool = ThreadPoolExecutor(max_workers=min(2, os.cpu_count() or 1))
    for path in sorted(wanted):
        _runs[path] = _pool.submit(nbrun.execute, path)
    yield
    _pool.shutdown(wait=True, cancel_futures=True)
    _runs.clear()


def fresh_run(path: Path) -> dict:
    """``path`` run once per session (both tests of a notebook share the run)."""
    if path not in _runs:
        _runs[path] = _pool.submit(nbrun.execute, path)
    return _runs[path].result()


def _params(all_need_mlir=False):
    return [pytest.param(p, marks=needs_mlir) if all_need_mlir or p.name in NEEDS_MLIR else p for p in NOTEBOOKS]


def _committed(path: Path) -> dict:
    return json.loads(path.read_text())


@pytest.mark.parametrize("path", _params(), ids=lambda p: p.name)
def test_notebook_runs(path):
    error = nbrun.first_error(fresh_run(path))
    assert error is None, f"{path.name} fails in a fresh kernel:\n{error}"


# The committed outputs were made with torch-mlir (the report names the mlir backend): elsewhere
# (the GPU machine) the notebooks run, but their outputs are not expected to be the same.
@pytest.mark.parametrize("path", _params(all_need_mlir=True), ids=lambda p: p.name)
def test_notebook_outputs_are_a_fresh_runs(path):
    committed = _committed(path)
    reason = nbrun.environment_differs(committed)
    if reason:
        pytest.skip(f"{path.name}: {reason}; regenerate to compare ({nbrun.REGENERATE} {path.name})")
    fresh = fresh_run(path)
    if nbrun.first_error(fresh):
        pytest.fail(f"{path.name} does not run (test_notebook_runs shows the error)")
    diff = nbrun.differences(committed, fresh)
    assert not diff, (f"{path.name}: the committed outputs differ from a fresh run (timings aside). If the change "
                      f"is meant, regenerate and commit: {nbrun.REGENERATE} {path.name}\n{diff[:6000]}")


def test_walkthrough_sources_are_the_templates():
    """03-07 are written by make_walkthroughs.py: a hand edit of a cell would be lost at the next regeneration."""
    def cells(nb):
        return [(c["cell_type"], c.get("id"), "".join(c["source"])) for c in nb["cells"]]
    for name, nb in make_walkthroughs.WALKTHROUGHS.items():
        assert (NB_DIR / name).exists(), name
        assert cells(_committed(NB_DIR / name)) == cells(nb), f"{name} is not what make_walkthroughs.py writes"


def test_no_machine_in_committed_outputs():
    """No paths of the machine that ran a notebook, no host name, no timestamp."""
    import re
    machine = re.compile(r"(?<![\w<>.~-])(?:/home/|/Users/|/root/|/work/|/tmp/|/private/|/var/folders/|[A-Z]:\\\\)")
    for path in NOTEBOOKS:
        for cell in _committed(path)["cells"]:
            for o in cell.get("outputs", []):
                text = json.dumps({k: v for k, v in o.items() if k != "data"}) + json.dumps(
                    {m: v for m, v in o.get("data", {}).items() if not m.startswith("image/")})
                assert not machine.search(text), f"{path.name} cell {cell.get('id')}: {machine.search(text)[0]!r} in {text[:300]}"
                assert nbrun.normalise(text) == text, f"{path.name} cell {cell.get('id')}: this machine in {text[:300]}"
                assert "execution" not in cell["metadata"], f"{path.name} cell {cell.get('id')}: timestamps in its metadata"


def test_mask_timings():
    masked = nbrun.mask_timings("slowest eager 114 ms, torchfuser 1,170 ms\n       eager:    44.7 ms  (5,722 tokens/s)\n"
                                "  speed-up: 1.36x  (this run)\n3 s/it, 0.5s")
    assert masked == ("slowest eager <t> ms, torchfuser <t> ms\n       eager: <t> ms  (<t> tokens/s)\n"
                      "  speed-up: <t>x  (this run)\n<t> s/it, <t>s")
    kept = ("batch 4 x 64 tokens, 8 steps, 2 CPU threads, 12 blocks fused, 0 skipped, loss 6.9415, within 1e-5, "
            "<Figure size 500x220 with 1 Axes>, 0x1f, 21 gradients, 557,696 parameters, rms_norm 5")
    assert nbrun.mask_timings(kept) == kept


def test_check_catches_a_changed_output(tmp_path):
    """The comparison can fail: a fresh run written as the generator writes it, then changed in a copy."""
    path = NB_DIR / "03_llama.ipynb"
    fresh = fresh_run(path)
    assert nbrun.first_error(fresh) is None
    copy = tmp_path / path.name
    nbrun.write(copy, make_walkthroughs._executed(path, json.loads(json.dumps(fresh))))
    assert nbrun.differences(json.loads(copy.read_text()), fresh) == ""

    def changed(edit) -> str:
        nb = json.loads(copy.read_text())
        edit(nb["cells"])
        mutated = tmp_path / "mutated.ipynb"
        nbrun.write(mutated, nb)
        return nbrun.differences(json.loads(mutated.read_text()), fresh)

    def outputs(cells, cell_id):
        return next(c for c in cells if c.get("id") == cell_id)["outputs"]

    def replace(cell_id, old, new):
        def edit(cells):
            # The stream that holds the text: a library may write warnings to stderr first (a torchao
            # built for another torch prints its load failure at import).
            streams = [o for o in outputs(cells, cell_id) if o["output_type"] == "stream"]
            stream = next((o for o in streams if old in "".join(o["text"])), None)
            assert stream is not None, (old, [o["text"] for o in streams])
            text = "".join(stream["text"])
            stream["text"] = text.replace(old, new, 1).splitlines(keepends=True)
        return edit

    # The report's text, a count, the loss: each caught, and the diff names the cell.
    diff = changed(replace("03-03", "12 blocks fused", "11 blocks fused"))
    assert "-[03-03] LlamaForCausalLM: 11 blocks fused" in diff and "+[03-03] LlamaForCausalLM: 12 blocks fused" in diff, diff
    assert changed(replace("03-03", "rms_norm 5", "rms_norm 4"))
    assert changed(replace("03-07", "loss ", "loss 1"))
    assert changed(replace("03-01", "parameters", "parameters "))  # even a space
    assert changed(lambda cells: outputs(cells, "03-12").clear())  # an output gone
    assert changed(lambda cells: outputs(cells, "03-10").clear())  # the plot gone
    # Timings and the plot's pixels are not compared.
    timing = next(o for o in outputs(fresh["cells"], "03-09") if o["output_type"] == "stream")
    first_ms = "".join(timing["text"]).split(" ms")[0].split()[-1]
    assert changed(replace("03-09", first_ms + " ms", "98765.4 ms")) == ""
    assert changed(replace("03-09", "speed-up: ", "speed-up: 9")) == ""

    def other_image(cells):
        image = next(o for o in outputs(cells, "03-10") if o["output_type"] == "display_data")
        image["data"]["image/png"] = base64.b64encode(b"other pixels").decode()
    assert changed(other_image) == ""
