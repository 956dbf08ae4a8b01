"""Rotary tables given as complex numbers, as the kernels' (cos, sin) tables.

A model that rotates with complex arithmetic (Llama 4's vision attention) views each head's channels
as pairs (x_2i, x_2i+1) = x_2i + i·x_2i+1 and multiplies by a table f_i = c_i + i·s_i:

    out_2i   = x_2i·c_i − x_2i+1·s_i
    out_2i+1 = x_2i·s_i + x_2i+1·c_i

which is rotate-every-two rope (``AttentionSpec.rotary_interleave="half"`` with one table entry per
pair) with cos = Re f, sin = Im f. The identity holds for any c and s, not only unit ones, so the
tables are used as they are. The model computes in fp32 (complex64) and rounds once; the rope
kernels compute in fp32 too, from fp32 tables, so nothing is rounded in between.
"""
from __future__ import annotations

import torch
from torch import Tensor


def tables(freqs: Tensor, seq: int) -> tuple[Tensor, Tensor]:
    """(cos, sin), each (1 or B) × S × D/2, from a complex table of S·D/2 (or B·S·D/2) entries in
    any shape whose last dim is D/2 (Llama 4 passes S × 1 × D/2, broadcast over batch and heads);
    any other count fails in ``functional.rope`` with its shapes named."""
    ri = torch.view_as_real(freqs.detach()).reshape(-1, seq, freqs.shape[-1], 2)
    return ri[..., 0], ri[..., 1]


def unusable(freqs, spec) -> str | None:
    """Why a call's complex table cannot be applied as the fused attention would, else None."""
    name, pairs = spec.rotary_complex, spec.rotary_dim // 2
    if not isinstance(freqs, Tensor) or not freqs.is_complex():
        return f"{name} is not a complex tensor (the fused attention applies complex rotary tables as cos and sin)"
    if freqs.shape[-1] != pairs:
        return f"{name} has {freqs.shape[-1]} entries per position, not the {pairs} found when it was fused"
    if freqs.requires_grad and torch.is_grad_enabled():
        return f"{name} requires grad (the fused rope treats its tables as constants)"
    return None
