"""The MLIR disk cache key covers everything that shapes a kernel: a stale kernel served from disk
is a silent wrong result."""
from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
import torch.fx

from numerics import needs_mlir
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


# ---------------------------------------------------------------- the host CPU (issue 35)
# The JIT compiles for the host CPU (AVX-512 where there is one): a kernel cached on one machine and
# loaded on another (an NFS home, a baked image) would die of SIGILL. The key holds the CPU.

_CPU_A = {"llvm": "sapphirerapids", "machine": "x86_64", "vendor_id": "GenuineIntel", "model name": "A", "flags": "aaaa"}
_CPU_B = {"llvm": "haswell", "machine": "x86_64", "vendor_id": "GenuineIntel", "model name": "B", "flags": "bbbb"}


def _on(monkeypatch, cpu: dict) -> None:
    """This process now runs on ``cpu`` (as the probe reports it); no key memoised from before."""
    from torchfuser.backends.mlir import compile as mlir_compile

    monkeypatch.setattr(cache, "host_cpu", lambda: cpu, raising=False)  # raising=False: the test fails on a key without it
    monkeypatch.setattr(mlir_compile, "_keys", {})
    cache.clear_memory()


def test_the_key_changes_with_the_cpu(monkeypatch):
    _on(monkeypatch, _CPU_A)
    a = _key()
    assert _key() == a
    _on(monkeypatch, _CPU_B)
    assert _key() != a
    for field in _CPU_A:  # any one field: the LLVM CPU name, the flags, the model
        _on(monkeypatch, dict(_CPU_A, **{field: "other"}))
        assert _key() != a, field


def test_the_probe_reads_llvm_and_the_flags_once(monkeypatch):
    """The real probe: a changed LLVM host CPU name or a changed flag changes the key; the probe
    runs once per process (the key of every kernel lookup would pay for it otherwise)."""
    calls = []
    monkeypatch.setattr(cache, "_llvm_host_cpu_name", lambda: calls.append(1) or "znver4")
    monkeypatch.setattr(cache, "_cpuinfo", lambda: {"model name": "AMD EPYC", "flags": "f1"})
    cache.host_cpu.cache_clear()
    try:
        a = _key()
        _key()
        assert calls == [1]
        monkeypatch.setattr(cache, "_llvm_host_cpu_name", lambda: "skylake")
        cache.host_cpu.cache_clear()
        assert _key() != a
        monkeypatch.setattr(cache, "_llvm_host_cpu_name", lambda: "znver4")
        monkeypatch.setattr(cache, "_cpuinfo", lambda: {"model name": "AMD EPYC", "flags": "f2"})
        cache.host_cpu.cache_clear()
        assert _key() != a
    finally:
        cache.host_cpu.cache_clear()


def test_cpuinfo_keeps_identity_and_flags_not_clocks(tmp_path):
    block = ("processor\t: {p}\nvendor_id\t: AuthenticAMD\ncpu family\t: 25\nmodel\t\t: 17\n"
             "model name\t: AMD EPYC 9654\nstepping\t: {s}\nmicrocode\t: 0x{s}\ncpu MHz\t\t: {mhz}\n"
             "flags\t\t: fpu sse2 avx2 {extra}\nbogomips\t: {mhz}\n\n")
    one = tmp_path / "one"
    one.write_text(block.format(p=0, s=1, mhz=2400.1, extra="avx512f") + block.format(p=1, s=1, mhz=3100.0, extra="avx512f"))
    same = tmp_path / "same"  # other clocks, stepping and microcode: the same code runs
    same.write_text(block.format(p=0, s=2, mhz=3700.0, extra="avx512f"))
    less = tmp_path / "less"  # no AVX-512
    less.write_text(block.format(p=0, s=1, mhz=2400.1, extra=""))
    info = cache._cpuinfo(str(one))
    assert info["model name"] == "AMD EPYC 9654" and info["vendor_id"] == "AuthenticAMD" and len(info["flags"]) == 16
    assert cache._cpuinfo(str(same)) == info
    assert cache._cpuinfo(str(less)) != info
    assert cache._cpuinfo(str(tmp_path / "missing")) == {}


def test_the_real_probe_names_a_cpu():
    cache.host_cpu.cache_clear()
    try:
        cpu = cache.host_cpu()
    finally:
        cache.host_cpu.cache_clear()
    assert cpu["machine"] and (cpu.get("flags") or cpu.get("processor") or cpu["llvm"])
    json_ok = cache.make_key("op", {}, [], 1)  # the probe's answer is JSON-serialisable
    assert json_ok.startswith("op-")


def _fake_kernel_get(key: str, built: list, loaded: list):
    def build(directory, k):
        built.append(k)
        cache.store(directory, k, {"key": k}, mlir_text="llvm.func @kernel()")
        return ("kernel", k)

    def load(directory, meta):
        loaded.append(meta["key"])
        return ("kernel", meta["key"])

    return cache.get(key, load, build)


def test_entries_compiled_for_another_cpu_are_not_loaded(tmp_path, monkeypatch):
    """Through the disk cache itself (no torch-mlir needed): an entry written on CPU A is loaded on
    CPU A, never on CPU B, not even one whose file name B looks up (a copied or renamed entry)."""
    monkeypatch.setenv("TORCHFUSER_CACHE_DIR", str(tmp_path))
    built, loaded = [], []
    _on(monkeypatch, _CPU_A)
    key_a = _key()
    _fake_kernel_get(key_a, built, loaded)
    _on(monkeypatch, _CPU_A)  # a new process on A: from disk
    _fake_kernel_get(key_a, built, loaded)
    assert built == [key_a] and loaded == [key_a]

    _on(monkeypatch, _CPU_B)  # on B: another key, compiled afresh
    key_b = _key()
    assert key_b != key_a
    _fake_kernel_get(key_b, built, loaded)
    assert built == [key_a, key_b] and loaded == [key_a]

    # A's entry under B's name (copied by hand, or a key that does not see the difference)
    d = tmp_path / "mlir"
    for ext in (".json", ".mlir"):
        (d / (key_b + ext)).write_bytes((d / (key_a + ext)).read_bytes())
    _on(monkeypatch, _CPU_B)
    _fake_kernel_get(key_b, built, loaded)
    assert built == [key_a, key_b, key_b] and loaded == [key_a]
    assert json.loads((d / (key_b + ".json")).read_text())["host"] == _CPU_B  # rebuilt for B


@needs_mlir
def test_a_kernel_compiled_on_another_cpu_is_compiled_again(tmp_path, monkeypatch):
    """End to end with a real kernel: compiled on A, then looked up on B (compiles), then on A (disk)."""
    from torchfuser.backends.mlir import compile as mlir_compile
    from torchfuser.backends.mlir.capture import ROW, ArgSpec

    monkeypatch.setenv("TORCHFUSER_CACHE_DIR", str(tmp_path))
    args = [ArgSpec(ROW, (16,), torch.float32)]

    def source_on(cpu):
        _on(monkeypatch, cpu)
        kernel = mlir_compile.kernel_for("host_probe_test", {}, lambda x: (torch.sigmoid(x) * x,), args)
        (key,) = [k for k in cache.stats.last if k.startswith("host_probe_test-") and k in cache._memory]
        x = torch.randn(5, 16)
        torch.testing.assert_close(kernel(x)[0], torch.sigmoid(x) * x)
        return cache.stats.last[key]["source"]

    assert source_on(_CPU_A) == "compile"
    assert source_on(_CPU_B) == "compile"
    assert source_on(_CPU_A) == "disk"
    assert source_on(_CPU_B) == "disk"
    assert len(list((tmp_path / "mlir").glob("host_probe_test-*.json"))) == 2
