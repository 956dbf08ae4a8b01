"""An fp32 tensor as two bf16 parts, hi = bf16(t·s) and lo = bf16(t·s − hi), concatenated along ``dim`` in the
order ``parts`` names them: the fused LoRA node's operand split (modules/adapters/lora_node.py; the formula
and the Triton twin: backends/triton/hilo_split.py). Each part written in place into the result (no
temporaries). t − hi is exact in fp32 (hi is t rounded), so |t − hi − lo| ≤ 2⁻¹⁶·|t|; bf16 has fp32's
exponent range, so neither part overflows or underflows where t does not."""
from __future__ import annotations

import torch
from torch import Tensor


def hilo_split(t: Tensor, parts: str, dim: int, dtype: torch.dtype, scale: float = 1.0) -> Tensor:
    if scale != 1:
        t = t * scale
    shape = list(t.shape)
    shape[dim] *= len(parts)
    out = t.new_empty(shape, dtype=dtype)
    chunks = out.chunk(len(parts), dim)
    hi = chunks[parts.index("h")]
    hi.copy_(t)
    torch.sub(t, hi, out=chunks[parts.index("l")])  # in fp32, rounded once to bf16 on the write
    for p, c in zip(parts, chunks):
        if p == "h" and c is not hi:
            c.copy_(hi)
    return out
