"""Fused modules: drop-in replacements that hold the original parameters and call ``functional``."""
from torchfuser.modules.attention import AttentionSpec, FusedAttention
from torchfuser.modules.base import FusedModule
from torchfuser.modules.lm_head import FusedLMHeadLoss, LMHeadLossSpec
from torchfuser.modules.mlp import FusedGatedMLP, FusedMLP, GatedMLPSpec, MLPSpec
from torchfuser.modules.norms import FusedLayerNorm, FusedRMSNorm, LayerNormSpec, RMSNormSpec

__all__ = [
    "FusedModule", "FusedRMSNorm", "FusedLayerNorm", "FusedGatedMLP", "FusedMLP",
    "RMSNormSpec", "LayerNormSpec", "GatedMLPSpec", "MLPSpec", "FusedAttention", "AttentionSpec",
    "FusedLMHeadLoss", "LMHeadLossSpec",
]
