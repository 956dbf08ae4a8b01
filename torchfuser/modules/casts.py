"""A decoder layer's projection weights cast to the autocast dtype by one multi-tensor copy.

Under autocast every projection casts its fp32 weight when it runs: a copy kernel per weight, and
for the groups that run as one GEMM (q/k/v, gate/up) a concatenation too. Each is a launch, and
without CUDA graphs each costs host time. ``LayerCasts`` casts them all with one
``torch._foreach_copy_`` into one buffer, laid out so that each group is one contiguous block: its
concatenation costs nothing. The fused layer (``residual_norm.ResidualNormForward``) makes it
current around its blocks, and ``projections.joint`` / ``residual_linear`` take their weights from
it. The values are the same casts, so every result is bit for bit what it is without it.
"""
from __future__ import annotations

import contextlib
from contextvars import ContextVar

import torch
from torch import Tensor, nn

_CURRENT: ContextVar["LayerCasts | None"] = ContextVar("torchfuser_layer_casts", default=None)
_ALIGN = 64  # elements: every block starts 128-byte aligned, as cuBLAS's fast paths want


class LayerCasts:
    """The weights (and biases) of ``groups`` of ``nn.Linear``s, cast to ``dtype``: per group, the
    weights' rows as one block and the biases as another."""

    def __init__(self, groups: list[list[nn.Linear]], dtype: torch.dtype):
        sizes = []
        for group in groups:
            rows = sum(m.out_features for m in group)
            sizes.append(rows * group[0].in_features)
            if group[0].bias is not None:
                sizes.append(rows)
        flat = torch.empty(sum(-(-n // _ALIGN) * _ALIGN for n in sizes), dtype=dtype, device=groups[0][0].weight.device)
        offsets = iter(sizes)
        start, dsts, srcs, self.dtype, self.blocks = 0, [], [], dtype, {}

        def block(shape):
            nonlocal start
            n = next(offsets)
            view = flat[start:start + n].view(shape)
            start += -(-n // _ALIGN) * _ALIGN
            return view

        for group in groups:
            rows = [m.out_features for m in group]
            w = block((sum(rows), group[0].in_features))
            dsts += w.split(rows)
            srcs += [m.weight for m in group]
            b = None
            if group[0].bias is not None:
                b = block((sum(rows),))
                dsts += b.split(rows)
                srcs += [m.bias for m in group]
            self.blocks[tuple(group)] = (w, b)
        with torch.no_grad():
            torch._foreach_copy_(dsts, srcs)


@contextlib.contextmanager
def current(casts: LayerCasts | None):
    """Make ``casts`` the one ``lookup`` reads from inside the block."""
    token = _CURRENT.set(casts)
    try:
        yield
    finally:
        _CURRENT.reset(token)


def lookup(linears: list[nn.Module], dtype: torch.dtype) -> tuple[Tensor, Tensor | None] | None:
    """(weight block, bias block or None) of exactly these linears cast to ``dtype``, if current."""
    casts = _CURRENT.get()
    if casts is None or casts.dtype != dtype:
        return None
    return casts.blocks.get(tuple(linears))
