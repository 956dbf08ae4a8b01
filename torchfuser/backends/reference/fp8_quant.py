"""FP8 (e4m3) quantisation with current scaling in plain PyTorch: the oracle of the Triton kernels
(backends/triton/fp8_quant.py, which give these bits exactly) and the path on the CPU.

For s = tᵀ if ``transpose`` else t, in fp32: amax over each row of s (or all of s, ``tensorwise``),
scale = max(amax, 1e-12) / 448 (the GEMM's dequantisation scale), inv = 448 / max(amax, 1e-12) (both true
divisions, one a row), q = e4m3(clamp(s · inv, −448, 448)); q row-major. A multiply an element, not a
division: the Triton writer ran faster so (NOTES-triton.md), and the bits differ from s / scale's in about
one value in 4000 (a rounding tie of e4m3 moved by an fp32 ulp).
``fp8_quantize_both``: both orientations of t at once (the two calls, composed). ``fp8_amax_both``: the
maxima those take, as int32 bit patterns (what a producer kernel hands on), and ``fp8_quantize_both_amax``
the quantisations from them.
"""
from __future__ import annotations

import torch

E4M3 = torch.float8_e4m3fn
MAX = 448.0  # torch.finfo(torch.float8_e4m3fn).max
TINY = 1e-12


def scales(amax: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(max(amax, 1e-12) / 448, 448 / max(amax, 1e-12)): the dequantisation scale and the quantisation's
    multiplier, each a true division (``448 / a`` in PyTorch would be a reciprocal times 448: two roundings)."""
    a = amax.clamp_min(TINY)
    return a / MAX, torch.full_like(a, MAX) / a


def cast(t32: torch.Tensor, inv: torch.Tensor) -> torch.Tensor:
    """e4m3(clamp(t32 · inv, −448, 448))."""
    return (t32 * inv).clamp_(-MAX, MAX).to(E4M3)


def fp8_quantize(t: torch.Tensor, tensorwise: bool, transpose: bool) -> tuple[torch.Tensor, torch.Tensor]:
    s = t.t().contiguous() if transpose else t
    t32 = s.float()
    scale, inv = scales(t32.abs().amax() if tensorwise else t32.abs().amax(dim=-1, keepdim=True))
    return cast(t32, inv).contiguous(), scale


def fp8_quantize_both(t: torch.Tensor, tensorwise: bool) -> tuple[tuple[torch.Tensor, torch.Tensor], ...]:
    """(``fp8_quantize(t, tensorwise, False)``, ``fp8_quantize(t, tensorwise, True)``): t scaled per row
    and tᵀ per row (t's columns), or both by t's one scale; what the Triton pair gives from two reads."""
    return fp8_quantize(t, tensorwise, False), fp8_quantize(t, tensorwise, True)


def fp8_amax_both(t: torch.Tensor) -> torch.Tensor:
    """|t|'s maxima per row (M entries) then per column (K), in fp32, as int32 bit patterns (order-free
    to max into; the Triton producers' AMAX)."""
    a = t.float().abs()
    return torch.cat([a.amax(dim=1), a.amax(dim=0)]).view(torch.int32)


def fp8_quantize_both_amax(t: torch.Tensor, amax: torch.Tensor) -> tuple[tuple[torch.Tensor, torch.Tensor], ...]:
    """``fp8_quantize_both(t, False)`` from t's maxima ``fp8_amax_both(t)``: the same bits."""
    m = t.shape[0]
    scale, inv = scales(amax.view(torch.float32))
    t32 = t.float()
    q = cast(t32, inv[:m, None])
    qt = cast(t32.t(), inv[m:, None]).contiguous()
    return (q, scale[:m, None].contiguous()), (qt, scale[m:, None].contiguous())


def rounding_cases(width: int = 127) -> torch.Tensor:
    """Rows of ``width`` values for checking a quantiser's cast tie by tie (tests, probes): each row
    starts with 448, so its scale is exactly 1, then holds every finite e4m3 value and every rounding
    midpoint between two, on it and one fp32 ulp either side, subnormals included, both signs."""
    v = torch.arange(256, dtype=torch.int32).to(torch.uint8).view(E4M3).float()
    v = v[torch.isfinite(v)].unique()
    mids = (v[1:] + v[:-1]) / 2
    inf = torch.tensor(float("inf"))
    vals = torch.cat([mids, mids.nextafter(inf), mids.nextafter(-inf), v])
    vals = torch.cat([vals, -vals])
    rows = -(-vals.numel() // (width - 1))
    t = torch.zeros(rows * (width - 1))
    t[: vals.numel()] = vals
    return torch.cat([torch.full((rows, 1), 448.0), t.view(rows, width - 1)], dim=1)
