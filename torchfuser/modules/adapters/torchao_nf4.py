"""torchao's NF4 bases (``torchao.quantization.to_nf4``, the ``NF4Tensor`` subclass torchtune's QLoRA uses) under
PEFT LoRA adapters: recognised, checked and dequantised for the fused LoRA node (modules/adapters/quantized_base.py).

PEFT wraps an ``nn.Linear`` whose weight is an NF4Tensor as its plain ``lora.Linear``; the base's forward is
torchao's ``F.linear`` override: ``linear(x, Ŵ.to(x.dtype)) (+ b)`` with, in the weight's own dtype ``wd``
(the dtype it was quantised from),

    s[j] = wd(wd(q2[j] / f[j // scaler_block_size]) + mean)      (the double-quantised block scales)
    Ŵ[e] = wd(nf4[nibble(P, e)] · s[e // block_size])            (nf4: the 16 code values, stored in wd)

with P two codes a byte over the row-major flattened weight, the first in the high nibble (bitsandbytes'
order; its block sizes and second-level scales differ: an int8 q2 over a per-block factor f and one mean,
where bitsandbytes has 8-bit codes with fp32 scales). In the backward torchao computes dy·Ŵ.to(dy.dtype).
The scales (one per block) are computed here with PyTorch's own ops in wd, as torchao computes them; the
elements run through ``torchfuser::dequantize_4bit``, which takes code · scale in fp32 and rounds once to wd:
the product of two values of wd ∈ {fp32, bf16, fp16} is exact in fp32, so that is torchao's product bit
for bit. Only duck-typed attributes are read (no torchao import): the fields ``to_nf4`` has carried from
torchao 0.3 to 0.18 (it moved from ``torchao.dtypes`` to ``torchao.quantization``).
"""
from __future__ import annotations

import torch
from torch import Tensor, nn

_FIELDS = ("quantized_data", "quantized_scalers", "quantization_factor", "scaler_mean", "nf4", "block_size",
           "scaler_block_size")
_FLOATS = (torch.float32, torch.bfloat16, torch.float16)


def is_nf4(w) -> bool:
    """Whether ``w`` is a torchao NF4Tensor (by its fields: a tensor subclass holding the packed codes)."""
    return isinstance(w, Tensor) and type(w) is not torch.Tensor and all(hasattr(w, f) for f in _FIELDS)


def frozen(w) -> bool:
    return is_nf4(w) and not w.requires_grad


def unsupported(layer: nn.Module) -> str | None:
    """Why the torchao NF4 base ``layer`` is not one the fused node dequantises exactly, or None."""
    w = layer.weight
    if w.requires_grad:
        return "a torchao NF4 weight that requires grad"
    if w.dim() != 2 or tuple(w.shape) != (layer.out_features, layer.in_features):
        return f"a torchao NF4 weight of shape {list(w.shape)}, not [out_features, in_features]"
    if w.dtype not in _FLOATS:
        return f"a torchao NF4 weight of dtype {w.dtype}"
    n, bs, sbs = w.numel(), w.block_size, w.scaler_block_size
    data, q2, f = w.quantized_data, w.quantized_scalers, w.quantization_factor
    if (data.dtype != torch.uint8 or data.numel() * 2 != n or bs % 2 or n % bs or q2.numel() != n // bs
            or q2.dtype != torch.int8 or q2.numel() % sbs or f.numel() != q2.numel() // sbs
            or w.nf4.numel() != 16 or w.scaler_mean.numel() != 1):
        return (f"a torchao NF4 weight whose layout is not to_nf4's (block_size={bs}, scaler_block_size={sbs}, "
                f"{data.numel()} bytes for {n} elements)")
    if layer.bias is not None and layer.bias.dtype not in _FLOATS:
        return f"a torchao NF4 base with a {layer.bias.dtype} bias"
    return None


def call_problem(layer: nn.Module, x: Tensor, autocast: bool) -> str | None:
    """Why this call must run as torchao's own ``F.linear``, or None."""
    if autocast:  # torchao's result dtype there depends on the bias (bf16 GEMM, + fp32 bias promotes): not reproduced
        return "a torchao NF4 base under autocast"
    if x.dtype not in _FLOATS:
        return f"a torchao NF4 base with {x.dtype} input"
    if layer.bias is not None and layer.bias.dtype != x.dtype:
        return "a torchao NF4 base whose bias dtype is not its input's"
    return None


def scales(w) -> Tensor:
    """The per-block scales s in the weight's dtype, torchao's double quantisation undone with PyTorch's ops."""
    q2 = w.quantized_scalers.reshape(-1, w.scaler_block_size)
    return (q2 / w.quantization_factor.reshape(-1, 1)).reshape(-1).to(w.dtype) + w.scaler_mean


def operands(w) -> tuple[Tensor, Tensor, Tensor, int]:
    """(packed bytes, fp32 scales, fp32 code table, block size): the dequantisation op's operands."""
    return w.quantized_data, scales(w).float(), w.nf4.float(), w.block_size
