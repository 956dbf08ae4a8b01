"""Several linear projections of one input as one matrix product (q, k and v of attention).

Under autocast, ``[m(x) for m in linears]`` casts ``x`` to the autocast dtype once per
projection, saves each cast copy for the backward, runs a small GEMM per projection, and in the
backward turns each bf16 ``dx`` back to fp32 and adds them up. Here the input is cast once, the
(cast) weights are concatenated, one GEMM gives every output, and the backward's single GEMM
sums the projections' ``dx`` in fp32 inside cuBLAS before the one rounding: fewer launches, less
traffic, one saved copy of the input instead of one per projection, and ``dx`` no less accurate.

Only plain ``nn.Linear`` children without hooks qualify (a LoRA or quantised layer, a hook, an
FSDP-wrapped child must each be called as itself), and only under autocast: without it the
concatenated weights would be an extra copy to save for the backward.
"""
from __future__ import annotations

import torch
from torch import Tensor, nn
from torch.nn.modules import module as _module

_AUTOCAST_CASTS = (torch.float32, torch.bfloat16, torch.float16)  # autocast leaves float64 alone
_GLOBAL_HOOKS = ("_global_forward_hooks", "_global_forward_pre_hooks", "_global_backward_hooks",
                 "_global_backward_pre_hooks")


def _plain(linears) -> bool:
    if any(getattr(_module, name) for name in _GLOBAL_HOOKS):
        return False
    with_bias = linears[0].bias is not None
    return all(
        type(m) is nn.Linear and (m.bias is not None) == with_bias
        and not (m._forward_hooks or m._forward_pre_hooks or m._backward_hooks or m._backward_pre_hooks)
        for m in linears
    )


def project(x: Tensor, linears: list[nn.Module]) -> list[Tensor]:
    """``[m(x) for m in linears]``, as one GEMM where that gives the same result."""
    device = x.device.type
    if (len(linears) < 2 or x.dtype not in _AUTOCAST_CASTS or not torch.is_autocast_enabled(device)
            or not _plain(linears)):
        return [m(x) for m in linears]
    dtype = torch.get_autocast_dtype(device)
    # Concatenate, then cast: two launches whatever the number of projections, and one cast
    # back in the backward (weights are small next to activations; the launches count).
    weight = torch.cat([m.weight for m in linears]).to(dtype)
    bias = None if linears[0].bias is None else torch.cat([m.bias for m in linears]).to(dtype)
    with torch.autocast(device, enabled=False):
        y = nn.functional.linear(x.to(dtype), weight, bias)
    return list(y.split([m.out_features for m in linears], dim=-1))
