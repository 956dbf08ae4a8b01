"""The benchmarks' profiler runs: a few calls under torch.profiler, each ending on an idle GPU (as
the timed calls do), and the table of what took the time."""
from __future__ import annotations

from pathlib import Path

import torch


def profiled(call, device: torch.device, times: int, record_shapes: bool = False):
    """The profile of ``call()`` run ``times`` times (host ops, and GPU kernels on a GPU)."""
    from torch.profiler import ProfilerActivity, profile

    cuda = device.type == "cuda"
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
    with profile(activities=activities, record_shapes=record_shapes) as prof:
        for _ in range(times):
            call()
            if cuda:
                torch.cuda.synchronize(device)
    return prof


def idle_gaps(prof):
    """(GPU kernels in start order, [(gap start, gap end, kernel before, kernel after)]): the spans in
    which no kernel ran, between the first kernel and the last."""
    from torch.autograd import DeviceType

    kernels = sorted((e for e in prof.events() if e.device_type == DeviceType.CUDA), key=lambda e: e.time_range.start)
    gaps, end, last = [], None, None
    for k in kernels:
        if end is not None and k.time_range.start > end:
            gaps.append((end, k.time_range.start, last, k))
        if end is None or k.time_range.end > end:
            end, last = k.time_range.end, k
    return kernels, gaps


def gpu_idle(prof, top: int = 12) -> str:
    """Where the GPU waits for the host: the gaps between consecutive kernels, largest first."""
    kernels, found = idle_gaps(prof)
    gaps = [(b - a, before.name, after.name) for a, b, before, after in found]
    span = kernels[-1].time_range.end - kernels[0].time_range.start if kernels else 0
    lines = [f"\nGPU idle between kernels: {sum(g[0] for g in gaps) / 1e3:.2f} ms of {span / 1e3:.2f} ms "
             f"({len(gaps)} gaps); largest:"]
    lines += [f"  {g:9.1f} us  after {a[:60]}  before {b[:60]}" for g, a, b in sorted(gaps, reverse=True)[:top]]
    return "\n".join(lines) + "\n"


_COPIES = ("aten::copy_", "aten::_to_copy", "aten::cat", "aten::clone", "aten::contiguous")


def copies_by_shape(prof, top: int = 30) -> str:
    """The copies, casts and concatenations by input shapes and dtypes (a profile taken with ``record_shapes``):
    which tensors the "copies, casts, cat" of ``kernel_time_by_kind`` move. Device time includes the kernels the
    op launched."""
    rows = [e for e in prof.key_averages(group_by_input_shape=True) if e.key in _COPIES]
    if not rows:
        return ""
    rows.sort(key=lambda e: -e.device_time_total)
    lines = ["\nCopies by input shape (device ms, calls, op, shapes):"]
    lines += [f"  {e.device_time_total / 1e3:8.3f} {e.count:5d}  {e.key:16} {e.input_shapes}"[:240] for e in rows[:top]]
    return "\n".join(lines) + "\n"


def write_tables(prof, path: Path, keys: tuple[str, ...], rows: int, width: int, extra: str = "") -> None:
    """One table per sort key (e.g. ``self_cuda_time_total``), then ``extra``, written to ``path``."""
    averages = prof.key_averages()
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("\n\n".join(averages.table(sort_by=k, row_limit=rows, max_name_column_width=width) for k in keys) + extra)


# Where the host's Python time goes, by the file a function is defined in (the first rule that matches).
_HOST_GROUPS = (("torchfuser", "/torchfuser/"), ("transformers", "/transformers/"), ("peft / trl", ("/peft/", "/trl/")),
                ("triton's launcher", "/triton/"), ("torch (Python side)", "/torch/"))


def host_profile(call, times: int) -> str:
    """Where the host spends a step: ``call()`` run ``times`` times under cProfile, as a report of the wall time a
    step, the Python time a step by package (each function's own time; a built-in's with the package of one of its
    callers, the first cProfile lists: a kernel launch's C++ in the launcher's, an ``.item()``'s wait for the GPU in
    whoever asked), and the functions with the most own time. On a host-bound step (the GPU waiting between kernels) this is what to cut."""
    import cProfile
    import pstats
    import time

    prof = cProfile.Profile()
    start = time.perf_counter()
    prof.enable()
    for _ in range(times):
        call()
    prof.disable()
    wall = (time.perf_counter() - start) / times * 1e3
    stats = pstats.Stats(prof).stats
    groups: dict[str, float] = {}
    rows = []
    for (path, line, name), (_, calls, own, _, callers) in stats.items():
        where = path if path != "~" else next((c[0] for c in callers if c[0] != "~"), "~")
        group = next((g for g, keys in _HOST_GROUPS if any(k in where for k in ((keys,) if isinstance(keys, str) else keys))),
                     "other")
        groups[group] = groups.get(group, 0.0) + own / times * 1e3
        rows.append((own / times * 1e3, calls // times, f"{path.split('site-packages/')[-1]}:{line} {name}"[-110:]))
    lines = [f"Host time a step ({times} steps under cProfile, which slows Python down): wall {wall:.2f} ms",
             "Python time a step by package (own time; a built-in's with a caller's package):"]
    lines += [f"  {g:24} {ms:8.2f} ms" for g, ms in sorted(groups.items(), key=lambda kv: -kv[1])]
    lines.append("Functions by own time (ms a step, calls a step):")
    lines += [f"  {ms:8.3f} {n:6d}  {where}" for ms, n, where in sorted(rows, reverse=True)[:40]]
    return "\n".join(lines) + "\n"


# A GPU kernel's kind, from its name in a profiler table: the first rule that matches.
_KINDS = (("GEMMs", ("nvjet", "cutlass", "splitKreduce", "gemm")), ("cuDNN attention", ("cudnn",)),
          ("AdamW", ("FusedOptimizer",)), ("Inductor's kernels", ("triton_",)),
          ("copies, casts, cat", ("copy", "Memcpy", "CatArray")), ("residual adds", ("CUDAFunctor_add",)))
_HOST_ROWS = ("aten::", "##", "Optimizer", "cuda", "Activity", "autograd", "Torch", "Pregraph", "AOT", "Compiled",
              "Eager", "_Replay")


def kernel_time_by_kind(table: str, steps: int) -> dict[str, float]:
    """GPU ms a step by kind of kernel, from a table ``write_tables`` wrote (sorted by self CUDA time)
    over ``steps`` steps; our Triton kernels (names starting with ``_``) are "torchfuser kernels"."""
    lines = table.splitlines()
    start = lines[1].index("Name") + len("Name")
    kinds: dict[str, float] = {}
    for line in lines[3:]:
        if line.startswith("-"):
            break
        name, values = line[:start].strip(), line[start:].split()
        if len(values) != 10 or name.startswith(_HOST_ROWS):
            continue
        cuda = values[5]  # Self CUDA
        ms = float(cuda[:-2]) / (1e3 if cuda.endswith("us") else 1)
        kind = next((k for k, keys in _KINDS if any(key in name for key in keys)),
                    "torchfuser kernels" if name.startswith("_") else "other")
        kinds[kind] = kinds.get(kind, 0.0) + ms / steps
    return kinds


if __name__ == "__main__":  # python benchmarks/profiling.py TABLE [STEPS]: kernel time a step by kind
    import sys

    table = Path(sys.argv[1]).read_text()
    kinds = kernel_time_by_kind(table, int(sys.argv[2]) if len(sys.argv) > 2 else 2)
    for kind, ms in sorted(kinds.items(), key=lambda kv: -kv[1]):
        print(f"{kind:22} {ms:7.2f} ms")
    print(f"{'total':22} {sum(kinds.values()):7.2f} ms")
