"""``torch._scaled_mm`` as the FP8 GEMMs of modules/fp8/__init__.py (the projections) and of the LM head's loss call
it: a·bᵀ (+ bias) from two quantised row-major operands, with each torch build's limits probed once
(fp32 outputs, a bias in the epilogue, per-row scales on the CPU) and the CPU's missing kernels emulated
in fp32, where e4m3 values are exact. Blockwise-scaled operands (``fp8="blockwise"``) go through
``torch.nn.functional.scaled_mm``: Hopper only, cuBLASLt ≥ 12.9."""
from __future__ import annotations

import torch
from torch import Tensor

from torchfuser.backends.reference.fp8_blocks import dequantize_blocks

E4M3 = torch.float8_e4m3fn

_WIDE_OUT: dict = {}  # (device type, scale shape) -> whether _scaled_mm writes fp32 there
_BIAS: dict = {}  # (device type, scale shape) -> whether _scaled_mm adds a bf16 bias in its epilogue


def mm(a: tuple[Tensor, Tensor], b: tuple[Tensor, Tensor], out_dtype: torch.dtype, bias: Tensor | None = None) -> Tensor:
    """a·bᵀ (+ bias) from two quantised row-major operands (M × K and N × K), scaled back, in ``out_dtype``
    (fp32 straight from the accumulator where this build's kernel writes it, else bf16 then cast; a
    bias in the epilogue of a bf16 output where the kernel takes one, else added after). Blockwise
    operands come as (q, scales, block): ``mm_blocks``."""
    if len(b) == 3:
        return mm_blocks(a, b, out_dtype, bias)
    (qa, sa), (qb, sb) = a, b
    sb = sb.t() if sb.dim() else sb
    if qa.device.type == "cpu" and (sa.numel() == 1 or not _cpu_rowwise()):
        # _scaled_mm's math in fp32 (e4m3 values are exact there): torch 2.11's CPU kernel takes per-tensor
        # scales only, and with per-tensor scales the CPU kernel is ~200x slower than this (0.25 s at
        # 128 × 128 × 384, torch 2.13)
        out = torch.mm(qa.float(), qb.float().t()).mul_(sa).mul_(sb)
        return (out if bias is None else out.add_(bias.to(out_dtype).float())).to(out_dtype)  # as its epilogue: the bias in out_dtype
    key = (qa.device.type, sa.dim())
    if out_dtype != torch.bfloat16 and _WIDE_OUT.get(key, True):
        try:
            out = torch._scaled_mm(qa, qb.t(), scale_a=sa, scale_b=sb, out_dtype=out_dtype)
            _WIDE_OUT[key] = True
            return out if bias is None else out + bias.to(out_dtype)
        except RuntimeError:  # some builds take bf16 outputs only with rowwise scales
            _WIDE_OUT[key] = False
    if bias is not None and _BIAS.get(key, True):
        try:
            out = torch._scaled_mm(qa, qb.t(), scale_a=sa, scale_b=sb, bias=bias.to(torch.bfloat16),
                                   out_dtype=torch.bfloat16)
            _BIAS[key] = True
            return out if out_dtype == torch.bfloat16 else out.to(out_dtype)
        except RuntimeError:  # no bias epilogue for these scales in this build
            _BIAS[key] = False
    out = torch._scaled_mm(qa, qb.t(), scale_a=sa, scale_b=sb, out_dtype=torch.bfloat16)
    if out_dtype != torch.bfloat16:
        out = out.to(out_dtype)
    return out if bias is None else out + bias.to(out_dtype)


_CPU_ROWWISE: dict = {}


def _cpu_rowwise() -> bool:
    """Whether this build's CPU ``_scaled_mm`` takes per-row scales (torch 2.13 does, 2.11 does not):
    probed once, outside any trace (under torch.compile before the probe, the emulation, right everywhere)."""
    if "ok" not in _CPU_ROWWISE:
        if torch.compiler.is_compiling():
            return False
        q = torch.zeros(16, 16).to(E4M3)
        try:
            torch._scaled_mm(q, q.t(), scale_a=torch.ones(16, 1), scale_b=torch.ones(1, 16), out_dtype=torch.bfloat16)
            _CPU_ROWWISE["ok"] = True
        except RuntimeError:
            _CPU_ROWWISE["ok"] = False
    return _CPU_ROWWISE["ok"]


_BLOCK_OUT: dict = {}  # out dtype -> whether scaled_mm writes it for blockwise scales


def mm_blocks(a: tuple, b: tuple, out_dtype: torch.dtype, bias: Tensor | None = None) -> Tensor:
    """a·bᵀ (+ bias) from blockwise-quantised operands (backends/reference/fp8_blocks.py): a is (q, s,
    "1x128"), M × K with a scale per row and 128 columns; b is N × K, (q, s, "1x128") likewise or
    (q, s, "128x128") with a scale per 128 × 128 block, s in scaled_mm's layouts. On the CPU, the
    operands dequantised and multiplied in fp32 (no blockwise kernel there)."""
    qa, sa, _ = a
    qb, sb, kind = b
    if qa.device.type == "cpu":
        out = torch.mm(dequantize_blocks(qa, sa, False), dequantize_blocks(qb, sb, kind == "128x128").t())
        return (out if bias is None else out.add_(bias.to(out_dtype).float())).to(out_dtype)
    from torch.nn.functional import ScalingType, scaled_mm

    recipe_b = ScalingType.BlockWise128x128 if kind == "128x128" else ScalingType.BlockWise1x128
    wide = out_dtype != torch.bfloat16 and _BLOCK_OUT.get(out_dtype, True)
    try:
        out = scaled_mm(qa, qb.t(), sa, ScalingType.BlockWise1x128, sb, recipe_b,
                        output_dtype=out_dtype if wide else torch.bfloat16)
        if wide:
            _BLOCK_OUT[out_dtype] = True
    except (RuntimeError, ValueError, NotImplementedError):
        if not wide:
            raise
        _BLOCK_OUT[out_dtype] = False  # this build writes bf16 only there: cast after
        out = scaled_mm(qa, qb.t(), sa, ScalingType.BlockWise1x128, sb, recipe_b, output_dtype=torch.bfloat16)
    out = out if out.dtype == out_dtype else out.to(out_dtype)
    return out if bias is None else out + bias.to(out_dtype)
