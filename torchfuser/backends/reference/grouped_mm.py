"""Grouped matrix products over rows sorted by expert, and the permutation that sorts them.

Two forms, ``offs`` being the int32 running row counts per group (offs[e] = rows of groups ≤ e):
- ``rows``: a (S, K) @ b[e] (E, K, N) for the rows of group e → (S, N): the experts' forward and dx;
- ``k``: a (K, S) @ b (S, N), summed over the rows of group e → (E, K, N): the weight gradients
  (a group without rows gets zeros).

``torch._grouped_mm`` runs both as one kernel, on the CPU and on Hopper (fp32 / bf16 / fp16 — fp32 on CUDA with a host sync, so not while a CUDA graph is captured; seen exact,
empty groups zeroed, on an H200 with torch 2.11: benchmarks/probes/moe_probe.py), when every operand's
rows start 16-byte aligned. Elsewhere (fp64, other dtypes, odd widths, a torch
without it) a loop over the groups runs instead: correct, slower, and counted by the fused module
(``usable``). Its row bounds are read back to the host once a call, except while a CUDA graph is
captured, where each group's product runs over all rows with the others masked out (E× the work).
"""
from __future__ import annotations

import torch

_CPU_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
_CUDA_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


def _aligned(t: torch.Tensor, dtype: torch.dtype) -> bool:
    """What _grouped_mm asks of an operand in ``dtype``: a 16-byte aligned start, and a 16-byte multiple as
    the stride of every dimension that is not the contiguous one. An operand of another dtype is checked as
    its cast copy will be (same strides, a fresh, aligned allocation)."""
    size = torch.empty((), dtype=dtype).element_size()
    start = t.dtype != dtype or t.data_ptr() % 16 == 0
    return start and all(s == 1 or (s * size) % 16 == 0 for s in t.stride())


def usable(dtype: torch.dtype, device: torch.device, *tensors: torch.Tensor) -> bool:
    """Whether ``torch._grouped_mm`` takes these operands in ``dtype`` on this device, as laid out here."""
    if not hasattr(torch, "_grouped_mm"):
        return False
    if device.type == "cpu":
        ok = dtype in _CPU_DTYPES
    elif device.type == "cuda":
        # fp32 products read the group sizes back to the host (torch 2.11: a sync), which a CUDA-graph
        # capture forbids: captured, they run as the masked loop instead.
        ok = dtype in _CUDA_DTYPES and torch.cuda.get_device_capability(device) >= (9, 0) and not (
            dtype == torch.float32 and torch.cuda.is_current_stream_capturing())
    else:
        ok = False
    return ok and all(_aligned(t, dtype) for t in tensors)


def rows(a: torch.Tensor, b: torch.Tensor, offs: torch.Tensor) -> torch.Tensor:
    """a (S, K), b (E, K, N) (any strides) → (S, N): row s times b[group of s]."""
    if usable(a.dtype, a.device, a, b):
        return torch._grouped_mm(a, b, offs=offs)
    out = a.new_zeros(a.shape[0], b.shape[-1])
    if a.device.type == "meta":  # shapes only
        return out
    for e, lo, hi in _groups(offs, a.shape[0]):
        if isinstance(lo, int):
            torch.mm(a[lo:hi], b[e], out=out[lo:hi])
        else:  # masks, not slices: under CUDA-graph capture the bounds stay on the device
            keep = _mask(lo, hi, a.shape[0])
            out += keep * (a @ b[e])
    return out


def k(a: torch.Tensor, b: torch.Tensor, offs: torch.Tensor) -> torch.Tensor:
    """a (K, S), b (S, N) → (E, K, N): the product over the rows (columns of a) of each group."""
    n_groups = offs.shape[0]
    if usable(a.dtype, a.device, a, b):
        return torch._grouped_mm(a, b, offs=offs)
    out = a.new_zeros(n_groups, a.shape[0], b.shape[-1])
    if a.device.type == "meta":
        return out
    for e, lo, hi in _groups(offs, b.shape[0]):
        if isinstance(lo, int):
            torch.mm(a[:, lo:hi], b[lo:hi], out=out[e])
        else:
            out[e] = a @ (_mask(lo, hi, b.shape[0]) * b)
    return out


def _groups(offs: torch.Tensor, n_rows: int):
    """(group, first row, end row) of every group with rows: Python ints, or 0-d device tensors
    while a CUDA graph is captured (no host read may happen then)."""
    capturing = offs.is_cuda and torch.cuda.is_current_stream_capturing()
    if capturing:
        starts = torch.cat([offs.new_zeros(1), offs[:-1]])
        return [(e, starts[e], offs[e]) for e in range(offs.shape[0])]
    ends = offs.tolist()
    starts = [0] + ends[:-1]
    return [(e, lo, hi) for e, (lo, hi) in enumerate(zip(starts, ends)) if hi > lo]


def _mask(lo: torch.Tensor, hi: torch.Tensor, n_rows: int) -> torch.Tensor:
    r = torch.arange(n_rows, device=lo.device)
    return ((r >= lo) & (r < hi)).unsqueeze(-1)


def sort_by_expert(indices: torch.Tensor, num_experts: int):
    """(order, offs) for the (T, k) expert indices: ``order`` (S = T·k,) lists the slots (token·k + j)
    grouped by expert, ascending, each group in slot order (a stable sort, so that results do not
    depend on the sort's tie order); ``offs`` (E,) int32 are the running row counts. No host sync."""
    flat = indices.reshape(-1)
    sorted_ids, order = torch.sort(flat, stable=True)
    bounds = torch.arange(1, num_experts + 1, device=flat.device, dtype=sorted_ids.dtype)
    offs = torch.searchsorted(sorted_ids, bounds, right=False).to(torch.int32)
    return order, offs


def inverse(order: torch.Tensor) -> torch.Tensor:
    """The permutation that takes sorted rows back to slot order."""
    return torch.empty_like(order).scatter_(0, order, torch.arange(order.shape[0], device=order.device))
