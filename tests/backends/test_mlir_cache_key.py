"""The MLIR disk cache key covers everything that shapes a kernel: a stale kernel served from disk
is a silent wrong result."""
from __future__ import annotations

from pathlib import Path

import pytest
import torch
import torch.fx

from torchfuser.backends.mlir import cache, graph

_MLIR = Path(cache.__file__).resolve().parent
_REFERENCE = _MLIR.parent / "reference"


@pytest.fixture
def fresh_hash():
    cache.pipeline_hash.cache_clear()
    yield
    cache.pipeline_hash.cache_clear()


def _key() -> str:
    return cache.make_key("rms_norm_fwd", {"eps": 1e-6, "offset": 0.0}, [], 8)


def test_every_backend_source_and_reference_definition_is_hashed():
    hashed = set(cache.sources())
    assert set(_MLIR.glob("*.py")) <= hashed and set(_REFERENCE.glob("*.py")) <= hashed
    assert _MLIR.parent / "_saved_hooks.py" in hashed


@pytest.mark.parametrize("changed", [_MLIR / "ops.py", _MLIR / "graph.py", _MLIR / "runner.py", _REFERENCE / "rms_norm.py",
                                     _REFERENCE / "_autodiff.py", _MLIR.parent / "_saved_hooks.py"])
def test_a_changed_source_changes_the_key(changed, fresh_hash, monkeypatch):
    before = _key()
    real = Path.read_bytes
    monkeypatch.setattr(Path, "read_bytes", lambda p: real(p) + (b"# changed" if p == changed else b""))
    cache.pipeline_hash.cache_clear()
    assert _key() != before


class _Scale(torch.nn.Module):
    def __init__(self, c):
        super().__init__()
        self.c = c

    def forward(self, x):
        return x * self.c


class _Stop(Exception):
    pass


def _graph_key(c: torch.Tensor, monkeypatch) -> str:
    """The key compile_graph asks the cache for (stopped there: no torch-mlir needed)."""
    def stop(op, spec, fn, args, rows=None):
        raise _Stop(cache.make_key(op, spec, list(args), rows or 8))

    monkeypatch.setattr(graph, "kernel_for", stop)
    with pytest.raises(_Stop) as info:
        graph.compile_graph(torch.fx.symbolic_trace(_Scale(c)), [torch.randn(4, 3)], dynamic=True)
    return info.value.args[0]


def test_a_graph_of_the_same_code_with_other_constants_gets_another_key(monkeypatch):
    one = _graph_key(torch.tensor([1.0, 2.0, 3.0]), monkeypatch)
    assert _graph_key(torch.tensor([1.0, 2.0, 3.0]), monkeypatch) == one
    assert _graph_key(torch.tensor([1.0, 2.0, 4.0]), monkeypatch) != one
    assert _graph_key(torch.tensor([1.0, 2.0, 3.0], dtype=torch.float64), monkeypatch) != one
