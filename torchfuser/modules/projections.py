"""Several linear projections of one input as one matrix product (attention's q, k and v; a gated
MLP's gate and up).

Under autocast, ``[m(x) for m in linears]`` casts ``x`` to the autocast dtype once per
projection, saves each cast copy for the backward, runs a small GEMM per projection, and in the
backward turns each bf16 ``dx`` back to fp32 and adds them up. Here the input is cast once, the
(cast) weights are concatenated, one GEMM gives every output, and the backward's single GEMM
sums the projections' ``dx`` in fp32 inside cuBLAS before the one rounding: fewer launches, less
traffic, one saved copy of the input instead of one per projection, and ``dx`` no less accurate.

Only plain ``nn.Linear`` children without hooks qualify (a quantised layer, a hook, an FSDP-wrapped
child must each be called as itself; PEFT LoRA layers have a joint node of their own in
``modules.adapters.lora``), and only under autocast: without it the concatenated weights would be an extra
copy to save for the backward.

In plain eager mode the joint product and its backward are one autograd node (``_AutocastLinear``):
where cuBLAS can write fp32 from bf16/fp16 operands (CUDA, ``torch.mm(..., out_dtype=)``), the
backward's products give the fp32 ``dx`` and the fp32 weight gradients directly, with one rounding
each, instead of bf16 products that cast kernels then widen (autocast's way: a rounding to bf16
inside every weight gradient, one more kernel and autograd node per cast). On an H200 at qwen05b's
shapes (benchmarks/probes/projection_probe.py) that takes q/k/v from 0.185 to 0.161 ms and gate/up from
0.780 to 0.734 ms forward + backward. A single projection stays autocast's nn.Linear: as a Python
autograd node it gained nothing on the GPU (o_proj 0.0945 vs 0.0947 ms) and cost ≈ 120–150 µs more
host time a call. Elsewhere (CPU, torch.compile, tracing) the products are autocast's own.
"""
from __future__ import annotations

import torch
from torch import Tensor, nn

from torchfuser.backends._gemm import fp32_out_ok as _out_dtype_ok
from torchfuser.modules import fp8, gemm
from torchfuser.modules.adapters import lora
from torchfuser.modules.base import hooked
from torchfuser.ops._call import autocast_enabled, plain_eager

_AUTOCAST_CASTS = (torch.float32, torch.bfloat16, torch.float16)  # autocast leaves float64 alone


_MODULE = nn.modules.module


def call_linear(m: nn.Module, x: Tensor) -> Tensor:
    """``m(x)``; for a plain ``nn.Linear`` that runs just its class's forward (no hooks of its own or global ones,
    no forward set on the instance) its product without ``nn.Module.__call__`` (host time: a decode step makes
    seven such calls a layer, and the module call costs more than a small product's dispatch)."""
    if (type(m) is not nn.Linear or m._forward_hooks or m._forward_pre_hooks or m._backward_hooks
            or m._backward_pre_hooks or _MODULE._global_forward_hooks or _MODULE._global_forward_pre_hooks
            or _MODULE._global_backward_hooks or _MODULE._global_backward_pre_hooks or "forward" in m.__dict__):
        return m(x)
    p = m._parameters
    w, b = p.get("weight"), p.get("bias", _MODULE)  # (a weight held elsewhere, e.g. a plain attribute: the call)
    if w is None or b is _MODULE:
        return m(x)
    return nn.functional.linear(x, w, b)


def _plain(linears) -> bool:
    with_bias = linears[0].bias is not None
    return not hooked(*linears) and all(type(m) is nn.Linear and (m.bias is not None) == with_bias for m in linears)


def joint(x: Tensor, linears: list[nn.Module], owner: nn.Module | None = None) -> Tensor | None:
    """``torch.cat([m(x) for m in linears], -1)`` as one GEMM, under autocast; None where that
    would not give the same result (see the module docstring): then call each projection.
    Projections carrying PEFT LoRA adapters go to ``modules.adapters.lora`` (with or without autocast),
    which counts on ``owner`` why a call could not run there. With FP8 on (``owner._fp8``), FP8 GEMMs
    (``modules.fp8``)."""
    # (fp8.recipe_of inline: every fused attention and MLP call asks)
    if owner is not None and owner.__dict__.get("_fp8") is not None and (y := fp8.linear(x, linears, owner)) is not None:
        return y
    if len(linears) > 1:
        for m in linears:  # (a loop, not a generator: every fused attention and MLP call runs this)
            if type(m) is not nn.Linear:
                return lora.joint(x, linears, owner) if any(map(lora.is_lora, linears)) else None
    device = x.device.type
    if (len(linears) < 2 or not torch._C._is_any_autocast_enabled() or x.dtype not in _AUTOCAST_CASTS
            or not autocast_enabled(device)
            or not _plain(linears)):
        return None
    dtype = torch.get_autocast_dtype(device)
    weights = [m.weight for m in linears]
    biases = [] if linears[0].bias is None else [m.bias for m in linears]
    if plain_eager((x, *weights, *biases)):
        return _AutocastLinear.apply(x, dtype, len(weights), *weights, *biases)
    weight = gemm.cast_cat(weights, dtype)
    bias = None if not biases else gemm.cast_cat(biases, dtype)
    with torch.autocast(device, enabled=False):
        return nn.functional.linear(x.to(dtype), weight, bias)


def single(x: Tensor, linear: nn.Module, owner: nn.Module | None = None) -> Tensor:
    """``linear(x)``; a PEFT LoRA layer runs as the fused LoRA node (``modules.adapters.lora``), which keeps x
    once in its own dtype for the backward where PEFT's adapter keeps an fp32 copy of it (on a bf16
    base: twice the bytes of every adapted output and down projection's input). With FP8 on, FP8 GEMMs."""
    if owner is not None and owner.__dict__.get("_fp8") is not None and (y := fp8.linear(x, [linear], owner)) is not None:
        return y
    if type(linear) is not nn.Linear:  # plain projections (and traced code) take the call as it is
        if lora.is_lora(linear):
            y = lora.joint(x, [linear], owner)
            if y is not None:
                return y
    return call_linear(linear, x)


def project(x: Tensor, linears: list[nn.Module], owner: nn.Module | None = None) -> list[Tensor]:
    """``[m(x) for m in linears]``, as one GEMM where that gives the same result."""
    y = joint(x, linears, owner)
    if y is None:
        return [call_linear(m, x) for m in linears]
    return list(y.split([m.out_features for m in linears], dim=-1))


class _AutocastLinear(torch.autograd.Function):
    """y = x·Wᵀ + b with x, W (the weights concatenated) and b cast to the autocast dtype once.
    Saved: the cast x and W. Backward: dx = dy·W and dW = dyᵀ·x, each written by cuBLAS in the
    dtype its input had (fp32 straight from the fp32 accumulator where ``out_dtype`` is supported),
    db = Σ dy in fp32; gradients are computed only for inputs that need them."""

    @staticmethod
    def forward(ctx, x, dtype, n_weights, *params):
        weights, biases = params[:n_weights], params[n_weights:]
        w = gemm.cast_cat(weights, dtype)
        b = gemm.cast_cat(biases, dtype) if biases else None
        xc = x.to(dtype)
        ctx.save_for_backward(xc, w)
        ctx.x_dtype, ctx.n_weights = x.dtype, n_weights
        ctx.rows = [t.shape[0] for t in weights]
        ctx.dtypes = [t.dtype for t in params]
        return nn.functional.linear(xc, w, b)

    @staticmethod
    def backward(ctx, dy):
        xc, w = ctx.saved_tensors
        n = ctx.n_weights
        need_x, need_w, need_b = ctx.needs_input_grad[0], ctx.needs_input_grad[3:3 + n], ctx.needs_input_grad[3 + n:]
        dy2 = dy.reshape(-1, dy.shape[-1])
        dx = gemm.mm(dy2, w, ctx.x_dtype).view(xc.shape) if need_x else None
        dws, dbs = [None] * n, [None] * len(need_b)
        if any(need_w):
            dw = gemm.mm(dy2.t(), xc.reshape(-1, xc.shape[-1]), ctx.dtypes[0]).split(ctx.rows)
            dws = [g if want else None for g, want in zip(dw, need_w)]
        if any(need_b):
            db = gemm.column_sums(dy2).to(ctx.dtypes[n]).split(ctx.rows)
            dbs = [g if want else None for g, want in zip(db, need_b)]
        return (dx, None, None, *dws, *dbs)


def residual_linear(residual: Tensor, x: Tensor, linear: nn.Module) -> Tensor | None:
    """``residual + linear(x)`` under autocast with the sum in the GEMM's epilogue: cuBLAS adds the
    fp32 residual to its fp32 accumulator and writes the sum once (autocast's way rounds the product
    to bf16, writes it, and an add kernel reads both back), and the backward writes the weight's fp32
    gradient straight from the accumulator. None where that would not be the same computation:
    without autocast, a residual that is not fp32 or would broadcast, a bias, a hook, not a plain
    ``nn.Linear``, or outside plain eager mode."""
    device = x.device.type
    if (not torch._C._is_any_autocast_enabled() or not autocast_enabled(device) or residual.dtype != torch.float32
            or not _plain([linear])
            or linear.bias is not None or residual.shape != (*x.shape[:-1], linear.out_features)
            or not plain_eager((residual, x, linear.weight))):
        return None
    return _ResidualLinear.apply(residual, x, torch.get_autocast_dtype(device), linear.weight)


class _ResidualLinear(torch.autograd.Function):
    """out = r + x·Wᵀ in fp32, x and W cast to the autocast dtype. Saved: the cast x and W.
    Backward: dr = dout as it is; dx = dout·W and dW = doutᵀ·x from dout cast once, dW in fp32."""

    @staticmethod
    def forward(ctx, r, x, dtype, weight):
        xc, w = x.to(dtype), weight.to(dtype)
        ctx.save_for_backward(xc, w)
        ctx.x_dtype, ctx.w_dtype = x.dtype, weight.dtype
        out = _addmm_fp32(r.reshape(-1, r.shape[-1]), xc.reshape(-1, xc.shape[-1]), w.t())
        return out.view(r.shape)

    @staticmethod
    def backward(ctx, dout):
        xc, w = ctx.saved_tensors
        g = dout.reshape(-1, dout.shape[-1]).to(w.dtype)
        dx = gemm.mm(g, w, ctx.x_dtype).view(xc.shape) if ctx.needs_input_grad[1] else None
        dw = gemm.mm(g.t(), xc.reshape(-1, xc.shape[-1]), ctx.w_dtype) if ctx.needs_input_grad[3] else None
        return dout, dx, None, dw


def _addmm_fp32(r: Tensor, a: Tensor, b: Tensor) -> Tensor:
    """r + a·b in fp32 (r fp32, a and b low precision): in cuBLAS's epilogue where supported, else
    the product rounded to a's dtype and then added (autocast's numerics)."""
    if _out_dtype_ok(a.device):
        return torch.addmm(r, a, b, out_dtype=torch.float32)
    return r + torch.mm(a, b)
