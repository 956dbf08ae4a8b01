"""FP8 (e4m3) quantisation with current scaling in plain PyTorch: the oracle of the Triton kernels
(backends/triton/fp8_quant.py, which give these bits exactly) and the path on the CPU.

For s = tᵀ if ``transpose`` else t, in fp32: amax over each row of s (or all of s, ``tensorwise``),
scale = max(amax, 1e-12) / 448, q = e4m3(clamp(s / scale, −448, 448)); q row-major.
"""
from __future__ import annotations

import torch

E4M3 = torch.float8_e4m3fn
MAX = 448.0  # torch.finfo(torch.float8_e4m3fn).max
TINY = 1e-12


def fp8_quantize(t: torch.Tensor, tensorwise: bool, transpose: bool) -> tuple[torch.Tensor, torch.Tensor]:
    s = t.t().contiguous() if transpose else t
    t32 = s.float()
    amax = t32.abs().amax() if tensorwise else t32.abs().amax(dim=-1, keepdim=True)
    scale = amax.clamp_min(TINY) / MAX
    return (t32 / scale).clamp_(-MAX, MAX).to(E4M3).contiguous(), scale
