"""The benchmarks' profiler runs: a few calls under torch.profiler, each ending on an idle GPU (as
the timed calls do), and the table of what took the time."""
from __future__ import annotations

from pathlib import Path

import torch


def profiled(call, device: torch.device, times: int):
    """The profile of ``call()`` run ``times`` times (host ops, and GPU kernels on a GPU)."""
    from torch.profiler import ProfilerActivity, profile

    cuda = device.type == "cuda"
    with profile(activities=[ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])) as prof:
        for _ in range(times):
            call()
            if cuda:
                torch.cuda.synchronize(device)
    return prof


def write_tables(prof, path: Path, keys: tuple[str, ...], rows: int, width: int, extra: str = "") -> None:
    """One table per sort key (e.g. ``self_cuda_time_total``), then ``extra``, written to ``path``."""
    averages = prof.key_averages()
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("\n\n".join(averages.table(sort_by=k, row_limit=rows, max_name_column_width=width) for k in keys) + extra)
