"""Packed (padding-free) rows in the fused attention: variable-length attention instead of SDPA over
the dense block-diagonal mask.

A batch built by transformers' ``DataCollatorWithFlattening`` (or TRL's ``padding_free=True``) holds
several samples per row, its ``position_ids`` restarting at 0 where each sample begins; transformers
then gives every layer a (B, 1, S, S) mask that is causal within each sample and blocks the rest.
SDPA with that mask runs its masked kernel over all S × S scores; PyTorch's variable-length
attention (``torch.nn.attention.varlen``, FlashAttention over the samples' offsets) computes only
the samples' own triangles: 4-10× faster forward + backward on the H200 at 8192-token rows of ~20
samples (benchmarks/probes/varlen_probe.py, docs/performance/NOTES-train-step.md).

The switch is exact, or not taken: the mask the layer is given must equal, element for element,
the block-causal mask of the samples ``position_ids`` delimit (a sliding window, padding, any other
mask keeps SDPA). That check and the samples' offsets need host reads: once per forward (the model
passes one mask object to every layer; the answer is cached on it), and never while compiling or
capturing a CUDA graph (then SDPA runs).
"""
from __future__ import annotations

import inspect
from functools import lru_cache

import torch
from torch import Tensor
from torch.utils.weak import WeakTensorKeyDictionary

# mask → (its version, the position_ids it was checked with, (cu_seqlens, longest) or None)
_SEGMENTS = WeakTensorKeyDictionary()
_CALLS = "_torchfuser_varlen_calls"
HEAD = "packed rows: "  # the report's note, replaced when the report is refreshed


def kernel_for(q: Tensor):
    """PyTorch's varlen attention where it runs q: CUDA, fp16/bf16, head_dim a multiple of 8 up to 256."""
    if q.device.type != "cuda" or q.dtype not in (torch.float16, torch.bfloat16) or q.shape[-1] % 8 or q.shape[-1] > 256:
        return None
    try:
        from torch.nn.attention.varlen import varlen_attn
    except ImportError:
        return None
    return varlen_attn


def segments(mask, position_ids) -> tuple[Tensor, int] | None:
    """(cu_seqlens, longest sample) when ``mask`` is exactly the block-causal mask of the samples in
    ``position_ids`` (each row made of samples whose positions run 0, 1, ...), else None."""
    if not isinstance(mask, Tensor) or not isinstance(position_ids, Tensor):
        return None
    if mask.is_inference():  # no version counter (torch.inference_mode): an in-place write would go unseen
        return _segments(mask, position_ids)
    hit = _SEGMENTS.get(mask)
    if hit is not None and hit[0] == mask._version and hit[1] is position_ids:
        return hit[2]
    found = _segments(mask, position_ids)
    _SEGMENTS[mask] = (mask._version, position_ids, found)
    return found


def _segments(mask: Tensor, pos: Tensor):
    if mask.dim() != 4 or pos.dim() != 2:
        return None
    b, s = mask.shape[0], mask.shape[-1]
    if mask.shape[1] != 1 or mask.shape[2] != s or pos.shape[-1] != s or pos.shape[0] not in (1, b):
        return None
    pos = pos.expand(b, s)
    starts = pos == 0
    steps_ok = (starts[:, 1:] | (pos[:, 1:] == pos[:, :-1] + 1)).all() & starts[:, 0].all()
    sample = starts.reshape(-1).cumsum(0).view(b, s)
    causal = torch.ones(s, s, dtype=torch.bool, device=mask.device).tril()
    expected = causal & (sample[:, :, None] == sample[:, None, :])
    allowed = mask[:, 0] if mask.dtype == torch.bool else mask[:, 0] == 0
    packed = starts.sum() > b  # some row holds more than one sample
    if not bool(steps_ok & packed & (allowed == expected).all()):
        return None
    offsets = starts.reshape(-1).nonzero().flatten()
    cu = torch.cat([offsets, offsets.new_tensor([b * s])]).to(torch.int32)
    return cu, int(torch.diff(cu).max())


def counted(module) -> None:
    """One more call of ``module`` (a fused attention) that ran variable-length attention."""
    if not torch.compiler.is_compiling():
        module.__dict__[_CALLS] = module.__dict__.get(_CALLS, 0) + 1


def notes(model) -> list[str]:
    """The report's line: how many attention calls ran variable-length attention on packed rows."""
    calls = [m.__dict__[_CALLS] for m in model.modules() if _CALLS in m.__dict__]
    if not calls:
        return []
    return [f"{HEAD}{sum(calls)} attention calls in {len(calls)} modules ran variable-length attention "
            "(torch.nn.attention.varlen) over the samples, not SDPA over the block mask"]


def attention(kernel, q: Tensor, k: Tensor, v: Tensor, cu: Tensor, longest: int, scale: float | None) -> Tensor:
    """Causal attention within each sample: q, k, v as B×H×S×D (k, v with H_kv heads), the output
    as B×S×H×D (what SDPA's wrapper returns)."""
    b, h, s, d = q.shape
    flat = [t.transpose(1, 2).reshape(b * s, t.shape[1], d) for t in (q, k, v)]
    kw = {"scale": scale}
    params = _parameters(kernel)
    if "is_causal" in params:
        kw["is_causal"] = True
    else:
        kw["window_size"] = (-1, 0)  # causal
    if "enable_gqa" in params and k.shape[1] != h:
        kw["enable_gqa"] = True
    out = kernel(*flat, cu, cu, longest, longest, **kw)
    return out.view(b, s, h, d)


@lru_cache(maxsize=None)
def _parameters(kernel) -> frozenset:
    """The keyword parameters of this PyTorch's varlen kernel (they differ between releases)."""
    return frozenset(inspect.signature(kernel).parameters)
