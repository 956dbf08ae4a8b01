"""Quantised base layers (bitsandbytes) under PEFT LoRA adapters, for the fused LoRA node (modules/adapters/lora.py).

A QLoRA projection is y = x·Ŵᵀ (+ b) + Σ s·(x·Aᵀ)·Bᵀ where Ŵ is the frozen base weight as bitsandbytes
dequantises it. The node dequantises each base into a transient Ŵ right before its GEMM (the bases of
q/k/v or gate/up concatenated, so the joint GEMM stays one), and again in the backward for dx = dy·Ŵ:
no dequantised weight outlives its GEMM, nothing is saved for the base (it gets no gradient), and
between steps only the quantised bytes exist. Peak extra memory: one joint Ŵ in the compute dtype
(gate/up of llama8b in bf16: 2 × 14336 × 4096 × 2 B = 235 MB, freed after the GEMM).

Recognised by what the layer holds, not by its class name or the model:
- 4-bit: a weight with a ``quant_state`` (bitsandbytes' ``Params4bit``) of type nf4 / fp4, double
  quantisation (``nested``) or not. The layer's forward computes, as this does bit for bit:
  ``linear(x.to(cd), Ŵ_cd, b.to(cd)).to(x.dtype)`` with cd its ``compute_dtype`` and Ŵ_cd the fp32
  product code·absmax rounded once to cd (ops/dequant_4bit.py: reference and Triton kernels).
- 8-bit: an int8 weight with row scales ``SCB`` (``Int8Params``) on a layer whose ``state`` says the
  weights are frozen int8 (``has_fp16_weights=False``). Ŵ = CB.to(x.dtype)·(SCB/127), in x's dtype:
  what bitsandbytes' training matmul computes on the CPU and XPU (``MatMul8bitFp``). Elsewhere (CUDA,
  or out of training mode) its LLM.int8() matmul quantises the activations too, with fp16 outlier
  columns above ``threshold``: not reproduced, so such a call runs as PEFT's layer (counted).
Anything else bitsandbytes-like (not quantised yet, a CPU-packed 4-bit weight, trainable int8 weights)
is refused with the reason.
- torchao NF4: an ``nn.Linear`` whose weight is torchao's ``NF4Tensor`` (``to_nf4``): Ŵ dequantised in the weight's
  own dtype, then cast to x's, as torchao's ``F.linear`` computes (modules/adapters/torchao_nf4.py: the format).

Under autocast the base GEMM runs in autocast's dtype on those casts (as autocast runs bitsandbytes'
dequantise-then-``linear``), its output cast back to x's dtype, and the adapters' autocast products added
to it in x's dtype, as PEFT's bnb LoRA layers add them. bitsandbytes' 4-bit bases are dequantised into
the joint operand base by base, each straight into its rows; others are dequantised and copied into theirs.
With the switch ``qlora_dequant_gemm`` (off by default, not measured faster yet) the Triton backend runs the base
GEMMs as one kernel that dequantises Ŵ tile by tile (ops/dequant_matmul_4bit.py): no transient Ŵ at all.
"""
from __future__ import annotations

import sys

import torch
from torch import Tensor, nn
from torch.utils.weak import WeakIdKeyDictionary

from torchfuser.functional import backend_for
from torchfuser.modules import gemm as _gemm
from torchfuser.modules.adapters import torchao_nf4
from torchfuser.ops.dequant_4bit import dequantize_4bit, dequantize_4bit_into, dequantize_scales
from torchfuser.ops.dequant_matmul_4bit import dequant_matmul_4bit
from torchfuser.switches import SWITCHES

_FLOATS = (torch.float32, torch.bfloat16, torch.float16)


def peft_layer_types() -> tuple[type, ...]:
    """PEFT's LoRA layers over bitsandbytes bases (absent when peft never imported its bnb module)."""
    bnb = sys.modules.get("peft.tuners.lora.bnb")
    return tuple(t for n in ("Linear4bit", "Linear8bitLt") if (t := getattr(bnb, n, None)) is not None)


def _is_bnb(layer: nn.Module) -> bool:
    return type(layer).__module__.startswith("bitsandbytes") or type(getattr(layer, "weight", None)).__module__.startswith(
        "bitsandbytes")


def kind(layer: nn.Module) -> str | None:
    """'NF4', 'FP4' or 'int8' for a quantised base this module dequantises, else None."""
    w = getattr(layer, "weight", None)
    if torchao_nf4.is_nf4(w):
        return "NF4"
    qs = getattr(w, "quant_state", None)
    if qs is not None and getattr(qs, "quant_type", None) in ("nf4", "fp4"):
        return qs.quant_type.upper()
    if isinstance(w, Tensor) and w.dtype == torch.int8 and hasattr(w, "SCB") and hasattr(layer, "state"):
        return "int8"
    return None


def frozen_bytes(p: Tensor) -> bool:
    """Whether ``p`` is a frozen quantised bitsandbytes weight (Params4bit with its quant_state, Int8Params):
    fused blocks never hand it to a kernel; its layer runs it, or the LoRA node dequantises it. torchao's
    frozen NF4 weights too (modules/adapters/torchao_nf4.py)."""
    if torchao_nf4.frozen(p):
        return True
    if p.requires_grad or not _is_bnb_tensor(p):
        return False
    return getattr(p, "quant_state", None) is not None or (p.dtype == torch.int8 and hasattr(p, "SCB"))


def _is_bnb_tensor(p: Tensor) -> bool:
    return type(p).__module__.startswith("bitsandbytes")


def unsupported(layer: nn.Module) -> str | None:
    """Why the base ``layer`` is not a quantised base the node reproduces; None where it is, or where it
    is no bitsandbytes layer at all (the caller's own checks apply then)."""
    k = kind(layer)
    if k is None:
        if _is_bnb(layer):
            return (f"a bitsandbytes {type(layer).__name__} whose weight is not quantised (yet: bitsandbytes "
                    "quantises on .to(device)), or of a format the fused path does not dequantise")
        return None
    if not isinstance(layer, nn.Linear):
        return f"a quantised {type(layer).__name__}, not a linear projection"
    if torchao_nf4.is_nf4(layer.weight):
        return torchao_nf4.unsupported(layer)
    if k == "int8":
        if getattr(layer.state, "has_fp16_weights", True):
            return "an 8-bit bitsandbytes layer with trainable weights (has_fp16_weights=True)"
        scb = _int8_scales(layer)
        if scb is None or tuple(layer.weight.shape) != (layer.out_features, layer.in_features):
            return "an 8-bit bitsandbytes layer without its row scales (SCB)"
        return None
    qs = layer.weight.quant_state
    if getattr(qs, "packing_format_for_cpu", False):
        return ("a 4-bit weight repacked for bitsandbytes' CPU inference kernel (it repacks on an eval call "
                "without gradients); quantise it again or keep the model in training mode")
    if tuple(qs.shape) != (layer.out_features, layer.in_features):
        return f"a 4-bit weight quantised as {list(qs.shape)}, not [out_features, in_features]"
    if qs.nested and (qs.state2 is None or qs.offset is None):
        return "a double-quantised 4-bit weight without its second-level state"
    return None


def call_problem(layer: nn.Module, x: Tensor) -> str | None:
    """Why this call of the quantised base ``layer`` must run as bitsandbytes' own layer, or None."""
    if torchao_nf4.is_nf4(layer.weight):
        return torchao_nf4.call_problem(layer, x, torch.is_autocast_enabled(x.device.type))
    if kind(layer) == "int8":
        if not layer.training or x.device.type not in ("cpu", "xpu"):
            return ("an 8-bit base on {} {}: bitsandbytes' LLM.int8() matmul quantises the activations too "
                    "(outliers above threshold={} in fp16), which dequantise-then-GEMM does not reproduce").format(
                        x.device.type, "in training" if layer.training else "in eval mode", layer.state.threshold)
        if x.dtype not in _FLOATS:
            return f"an 8-bit base with {x.dtype} input"
        return None
    cd = compute_dtype(layer, x)
    if cd not in _FLOATS:
        return f"a 4-bit base computing in {cd}"
    return None


def compute_dtype(layer: nn.Module, x: Tensor) -> torch.dtype:
    """The dtype of the base's GEMM: a 4-bit layer's ``compute_dtype`` (x's where unset), x's for 8-bit."""
    if kind(layer) == "int8" or torchao_nf4.is_nf4(layer.weight):
        return x.dtype
    return getattr(layer, "compute_dtype", None) or x.dtype


def packed(layer: nn.Module) -> Tensor:
    """The quantised bytes as a plain tensor (bitsandbytes' parameter classes and torchao's NF4Tensor are tensor
    subclasses)."""
    if torchao_nf4.is_nf4(layer.weight):
        return layer.weight.quantized_data
    return layer.weight.data


def _int8_scales(layer: nn.Module) -> Tensor | None:
    """The int8 rows' scales: bitsandbytes moves them from the weight to ``layer.state`` on the first call."""
    scb = getattr(layer.state, "SCB", None)
    return scb if scb is not None else getattr(layer.weight, "SCB", None)


def _absmax(qs, backend: str | None = None) -> Tensor:
    """The fp32 block scales; double quantisation's are 8-bit blockwise codes plus an offset (one launch)."""
    if not qs.nested:
        return qs.absmax.float()
    s2 = qs.state2
    return dequantize_scales(qs.absmax, s2.absmax, s2.code, s2.blocksize, qs.offset,
                             backend_for(backend, qs.absmax.device))


def dequantize(layer: nn.Module, dtype: torch.dtype, backend: str | None = None) -> Tensor:
    """Ŵ [out_features × in_features] in ``dtype``, bitsandbytes' dequantisation bit for bit (a new tensor)."""
    w = layer.weight
    if torchao_nf4.is_nf4(w):  # in the weight's own dtype, then cast, as torchao's F.linear does
        rows, cols = w.shape
        out = dequantize_4bit(*torchao_nf4.operands(w), rows, cols, w.dtype, backend_for(backend, w.device))
        return out if out.dtype == dtype else out.to(dtype)
    if kind(layer) == "int8":  # bitsandbytes' MatMul8bitFp: the int8 rows cast, times SCB/127 (fp32), in place
        return w.data.to(dtype).mul_(_int8_scales(layer).unsqueeze(1).mul(1.0 / 127.0))
    qs = w.quant_state
    rows, cols = qs.shape
    return dequantize_4bit(w.data, _absmax(qs, backend), qs.code, qs.blocksize, rows, cols, dtype,
                           backend_for(backend, w.device))


_CODES = WeakIdKeyDictionary()


def _code_values(code: Tensor) -> tuple:
    """A 4-bit code table's 16 values, read once per table: comparing tables on the device a call would make the
    host wait for the GPU (and fail under CUDA graph capture); the tables are constants."""
    found = _CODES.get(code)
    if found is None:
        found = _CODES[code] = tuple(code.float().tolist())
    return found


def _one_launch(layers) -> bool:
    """Whether the 4-bit bases' bytes and scales, concatenated, are the joint weight's: one format and block
    size, whole blocks per base (so no block straddles two), one input width, one code table."""
    states = [getattr(m.weight, "quant_state", None) for m in layers]
    if any(qs is None for qs in states):
        return False
    first = states[0]
    return all(qs.quant_type == first.quant_type and qs.blocksize == first.blocksize and qs.shape[1] == first.shape[1]
               and (qs.shape[0] * qs.shape[1]) % qs.blocksize == 0
               and (qs.code is first.code or _code_values(qs.code) == _code_values(first.code)) for qs in states)


def joint_weight(layers, dtype: torch.dtype, backend: str | None = None) -> Tensor:
    """The bases dequantised and concatenated (rows in the layers' order): one transient operand, each bitsandbytes
    4-bit base dequantised straight into its rows (no copy of its bytes or of a dequantised weight), others
    dequantised and copied in."""
    if len(layers) == 1:
        return dequantize(layers[0], dtype, backend)
    out = torch.empty((sum(m.out_features for m in layers), layers[0].in_features), dtype=dtype,
                      device=layers[0].weight.device)
    for rows, m in zip(out.split([m.out_features for m in layers]), layers):
        qs = getattr(m.weight, "quant_state", None)
        if kind(m) in ("NF4", "FP4") and qs is not None:
            dequantize_4bit_into(m.weight.data, _absmax(qs, backend), qs.code, qs.blocksize, rows,
                                 backend_for(backend, out.device))
        else:
            rows.copy_(dequantize(m, dtype, backend))
    return out


def linear(x: Tensor, quant: tuple, biases) -> Tensor:
    """The bases' joint x·Ŵᵀ + b as bitsandbytes' layers compute each: x and b cast to the compute dtype, then
    (under autocast) to autocast's, Ŵ dequantised in the compute dtype (then cast likewise). Ŵ is freed here."""
    layers, cd, gemm, backend = quant
    b = None if not biases else torch.cat([t.to(cd) for t in biases]).to(gemm)
    if (fused := _fused_gemm(layers, cd, gemm, backend, x.device)) is not None:  # no Ŵ at all (switch, off by default)
        y = dequant_matmul_4bit(x.to(cd).to(gemm), *fused, gemm, True, "triton")
        return y if b is None else y.add_(b)
    w = joint_weight(layers, cd, backend).to(gemm)
    return nn.functional.linear(x.to(cd).to(gemm), w, b)


def grad_input(dy: Tensor, quant: tuple, dtype: torch.dtype) -> Tensor:
    """dy·Ŵ (the bases' share of dx) in ``dtype``, Ŵ dequantised again for it (never kept from the forward)."""
    layers, cd, gemm, backend = quant
    if (fused := _fused_gemm(layers, cd, gemm, backend, dy.device)) is not None:
        return dequant_matmul_4bit(dy.to(gemm), *fused, gemm, False, "triton").to(dtype)
    return _gemm.mm(dy.to(gemm), joint_weight(layers, cd, backend).to(gemm), dtype)


def _fused_gemm(layers, cd: torch.dtype, gemm: torch.dtype, backend: str | None, device: torch.device):
    """The operands (packed, absmax, code, blocksize, rows, cols) of the GEMM that dequantises the bases tile by
    tile (ops/dequant_matmul_4bit.py), where the switch ``qlora_dequant_gemm`` is on, the backend is Triton and it
    computes what dequantise-then-GEMM does: 4-bit bases whose bytes are one operand (one base, or bitsandbytes
    bases that ``_one_launch`` takes), even columns, and Ŵ rounded to the GEMM's dtype straight from the fp32
    product (dequantised in the GEMM's dtype, or in fp32 and then cast: the same two roundings). Else None."""
    if not SWITCHES.qlora_dequant_gemm or backend_for(backend, device) != "triton" or gemm not in _FLOATS:
        return None
    w = layers[0].weight
    if len(layers) == 1 and torchao_nf4.is_nf4(w):
        (packed, absmax, code, bs), (rows, cols), wd = torchao_nf4.operands(w), w.shape, w.dtype
    elif kind(layers[0]) in ("NF4", "FP4") and (len(layers) == 1 or _one_launch(layers)):
        qs, wd = w.quant_state, cd
        code, bs, cols = qs.code, qs.blocksize, qs.shape[1]
        packed = torch.cat([m.weight.data.reshape(-1).view(torch.uint8) for m in layers]) if len(layers) > 1 else w.data
        absmax = (torch.cat([_absmax(m.weight.quant_state, backend) for m in layers]) if len(layers) > 1
                  else _absmax(qs, backend))
        rows = sum(m.weight.quant_state.shape[0] for m in layers)
    else:
        return None
    if wd not in (gemm, torch.float32) or cols % 2 or bs % 2 or rows * cols >= 2 ** 31:
        return None
    return packed, absmax, code, bs, rows, cols


def describe(layers) -> str | None:
    """'NF4' (or 'FP4/int8' when mixed) for the quantised bases among ``layers``, None without any."""
    kinds = sorted({k for m in layers if (k := kind(m))})
    return "/".join(kinds) or None
