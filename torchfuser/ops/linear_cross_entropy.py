"""Linear + cross-entropy. The forward also returns the gradients for an upstream gradient of 1,
so that no backend recomputes the logits: the backward only scales them.

``fp8`` (None, "rowwise" or "tensorwise"): the backend runs the products (logits, dh, dW) as FP8 GEMMs
(``backends/_fp8_gemm.py``); the gradients keep their dtypes, so the fake impl is the same either
way. The caller (``functional.linear_cross_entropy``) has checked that the call can take FP8 (bf16
operands, every dimension a multiple of 16) and routed it to a backend that has FP8 GEMMs."""
from __future__ import annotations

from typing import Optional

import torch
from torch import Tensor

from torchfuser.backends import kernels

from ._call import autograd, kernel, plain_eager


@torch.library.custom_op("torchfuser::linear_cross_entropy_fwd", mutates_args=())
def linear_cross_entropy_fwd(
    hidden: Tensor,
    weight: Tensor,
    bias: Optional[Tensor],
    labels: Tensor,
    ignore_index: int,
    softcap: Optional[float],
    reduction: str,
    need_grad: bool,
    fp8: Optional[str],
    backend: str,
    weight_grad: bool = True,
) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """Returns (loss fp32 scalar, dhidden, dweight, dbias); the gradients are empty unless need_grad, dweight and
    dbias also where not ``weight_grad`` (a frozen head: LoRA, TRL's reference passes)."""
    impl = kernel(backend, "linear_cross_entropy_fwd")
    if fp8 is not None and backend not in _FP8_BACKENDS:
        raise ValueError(f"linear_cross_entropy: backend {backend!r} has no FP8 GEMMs (fp8={fp8!r}); "
                         f"use one of {', '.join(_FP8_BACKENDS)}")
    return impl(hidden, weight, bias, labels, ignore_index, softcap, reduction, need_grad, fp8, weight_grad)


_FP8_BACKENDS = ("reference", "triton")


@linear_cross_entropy_fwd.register_fake
def _(hidden, weight, bias, labels, ignore_index, softcap, reduction, need_grad, fp8, backend, weight_grad=True):
    loss = hidden.new_empty((), dtype=torch.float32)
    empty = hidden.new_empty(0)
    if not need_grad:
        return loss, empty, empty.clone(), empty.clone()
    if not weight_grad:
        return loss, hidden.new_empty(hidden.shape), empty, empty.clone()
    db = hidden.new_empty(0) if bias is None else bias.new_empty(bias.shape)
    return loss, hidden.new_empty(hidden.shape), weight.new_empty(weight.shape), db


def _setup(ctx, inputs, output):
    bias, need_grad = inputs[2], inputs[7]
    ctx.has_bias = bias is not None
    ctx.need_grad = need_grad
    ctx.weight_grad = inputs[10] if len(inputs) > 10 else True  # (callers of the op itself may leave it out)
    ctx.backend = inputs[9]
    ctx.scaled_in_place = False  # the saved gradients scaled by a backward: no second one
    ctx.save_for_backward(*output[1:])


def _keep_graph() -> bool:
    """Whether the running backward retains the graph (``retain_graph=True``, or ``create_graph``)."""
    keep = getattr(torch._C._autograd, "_get_current_graph_task_keep_graph", None)
    return True if keep is None else bool(keep())  # unknown: assume retained (a copy, never a wrong gradient)


def _backward(ctx, dloss, *_):
    if not ctx.need_grad:
        raise RuntimeError(
            "linear_cross_entropy was run without gradients (need_grad=False) but is being differentiated; "
            "call it with grad mode on"
        )
    if ctx.scaled_in_place:
        raise RuntimeError(
            "linear_cross_entropy (the fused LM head + loss): a second backward through the same graph, whose "
            "first backward ran without retain_graph=True. This op computes its gradients in the forward and "
            "that backward scaled them in place (to keep the peak memory low), so they are spent. Pass "
            "retain_graph=True to every backward but the last, or run "
            "torchfuser.optimize(model, exclude=['lm_head_loss'])"
        )
    dh, dw, db = ctx.saved_tensors
    scale = dloss.to(torch.float32)
    grads = [dh, dw] + ([db] if ctx.has_bias else [])
    if not plain_eager(grads + [scale]):
        # Traced (torch.compile, make_fx, export): out of place, for functionalization. Not
        # `is_compiling()`: torch 2.11's AOTAutograd traces this backward with it False, and the
        # backend's kernel then met fake tensors.
        grads = [(g * scale).to(g.dtype) for g in grads]
    else:
        # In place: a scaled copy of dweight alone would add V×H elements to the peak. Where the
        # graph is retained (retain_graph=True: a later backward reads the saved gradients again)
        # the copies are made, and scaled by the same kernel, so every backward is exact. A backend
        # may scale faster than `mul_` with a device scalar (the Triton one: vectorised, and skipped
        # on the device when dloss is 1).
        if _keep_graph():
            grads = [g.clone() for g in grads]
        else:
            ctx.scaled_in_place = True
        scale_ = getattr(kernels(ctx.backend), "linear_cross_entropy_scale_", None)
        if scale_ is not None:
            scale_(grads, scale)
        else:
            for g in grads:
                g.mul_(scale)
    dweight = grads[1] if ctx.weight_grad else None
    dbias = grads[2] if ctx.has_bias and ctx.weight_grad else None
    return grads[0], dweight, dbias, None, None, None, None, None, None, None, None


_linear_cross_entropy = autograd(linear_cross_entropy_fwd, _setup, _backward, elementwise=False)


def linear_cross_entropy(hidden, weight, bias, labels, ignore_index, softcap, reduction, backend, fp8=None) -> Tensor:
    need_grad = torch.is_grad_enabled() and any(
        t is not None and t.requires_grad for t in (hidden, weight, bias)
    )
    # A frozen head (LoRA, a reference model's pass): no dW, no dbias (a V × H GEMM and a V × H tensor saved)
    weight_grad = need_grad and (weight.requires_grad or (bias is not None and bias.requires_grad))
    return _linear_cross_entropy(hidden, weight, bias, labels, ignore_index, softcap, reduction, need_grad, fp8,
                                 backend, weight_grad)[0]
