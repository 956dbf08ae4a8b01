"""One ``torch.library`` custom op per kernel (``torchfuser::<op>_fwd`` / ``_bwd``).

Each op has a fake implementation (for torch.compile and the meta device) and registered
autograd, and dispatches to the backend named in its last argument. Every backend returns
contiguous outputs with exactly the shapes and dtypes the fake implementations give.
"""
from .activation import activation
from .add_layer_norm import add_layer_norm, layer_norm_opening_residual
from .gated import gelu, geglu, geglu_erf, geglu_erf_packed, geglu_packed, swiglu, swiglu_packed
from .layer_norm import layer_norm
from .linear_cross_entropy import linear_cross_entropy
from .moe import moe_experts, moe_route
from .rms_norm import add_rms_norm, rms_norm, rms_norm_opening_residual
from .rms_norm_add import rms_norm_add
from .rope import rope

__all__ = [
    "activation",
    "add_layer_norm", "layer_norm_opening_residual",
    "rms_norm", "add_rms_norm", "rms_norm_opening_residual", "rms_norm_add", "layer_norm", "swiglu", "geglu", "swiglu_packed",
    "geglu_packed", "geglu_erf", "geglu_erf_packed", "gelu", "rope", "linear_cross_entropy", "moe_route", "moe_experts",
]
