"""Mixture-of-experts: ``moe_route`` (router logits → top-k weights and indices) and ``moe_experts``
(the routed gated MLPs and the weighted combine). Formulas and layouts: backends/reference/moe.py.

moe_route_fwd(logits (T, E), correction (E,) | None, top_k, scoring, renorm, n_group, topk_group,
    group_top, scale) → weights (T, k) fp32, indices (T, k) int64; saved: logits, indices.
moe_experts_fwd(x (T, H), weights (T, k), indices (T, k), gate_up, gate_up_bias, down, down_bias,
    transposed, halves, act, alpha, limit, out_dtype) → y (T, H), h (S, 2I), order (S,) int64,
    offs (E,) int32 with S = T·k; saved: the inputs, h, order and offs.

Only backends in ``KERNELS`` have kernels of their own for these ops; any other backend asked for
(mlir on the CPU) runs the reference backend's. In both, the experts' products are PyTorch's grouped
GEMMs (cuBLAS / CUTLASS on CUDA). The triton backend (backends/triton/moe.py) runs the router's
scoring, top-k and weights as one kernel each way, and the passes around the GEMMs (bias adds,
activation and its vjp, weight scaling, the per-slot reductions, the weighted combine) as kernels; it
hands group-limited routing (n_group > 1), fp64 and more than its MAX_EXPERTS experts to the reference.
"""
from __future__ import annotations

from typing import Optional

import torch
from torch import Tensor

from torchfuser.backends.reference import grouped_mm as _gmm

from ._call import autograd, kernel, run

KERNELS = ("reference", "triton")


def backend_of(backend: str) -> str:
    """The backend that runs the MoE ops when ``backend`` is asked for."""
    return backend if backend in KERNELS else "reference"


def grouped_gemms(x: Tensor, *weights: Tensor) -> bool:
    """Whether the experts' products run as grouped GEMMs for operands like these (else a loop over
    the experts: fp64, an unsupported dtype or width; the fused module counts it)."""
    return _gmm.usable(x.dtype, x.device, x, *weights)


@torch.library.custom_op("torchfuser::moe_route_fwd", mutates_args=())
def moe_route_fwd(logits: Tensor, correction: Optional[Tensor], top_k: int, scoring: str, renorm: bool, n_group: int,
                  topk_group: int, group_top: int, scale: float, backend: str) -> tuple[Tensor, Tensor]:
    return kernel(backend, "moe_route_fwd")(logits, correction, top_k, scoring, renorm, n_group, topk_group,
                                            group_top, scale)


@moe_route_fwd.register_fake
def _(logits, correction, top_k, scoring, renorm, n_group, topk_group, group_top, scale, backend):
    shape = (*logits.shape[:-1], top_k)
    dtype = torch.float64 if logits.dtype == torch.float64 else torch.float32
    return logits.new_empty(shape, dtype=dtype), logits.new_empty(shape, dtype=torch.int64)


@torch.library.custom_op("torchfuser::moe_route_bwd", mutates_args=())
def moe_route_bwd(dw: Tensor, logits: Tensor, indices: Tensor, scoring: str, renorm: bool, scale: float,
                  backend: str) -> Tensor:
    return kernel(backend, "moe_route_bwd")(dw, logits, indices, scoring, renorm, scale)


@moe_route_bwd.register_fake
def _(dw, logits, indices, scoring, renorm, scale, backend):
    return logits.new_empty(logits.shape)


def _route_setup(ctx, inputs, output):
    logits, _, _, scoring, renorm, _, _, _, scale, backend = inputs
    ctx.save_for_backward(logits, output[1])
    ctx.args = (scoring, renorm, scale, backend)


def _route_backward(ctx, dw, _dindices):
    logits, indices = ctx.saved_tensors
    if dw is None:
        return (None,) * 10
    return (run(moe_route_bwd, dw, logits, indices, *ctx.args),) + (None,) * 9


_route = autograd(moe_route_fwd, _route_setup, _route_backward, elementwise=False)


def moe_route(logits: Tensor, correction: Tensor | None, top_k: int, scoring: str, renorm: bool, n_group: int,
              topk_group: int, group_top: int, scale: float, backend: str) -> tuple[Tensor, Tensor]:
    return _route(logits, correction, top_k, scoring, renorm, n_group, topk_group, group_top, scale,
                  backend_of(backend))


@torch.library.custom_op("torchfuser::moe_experts_fwd", mutates_args=())
def moe_experts_fwd(x: Tensor, weights: Tensor, indices: Tensor, gate_up: Tensor, gate_up_bias: Optional[Tensor],
                    down: Tensor, down_bias: Optional[Tensor], transposed: bool, halves: str, act: str, alpha: float,
                    limit: float, out_dtype: Optional[torch.dtype], backend: str
                    ) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    return kernel(backend, "moe_experts_fwd")(x, weights, indices, gate_up, gate_up_bias, down, down_bias, transposed,
                                              halves, act, alpha, limit, out_dtype)


@moe_experts_fwd.register_fake
def _(x, weights, indices, gate_up, gate_up_bias, down, down_bias, transposed, halves, act, alpha, limit, out_dtype,
      backend):
    s = indices.numel()
    two_i = gate_up.shape[2] if transposed else gate_up.shape[1]
    return (x.new_empty(x.shape, dtype=out_dtype or x.dtype), x.new_empty((s, two_i)),
            x.new_empty((s,), dtype=torch.int64), x.new_empty((gate_up.shape[0],), dtype=torch.int32))


@torch.library.custom_op("torchfuser::moe_experts_bwd", mutates_args=())
def moe_experts_bwd(dy: Tensor, x: Tensor, weights: Tensor, indices: Tensor, gate_up: Tensor,
                    gate_up_bias: Optional[Tensor], down: Tensor, down_bias: Optional[Tensor], h: Tensor, order: Tensor,
                    offs: Tensor, transposed: bool, halves: str, act: str, alpha: float, limit: float, backend: str
                    ) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor, Tensor]:
    """(dx, dweights, dgate_up, dgate_up_bias, ddown, ddown_bias); a bias that is None gets an empty gradient."""
    grads = kernel(backend, "moe_experts_bwd")(dy, x, weights, indices, gate_up, gate_up_bias, down, down_bias, h,
                                               order, offs, transposed, halves, act, alpha, limit)
    return tuple(x.new_empty(0) if g is None else g for g in grads)


@moe_experts_bwd.register_fake
def _(dy, x, weights, indices, gate_up, gate_up_bias, down, down_bias, h, order, offs, transposed, halves, act, alpha,
      limit, backend):
    like = lambda t: x.new_empty(0) if t is None else t.new_empty(t.shape)  # noqa: E731
    return like(x), like(weights), like(gate_up), like(gate_up_bias), like(down), like(down_bias)


def _experts_setup(ctx, inputs, output):
    x, weights, indices, gate_up, gate_up_bias, down, down_bias = inputs[:7]
    ctx.save_for_backward(x, weights, indices, gate_up, gate_up_bias, down, down_bias, *output[1:])
    ctx.args = (*inputs[7:12], inputs[13])  # transposed, halves, act, alpha, limit, backend


def _experts_backward(ctx, dy, *_):
    if dy is None:
        return (None,) * 14
    x, weights, indices, gate_up, gate_up_bias, down, down_bias, h, order, offs = ctx.saved_tensors
    dx, dw, dgu, dgub, ddn, ddnb = run(moe_experts_bwd, dy, x, weights, indices, gate_up, gate_up_bias, down,
                                       down_bias, h, order, offs, *ctx.args)
    dgub, ddnb = (None if b is None else d for b, d in ((gate_up_bias, dgub), (down_bias, ddnb)))
    return (dx, dw, None, dgu, dgub, ddn, ddnb) + (None,) * 7


_experts = autograd(moe_experts_fwd, _experts_setup, _experts_backward, elementwise=False)


def moe_experts(x: Tensor, weights: Tensor, indices: Tensor, gate_up: Tensor, gate_up_bias: Tensor | None,
                down: Tensor, down_bias: Tensor | None, transposed: bool, halves: str, act: str, alpha: float,
                limit: float, out_dtype: torch.dtype | None, backend: str) -> Tensor:
    return _experts(x, weights, indices, gate_up, gate_up_bias, down, down_bias, transposed, halves, act, float(alpha),
                    float(limit), out_dtype, backend_of(backend))[0]
