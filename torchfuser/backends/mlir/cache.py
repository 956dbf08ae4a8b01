"""Compile cache: in memory (per process) and on disk (shared by processes), bounded.

Key: op name, spec (eps, offset, …; a graph's code and constants), every argument's
role/shape/dtype, chunk rows, the torch and torch-mlir versions, this backend's ``VERSION``, a
hash of the sources that shape a kernel (``sources()``) and the host CPU the JIT compiles for
(``host_cpu()``: LLVM's host CPU name and the CPU's identity and feature flags; the JIT targets the
host, AVX-512 included, so a cache shared between machines — an NFS home, a baked image — must not
hand one machine's kernels to another, where they would die of SIGILL). On disk, under
``$TORCHFUSER_CACHE_DIR`` or ``$XDG_CACHE_HOME/torchfuser`` (``~/.cache/torchfuser``) in
``mlir/``: ``<key>.json`` (the kernel's signature, so a hit needs no tracing) next to
``<key>.so`` (the JIT's position-independent object linked by the system C compiler) or, where
there is no C compiler, ``<key>.mlir`` (the LLVM-dialect module, JIT-compiled on load).

Safety: a per-key lock serialises threads; an ``fcntl`` lock file serialises processes, and
every file is written to a temporary name and ``os.replace``d, so readers never see half a
file. The directory is trimmed to ``MAX_BYTES`` (least recently used first) after each store.
"""
from __future__ import annotations

import ctypes
import functools
import glob
import hashlib
import importlib.util
import json
import os
import platform
import shutil
import subprocess
import tempfile
import threading
import time
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

import torch

VERSION = "1"   # bump when the pipeline changes what a key compiles to
# ... and, so that a forgotten bump cannot serve a stale kernel (a silent wrong or slow result: an
# expf-calling SwiGLU kernel from before mathlib.py was once served from disk this way), the key
# also holds a hash of every source that shapes a kernel: this backend whole, the reference
# definitions it captures, and the saved-tensor hooks it captures under.
MAX_BYTES = int(os.environ.get("TORCHFUSER_MLIR_CACHE_MAX_MB", "256")) << 20
MAX_MEMORY_ENTRIES = 512

_memory: dict[str, object] = {}
_locks: dict[str, threading.Lock] = {}
_guard = threading.Lock()


@dataclass
class Stats:
    hits_memory: int = 0
    hits_disk: int = 0
    compiles: int = 0
    last: dict = field(default_factory=dict)   # key → {"source": ..., "seconds": ...}


stats = Stats()


def cache_dir() -> str | None:
    """None disables the disk cache (``TORCHFUSER_CACHE_DIR=""``)."""
    root = os.environ.get("TORCHFUSER_CACHE_DIR")
    if root is None:
        base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
        root = os.path.join(base, "torchfuser")
    if not root:
        return None
    return os.path.join(root, "mlir")


def sources() -> list[Path]:
    backends = Path(__file__).resolve().parent.parent
    return [*sorted((backends / "mlir").rglob("*.py")), *sorted((backends / "reference").rglob("*.py")),
            backends / "_saved_hooks.py"]


@functools.lru_cache(maxsize=None)
def pipeline_hash() -> str:
    h = hashlib.sha256()
    root = Path(__file__).resolve().parent.parent
    for path in sources():
        h.update(path.relative_to(root).as_posix().encode() + b"\0" + path.read_bytes() + b"\0")
    return h.hexdigest()[:16]


@functools.lru_cache(maxsize=None)
def torch_mlir_version() -> str:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("torch-mlir")
    except PackageNotFoundError:
        return "unknown"


class _StringRef(ctypes.Structure):
    _fields_ = [("data", ctypes.c_void_p), ("size", ctypes.c_size_t)]


def _llvm_host_cpu_name() -> str | None:
    """``llvm::sys::getHostCPUName()`` of the LLVM inside torch-mlir, the one whose ExecutionEngine
    compiles the kernels for this CPU and its features (``JITTargetMachineBuilder::detectHost``);
    None where that library or symbol is not found (the flags in ``host_cpu`` still key the cache)."""
    try:
        spec = importlib.util.find_spec("torch_mlir")
        if spec is None or not spec.submodule_search_locations:
            return None
        libs = [p for d in spec.submodule_search_locations
                for p in glob.glob(os.path.join(d, "_mlir_libs", "libTorchMLIRAggregateCAPI*"))]
        if not libs:
            return None
        fn = getattr(ctypes.CDLL(sorted(libs)[0]), "_ZN4llvm3sys14getHostCPUNameEv")  # returns a StringRef
        fn.argtypes, fn.restype = [], _StringRef
        ref = fn()
        if not ref.data or not 0 < ref.size < 128:
            return None
        name = ctypes.string_at(ref.data, ref.size).decode("ascii")
        return name if name.isprintable() else None
    except (OSError, AttributeError, ValueError, UnicodeDecodeError, ImportError):
        return None


# the /proc/cpuinfo fields that say which CPU this is and what it can execute (x86 and Arm); not
# stepping, microcode or clocks, which differ between machines that run the same code
_CPUINFO_FIELDS = ("vendor_id", "cpu family", "model", "model name", "CPU implementer", "CPU architecture",
                   "CPU variant", "CPU part")
_CPUINFO_FLAGS = ("flags", "Features")


def _cpuinfo(path: str = "/proc/cpuinfo") -> dict:
    try:
        with open(path) as f:
            first = f.read().split("\n\n", 1)[0]  # the first processor's block
    except OSError:
        return {}
    info = {}
    for line in first.splitlines():
        name, sep, value = line.partition(":")
        name, value = name.strip(), value.strip()
        if not sep:
            continue
        if name in _CPUINFO_FIELDS:
            info[name] = value
        elif name in _CPUINFO_FLAGS:
            info["flags"] = hashlib.sha256(" ".join(sorted(value.split())).encode()).hexdigest()[:16]
    return info


@functools.lru_cache(maxsize=None)
def host_cpu() -> dict:
    """What the JIT compiles for, as part of every key: LLVM's host CPU name (e.g. ``znver4``,
    ``sapphirerapids``) and the CPU's identity and feature flags (/proc/cpuinfo, the flags hashed),
    or the platform's processor string where there is no /proc/cpuinfo. Once per process."""
    return {"llvm": _llvm_host_cpu_name(), "machine": platform.machine(),
            **(_cpuinfo() or {"processor": platform.processor()})}


def make_key(op: str, spec: dict, args: list, rows: int) -> str:
    parts = {
        "op": op,
        "spec": {k: repr(v) for k, v in sorted(spec.items())},
        "args": [(a.role, list(a.shape), str(a.dtype)) for a in args],
        "rows": rows,
        "torch_mlir": torch_mlir_version(),
        "torch": torch.__version__,
        "backend": VERSION,
        "pipeline": pipeline_hash(),
        "host": host_cpu(),
    }
    digest = hashlib.sha256(json.dumps(parts, sort_keys=True).encode()).hexdigest()[:24]
    return f"{op}-{digest}"


def clear_memory() -> None:
    with _guard:
        _memory.clear()


def _key_lock(key: str) -> threading.Lock:
    with _guard:
        return _locks.setdefault(key, threading.Lock())


@contextmanager
def _process_lock(path: str):
    try:
        import fcntl
    except ImportError:  # not POSIX: atomic renames alone keep files whole
        yield
        return
    with open(path, "a+") as f:
        fcntl.flock(f, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)


def _write_atomic(path: str, data: bytes) -> None:
    fd, tmp = tempfile.mkstemp(dir=os.path.dirname(path), prefix=".tmp-")
    with os.fdopen(fd, "wb") as f:
        f.write(data)
    os.replace(tmp, path)


def compiler() -> str | None:
    if os.environ.get("TORCHFUSER_MLIR_NO_CC"):
        return None
    return os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc") or shutil.which("clang")


def link_shared(obj: str, out: str) -> bool:
    cc = compiler()
    if cc is None:
        return False
    tmp = out + f".{os.getpid()}.{threading.get_ident()}.tmp"
    r = subprocess.run([cc, "-shared", "-o", tmp, obj], capture_output=True)
    if r.returncode != 0:
        return False
    os.replace(tmp, out)
    return True


def trim(directory: str, max_bytes: int = MAX_BYTES) -> None:
    """Delete least recently used kernels until the directory holds at most ``max_bytes``."""
    groups: dict[str, list] = {}
    for name in os.listdir(directory):
        if name.startswith(".") or name.endswith(".lock"):
            continue
        path = os.path.join(directory, name)
        try:
            st = os.stat(path)
        except FileNotFoundError:
            continue
        stem = name.rsplit(".", 1)[0]
        g = groups.setdefault(stem, [0, 0.0, []])
        g[0] += st.st_size
        g[1] = max(g[1], st.st_mtime)
        g[2].append(path)
    total = sum(g[0] for g in groups.values())
    for stem, (size, _, paths) in sorted(groups.items(), key=lambda kv: kv[1][1]):
        if total <= max_bytes:
            break
        for p in paths + [os.path.join(directory, stem + ".lock")]:
            try:
                os.remove(p)
            except FileNotFoundError:
                pass
        total -= size


def get(key: str, load: Callable[[str, dict], object], build: Callable[[str | None, str], object]):
    """The kernel for ``key``: from memory, else from disk (``load(directory, meta)``), else
    ``build(directory, key)`` (which writes its files to ``directory`` when it is not None)."""
    k = _memory.get(key)
    if k is not None:
        stats.hits_memory += 1
        return k
    with _key_lock(key):
        k = _memory.get(key)
        if k is not None:
            stats.hits_memory += 1
            return k
        t = time.perf_counter()
        directory = cache_dir()
        if directory is not None:
            os.makedirs(directory, exist_ok=True)
            with _process_lock(os.path.join(directory, key + ".lock")):
                k = _load_disk(directory, key, load)
                source = "disk"
                if k is None:
                    k = build(directory, key)
                    source = "compile"
            if source == "compile":
                trim(directory)
        else:
            k, source = build(None, key), "compile"
        if source == "disk":
            stats.hits_disk += 1
        else:
            stats.compiles += 1
        stats.last[key] = {"source": source, "seconds": time.perf_counter() - t}
        with _guard:
            if len(_memory) >= MAX_MEMORY_ENTRIES:
                _memory.pop(next(iter(_memory)))
            _memory[key] = k
        return k


def _load_disk(directory: str, key: str, load):
    meta_path = os.path.join(directory, key + ".json")
    try:
        with open(meta_path) as f:
            meta = json.load(f)
    except (FileNotFoundError, json.JSONDecodeError):
        return None
    if meta.get("host") != host_cpu():  # compiled for another CPU (or before entries said which)
        return None
    try:
        k = load(directory, meta)
    except Exception:  # a corrupt or foreign entry: rebuild it
        return None
    now = time.time()
    for ext in (".json", ".so", ".mlir"):
        try:
            os.utime(os.path.join(directory, key + ext), (now, now))
        except FileNotFoundError:
            pass
    return k


def store(directory: str, key: str, meta: dict, *, so_from_obj: str | None = None, mlir_text: str | None = None) -> None:
    """Write an entry: the code first, the json last (a json means the entry is complete). The json
    says which CPU the code is for; ``get`` loads no entry written for another."""
    meta = dict(meta, host=host_cpu())
    if so_from_obj is not None and link_shared(so_from_obj, os.path.join(directory, key + ".so")):
        meta = dict(meta, artifact="so")
    elif mlir_text is not None:
        _write_atomic(os.path.join(directory, key + ".mlir"), mlir_text.encode())
        meta = dict(meta, artifact="mlir")
    else:
        return
    _write_atomic(os.path.join(directory, key + ".json"), json.dumps(meta).encode())
