"""The architecture sweep (tests/arch_sweep.py) as a test: every causal-LM model type of the installed
transformers, fused and unfused, with zero wrong results and zero crashes; the README's table is
the one the sweep prints."""
from __future__ import annotations

import re
from pathlib import Path

import pytest
import transformers

import arch_sweep

pytestmark = pytest.mark.slow
README = Path(__file__).resolve().parents[1] / "README.md"
# Types whose tiny configs must build and fuse: if the sweep's config builder breaks, this says so.
CORE = ("llama", "mistral", "qwen2", "qwen3", "gemma", "phi3", "gpt2", "gpt_neox", "opt", "mixtral")


@pytest.fixture(scope="module")
def results():
    return arch_sweep.sweep()


def test_no_wrong_result_and_no_crash(results):
    failed = [f"{r.model_type}: {r.kind}: {r.detail}" for r in results if r.failed]
    print("\n" + arch_sweep.summary(results))
    assert not failed, "\n".join(failed)


def test_the_sweep_builds_what_it_should(results):
    by_type = {r.model_type: r for r in results}
    assert all(by_type[t].kind == "fused" for t in CORE), {t: by_type[t].kind for t in CORE}
    unbuildable = [r.model_type for r in results if r.kind == "unbuildable"]
    assert len(unbuildable) <= len(results) // 6, unbuildable


def test_readme_table_is_generated(results):
    text = README.read_text()
    assert arch_sweep._BEGIN in text, "the README has no generated table: run `python tests/arch_sweep.py --readme`"
    found = re.search(r"with transformers (\S+?):", text[text.find(arch_sweep._BEGIN):])
    if found is None or found.group(1) != transformers.__version__:
        pytest.skip(f"the README's table is for another transformers than {transformers.__version__}")
    assert arch_sweep.table(results) in text, "the README's table is stale: run `python tests/arch_sweep.py --readme`"
