"""The README's promises that a test can keep: the quickstart's two commands as CI runs them, the first
snippet of "Use" runs as written (a tiny model, seconds on a CPU), and the files its table cites exist."""
from __future__ import annotations

import contextlib
import io
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
README = (ROOT / "README.md").read_text()


def _section(title: str) -> str:
    start = README.index(f"\n## {title}\n")
    end = README.find("\n## ", start + 1)
    return README[start:end if end > 0 else None]


def test_quickstart_commands_are_the_ones_ci_runs():
    block = re.search(r"```bash\n(.*?)```", _section("Quickstart"), re.S).group(1)
    assert block.splitlines() == ['pip install -e ".[dev]" && torchfuser demo', "python -m pytest"]
    ci = (ROOT / ".ci" / "run").read_text()
    assert 'pip install -q -e ".[dev]"' in ci and "\npython -m pytest\n" in ci and "\n.ci/wheel\n" in ci
    wheel = (ROOT / ".ci" / "wheel").read_text()
    assert "python -m build --wheel" in wheel and "torchfuser demo" in wheel and "__version__" in wheel


def test_the_first_use_snippet_runs_and_fuses():
    code = re.search(r"```python\n(.*?)```", _section("Use"), re.S).group(1)
    assert "from_pretrained" not in code, "the first snippet builds a tiny model, it downloads nothing"
    out, scope = io.StringIO(), {}
    with contextlib.redirect_stdout(out):
        exec(compile(code, "README.md (Use)", "exec"), scope)
    model = scope["model"]
    assert sum(p.numel() for p in model.parameters()) < 5_000_000, "a tiny config"
    assert "blocks fused" in out.getvalue() and "attention 2" in out.getvalue()
    assert not any(type(m).__name__.startswith("Fused") for m in model.modules()), "restored at the end"


def test_cited_result_files_exist():
    latest = ROOT / "benchmarks" / "results" / "latest"
    names = re.findall(r"`(\d{4}-\d\d-\d\d-[^`]*?\.jsonl)`", _section("Measured"))
    assert len(names) >= 6
    for name in names:
        pattern = name.replace("…", "*")
        assert list(latest.glob(pattern)), f"README cites {name}, not in benchmarks/results/latest/"
