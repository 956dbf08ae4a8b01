"""The MLIR backend (CPU): reference fn → FX (make_fx / vjp) → torch-mlir → linalg →
TorchFuser's passes → LLVM, JIT-run on the caller's tensors. See ``pipeline.py``.

Importing this package is cheap: torch-mlir is imported on the first compile.
"""
from __future__ import annotations

from .activation import activation_bwd, activation_fwd
from .ops import (
    add_layer_norm_fwd, add_rms_norm_bwd, add_rms_norm_fwd, geglu_bwd, geglu_erf_bwd, geglu_erf_fwd, geglu_erf_packed_bwd,
    geglu_erf_packed_fwd, geglu_fwd, geglu_packed_bwd, geglu_packed_fwd, gelu_bwd, gelu_fwd, layer_norm_bwd, layer_norm_fwd,
    layer_norm_res_bwd, rms_norm_bwd, rms_norm_fwd, rope_bwd, rope_fwd, swiglu_bwd, swiglu_fwd,
    swiglu_packed_bwd, swiglu_packed_fwd,
)
from .rms_norm_add import rms_norm_add_bwd, rms_norm_add_fwd

__all__ = [
    "activation_fwd", "activation_bwd",
    "rms_norm_fwd", "rms_norm_bwd", "add_rms_norm_fwd", "add_rms_norm_bwd", "layer_norm_fwd", "layer_norm_bwd",
    "add_layer_norm_fwd", "layer_norm_res_bwd",
    "swiglu_fwd", "swiglu_bwd", "geglu_fwd", "geglu_bwd", "gelu_fwd", "gelu_bwd",
    "swiglu_packed_fwd", "swiglu_packed_bwd", "geglu_packed_fwd", "geglu_packed_bwd",
    "geglu_erf_fwd", "geglu_erf_bwd", "geglu_erf_packed_fwd", "geglu_erf_packed_bwd",
    "rope_fwd", "rope_bwd", "linear_cross_entropy_fwd", "compile_graph", "rms_norm_add_fwd", "rms_norm_add_bwd",
]


def __getattr__(name):
    if name == "linear_cross_entropy_fwd":
        from .lce import linear_cross_entropy_fwd

        return linear_cross_entropy_fwd
    if name == "compile_graph":
        from .graph import compile_graph

        return compile_graph
    raise AttributeError(name)
