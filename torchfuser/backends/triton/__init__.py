"""The Triton backend (CUDA/ROCm; the CPU under TRITON_INTERPRET=1): one kernel file per op.

Every function here has the signature and return values of its twin in ``backends/reference``
and returns contiguous outputs in the input dtype (statistics in fp32). Only this package
imports triton.
"""
from .activation import activation_bwd, activation_fwd
from . import _interpret

_interpret.apply()

from .dequant_4bit import dequantize_4bit_fwd, dequantize_4bit_into, dequantize_scales_fwd
from .dequant_matmul_4bit import dequant_matmul_4bit_bwd, dequant_matmul_4bit_fwd
from .fp8_blocks import fp8_quantize_blocks, fp8_quantize_weight_blocks
from .fp8_quant import fp8_quantize, fp8_quantize_both, fp8_quantize_both_amax
from .gated import (
    gelu_bwd, gelu_fwd, geglu_bwd, geglu_erf_bwd, geglu_erf_fwd, geglu_erf_packed_bwd, geglu_erf_packed_fwd, geglu_fwd, geglu_packed_bwd, geglu_packed_fwd, swiglu_bwd, swiglu_fwd,
    swiglu_packed_bwd, swiglu_packed_fwd,
)
from .hilo_split import hilo_split
from .gated_fp8 import geglu_packed_fp8_bwd, geglu_packed_fp8_fwd, swiglu_packed_fp8_bwd, swiglu_packed_fp8_fwd
from .layer_norm import add_layer_norm_fwd, layer_norm_bwd, layer_norm_fwd, layer_norm_res_bwd
from .linear_cross_entropy import linear_cross_entropy_fwd, linear_cross_entropy_scale_
from .moe import moe_experts_bwd, moe_experts_fwd, moe_route_bwd, moe_route_fwd
from .norm_fp8 import add_rms_norm_fp8_bwd, add_rms_norm_fp8_fwd, rms_norm_fp8_bwd, rms_norm_fp8_fwd
from .rms_norm import add_rms_norm_bwd, add_rms_norm_fwd, rms_norm_bwd, rms_norm_fwd
from .rms_norm_add import rms_norm_add_bwd, rms_norm_add_fwd
from .rope import rope_bwd, rope_fwd

__all__ = [
    "activation_fwd", "activation_bwd",
    "rms_norm_fwd", "rms_norm_bwd", "add_rms_norm_fwd", "add_rms_norm_bwd", "layer_norm_fwd", "layer_norm_bwd",
    "add_layer_norm_fwd", "layer_norm_res_bwd",
    "swiglu_fwd", "swiglu_bwd", "geglu_fwd", "geglu_bwd", "gelu_fwd", "gelu_bwd",
    "swiglu_packed_fwd", "swiglu_packed_bwd", "geglu_packed_fwd", "geglu_packed_bwd",
    "geglu_erf_fwd", "geglu_erf_bwd", "geglu_erf_packed_fwd", "geglu_erf_packed_bwd",
    "rms_norm_add_fwd", "rms_norm_add_bwd",
    "rope_fwd", "rope_bwd", "linear_cross_entropy_fwd", "linear_cross_entropy_scale_", "fp8_quantize",
    "fp8_quantize_both", "fp8_quantize_both_amax", "fp8_quantize_blocks", "fp8_quantize_weight_blocks",
    "swiglu_packed_fp8_fwd", "swiglu_packed_fp8_bwd", "geglu_packed_fp8_fwd", "geglu_packed_fp8_bwd",
    "rms_norm_fp8_fwd", "rms_norm_fp8_bwd", "add_rms_norm_fp8_fwd", "add_rms_norm_fp8_bwd",
    "moe_route_fwd", "moe_route_bwd", "moe_experts_fwd", "moe_experts_bwd",
    "dequantize_4bit_fwd", "dequantize_4bit_into", "dequantize_scales_fwd", "dequant_matmul_4bit_fwd", "dequant_matmul_4bit_bwd", "hilo_split",
]
