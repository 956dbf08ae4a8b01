"""Blockwise FP8 (e4m3) quantisation in plain PyTorch, ``fp8="blockwise"`` (DeepSeek-V3's recipe): the
oracle of the Triton kernels (backends/triton/fp8_blocks.py, which give these bits exactly) and the
path on the CPU. Every scale covers one block of 128 elements along a GEMM's inner dimension, so it is
local to a tile: an operand is quantised both ways from one read, with no pass over all of it first.

Per block b, in fp32: scale = max(amax_b |t|, 1e-12) / 448, q = e4m3(clamp(t · 448 / max(amax_b, 1e-12),
−448, 448)) (fp8_quant.py's formula: two true divisions a block, a multiply an element, round to nearest
even; NaN propagates through amax).

``fp8_quantize_blocks(t, rows, cols)``, an activation t (M × K, both multiples of 128):
    rows: q  = t  in e4m3 (M × K), s  (M × K/128): a scale per row and 128 columns   (x for y = x·Wᵀ)
    cols: qt = tᵀ in e4m3 (K × M), st (K × M/128): a scale per column and 128 rows   (x, dy for dW)
    The scales are column-major (strides (1, M) and (1, K)), the layout ``scaled_mm`` takes for 1 × 128
    blocks. What is not asked for comes back empty.
``fp8_quantize_weight_blocks(w)``, a weight (N × K, both multiples of 128): one scale per 128 × 128 block,
    q = w and qt = wᵀ in e4m3 (the same values), with the block scales in the two layouts ``scaled_mm``
    takes for a 128 × 128-scaled second operand: s_fwd (round_up(K/128, 4) × N/128, strides
    (1, round_up(K/128, 4))) for y = x·Wᵀ, s_bwd (round_up(N/128, 4) × K/128) for dx = dy·W; rows past
    the blocks (the round-up) hold 1.
"""
from __future__ import annotations

import torch

from .fp8_quant import E4M3, cast, scales

BLOCK = 128


def _check(t: torch.Tensor, what: str) -> tuple[int, int]:
    if t.dim() != 2 or t.shape[0] % BLOCK or t.shape[1] % BLOCK:
        raise ValueError(f"{what}: blockwise FP8 takes 2-D tensors whose sides are multiples of {BLOCK}, "
                         f"got shape {tuple(t.shape)}")
    return t.shape


def _column_major(rows: int, cols: int, device) -> torch.Tensor:
    return torch.empty(cols, rows, dtype=torch.float32, device=device).t()


def fp8_quantize_blocks(t: torch.Tensor, rows: bool, cols: bool) -> tuple[torch.Tensor, ...]:
    """(q, s, qt, st) of an activation (module docstring); the ones not asked for are empty."""
    m, k = _check(t, "fp8_quantize_blocks")
    t32 = t.float()
    empty = t.new_empty(0, dtype=E4M3), t.new_empty(0, dtype=torch.float32)
    q, s = empty
    if rows:
        blocks = t32.view(m, k // BLOCK, BLOCK)
        scale, inv = scales(blocks.abs().amax(-1, keepdim=True))
        q = cast(blocks, inv).view(m, k).contiguous()  # row-major whatever t's strides
        s = _column_major(m, k // BLOCK, t.device).copy_(scale.squeeze(-1))
    qt, st = (x.clone() for x in empty)
    if cols:
        blocks = t32.view(m // BLOCK, BLOCK, k)
        scale, inv = scales(blocks.abs().amax(1, keepdim=True))  # (M/128, 1, K)
        qt = cast(blocks, inv).view(m, k).t().contiguous()
        st = _column_major(k, m // BLOCK, t.device).copy_(scale.squeeze(1).t())
    return q, s, qt, st


def _padded(scale: torch.Tensor) -> torch.Tensor:
    """``scale`` (R × C, R = output blocks, C = inner blocks) as scaled_mm's 128 × 128 layout for a second
    operand: (round_up(C, 4) × R), strides (1, round_up(C, 4)), the round-up rows 1."""
    r, c = scale.shape
    buf = torch.ones(r, -(-c // 4) * 4, dtype=torch.float32, device=scale.device)
    buf[:, :c] = scale
    return buf.t()


def fp8_quantize_weight_blocks(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """(q, s_fwd, qt, s_bwd) of a weight (module docstring)."""
    n, k = _check(w, "fp8_quantize_weight_blocks")
    blocks = w.float().view(n // BLOCK, BLOCK, k // BLOCK, BLOCK)
    scale, inv = scales(blocks.abs().amax(dim=(1, 3), keepdim=True))  # (N/128, 1, K/128, 1)
    q = cast(blocks, inv).view(n, k).contiguous()
    scale = scale.view(n // BLOCK, k // BLOCK)
    return q, _padded(scale), q.t().contiguous(), _padded(scale.t())


def dequantize_blocks(q: torch.Tensor, s: torch.Tensor, weight: bool) -> torch.Tensor:
    """q (R × C, e4m3) back in fp32, from its 1 × 128 scales (R × C/128) or, ``weight``, its 128 × 128
    ones in the second-operand layout (round_up(C/128, 4) × R/128): the CPU's emulation of scaled_mm."""
    r, c = q.shape
    if weight:
        scale = s[: c // BLOCK].t()  # (R/128, C/128)
        return (q.float().view(r // BLOCK, BLOCK, c // BLOCK, BLOCK) * scale[:, None, :, None]).view(r, c)
    return (q.float().view(r, c // BLOCK, BLOCK) * s[..., None]).view(r, c)
