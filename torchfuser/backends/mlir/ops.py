"""The MLIR backend's launchers, same signatures and returns as the reference backend.

Each launcher names the reference definition it compiles (forward, or its vjp for the
backward), describes its arguments as row / broadcast tensors, gets the cached kernel for
that (spec, dtypes, row shape) and runs it on views of the caller's tensors. Leading dims are
flattened into rows, so one kernel serves every batch × sequence length.
"""
from __future__ import annotations

from functools import partial

import torch

from torchfuser.backends.reference import gated as ref_gated
from torchfuser.backends.reference import layer_norm as ref_ln
from torchfuser.backends.reference import rms_norm as ref_rms
from torchfuser.backends.reference import rope as ref_rope
from torchfuser.backends.reference._autodiff import compute_dtype, vjp, widened

from .capture import BCAST, ROW, ArgSpec
from .compile import kernel_for
from .runner import as_rows

SUPPORTED = (torch.float32, torch.bfloat16, torch.float16)


def check_dtypes(op: str, *tensors) -> None:
    for t in tensors:
        if t is not None and t.dtype not in SUPPORTED:
            raise TypeError(
                f"{op}: the mlir backend computes in fp32 for float32/bfloat16/float16 inputs; got {t.dtype}. "
                "Use backend='reference' for float64."
            )
        if t is not None and t.device.type != "cpu":
            raise ValueError(f"{op}: the mlir backend runs on CPU tensors, got one on {t.device}")


def _hidden(x: torch.Tensor) -> int:
    return x.shape[-1] if x.dim() else 1


def _rows(x: torch.Tensor) -> torch.Tensor:
    return as_rows(x.reshape(1) if x.dim() == 0 else x, (_hidden(x),))


# ---- rms_norm ------------------------------------------------------------------------------

def rms_norm_fwd(x, weight, eps, offset, out_dtype=None):
    check_dtypes("rms_norm", x, weight)
    x = widened(x, out_dtype)  # the result rounded once, to out_dtype
    h = _hidden(x)
    k = kernel_for(
        "rms_norm_fwd", {"eps": eps, "offset": offset},
        lambda a, w: ref_rms.rms_norm(a, w, eps, offset),
        [ArgSpec(ROW, (h,), x.dtype), ArgSpec(BCAST, (h,), weight.dtype)],
    )
    y, rstd = k(_rows(x), weight)
    return y.view(x.shape).to(out_dtype or x.dtype), rstd.view(x.shape[:-1])


def rms_norm_bwd(dy, x, weight, rstd, eps, offset, dres=None):
    check_dtypes("rms_norm", dy, x, weight, dres)
    x_dtype = x.dtype  # dx rounded once, to it: a bf16 dy of a norm whose output was asked for in bf16 is widened,
    wide = torch.promote_types(dy.dtype, x_dtype)  # and a bf16 x whose norm was asked for in fp32 too
    dy, x = dy.to(wide), x.to(wide)
    if dres is not None and dres.shape != x.shape:
        raise ValueError(f"rms_norm_bwd: dres must have x's shape {tuple(x.shape)}, got {tuple(dres.shape)}")
    h = _hidden(x)
    k = kernel_for(
        "rms_norm_bwd", {"eps": eps, "offset": offset},
        lambda g, a, w: vjp(lambda a_, w_: ref_rms.rms_norm(a_, w_, eps, offset)[0], (a, w), g),
        [ArgSpec(ROW, (h,), dy.dtype), ArgSpec(ROW, (h,), x.dtype), ArgSpec(BCAST, (h,), weight.dtype)],
    )
    dx, dw = k(_rows(dy), _rows(x), weight)
    dx = dx.view(x.shape)
    if dres is not None:
        # Added on the host to the kernel's dx, which is already rounded to x's dtype: one rounding
        # more than the triton and reference backends for bf16/fp16 x, none for fp32.
        dx = dx.float() + dres.float()
    return dx.to(x_dtype), dw


def add_rms_norm_bwd(dy, s, weight, rstd, eps, offset, ds, r_dtype):
    return ref_rms.norm_bwd_then_cast(rms_norm_bwd, dy, s, weight, rstd, eps, offset, ds, r_dtype)


def add_rms_norm_fwd(x, r, weight, eps, offset, out_dtype=None):
    """s = x + r on the host (torch's add and type promotion), then this backend's rms_norm_fwd(s)."""
    check_dtypes("add_rms_norm", x, r, weight)
    return ref_rms.add_then_norm(rms_norm_fwd, x, r, weight, eps, offset, out_dtype)


# ---- layer_norm ----------------------------------------------------------------------------

def layer_norm_fwd(x, weight, bias, eps):
    check_dtypes("layer_norm", x, weight, bias)
    h = _hidden(x)
    args = [ArgSpec(ROW, (h,), x.dtype), ArgSpec(BCAST, (h,), weight.dtype)]
    if bias is None:
        fn = lambda a, w: ref_ln.layer_norm(a, w, None, eps)  # noqa: E731
        tensors = (weight,)
    else:
        args.append(ArgSpec(BCAST, (h,), bias.dtype))
        fn = lambda a, w, b: ref_ln.layer_norm(a, w, b, eps)  # noqa: E731
        tensors = (weight, bias)
    k = kernel_for("layer_norm_fwd", {"eps": eps, "bias": bias is not None}, fn, args)
    y, mean, rstd = k(_rows(x), *tensors)
    lead = x.shape[:-1]
    return y.view(x.shape), mean.view(lead), rstd.view(lead)


def layer_norm_bwd(dy, x, weight, bias, mean, rstd, eps):
    check_dtypes("layer_norm", dy, x, weight, bias)
    h = _hidden(x)
    args = [ArgSpec(ROW, (h,), dy.dtype), ArgSpec(ROW, (h,), x.dtype), ArgSpec(BCAST, (h,), weight.dtype)]
    if bias is None:
        fn = lambda g, a, w: vjp(lambda a_, w_: ref_ln.layer_norm(a_, w_, None, eps)[0], (a, w), g)  # noqa: E731
        tensors = (weight,)
    else:
        args.append(ArgSpec(BCAST, (h,), bias.dtype))
        fn = lambda g, a, w, b: vjp(lambda a_, w_, b_: ref_ln.layer_norm(a_, w_, b_, eps)[0], (a, w, b), g)  # noqa: E731
        tensors = (weight, bias)
    k = kernel_for("layer_norm_bwd", {"eps": eps, "bias": bias is not None}, fn, args)
    outs = k(_rows(dy), _rows(x), *tensors)
    db = outs[2] if bias is not None else weight.new_empty(0)
    return outs[0].view(x.shape), outs[1], db


# ---- gated activations and gelu ------------------------------------------------------------

def _pair(op: str, ref_fn, gate, up):
    check_dtypes(op, gate, up)
    h = _hidden(gate)
    k = kernel_for(f"{op}_fwd", {}, ref_fn, [ArgSpec(ROW, (h,), gate.dtype), ArgSpec(ROW, (h,), up.dtype)])
    (y,) = k(_rows(gate), _rows(up))
    return y.view(gate.shape)


def _pair_bwd(op: str, ref_fn, dy, gate, up):
    check_dtypes(op, dy, gate, up)
    h = _hidden(gate)
    k = kernel_for(
        f"{op}_bwd", {}, lambda g, a, b: vjp(ref_fn, (a, b), g),
        [ArgSpec(ROW, (h,), dy.dtype), ArgSpec(ROW, (h,), gate.dtype), ArgSpec(ROW, (h,), up.dtype)],
    )
    dgate, dup = k(_rows(dy), _rows(gate), _rows(up))
    return dgate.view(gate.shape), dup.view(up.shape)


def swiglu_fwd(gate, up):
    return _pair("swiglu", ref_gated.swiglu, gate, up)


def swiglu_bwd(dy, gate, up):
    return _pair_bwd("swiglu", ref_gated.swiglu, dy, gate, up)


def geglu_fwd(gate, up):
    return _pair("geglu", ref_gated.geglu, gate, up)


def geglu_bwd(dy, gate, up):
    return _pair_bwd("geglu", ref_gated.geglu, dy, gate, up)


# Packed [gate | up]: the same kernels on the two halves (row-strided views); the backward
# concatenates the halves' gradients (on the CPU that copy is small next to the kernel).
def swiglu_packed_fwd(gate_up):
    return swiglu_fwd(*ref_gated.halves(gate_up))


def swiglu_packed_bwd(dy, gate_up):
    return torch.cat(swiglu_bwd(dy, *ref_gated.halves(gate_up)), dim=-1)


def geglu_packed_fwd(gate_up):
    return geglu_fwd(*ref_gated.halves(gate_up))


def geglu_packed_bwd(dy, gate_up):
    return torch.cat(geglu_bwd(dy, *ref_gated.halves(gate_up)), dim=-1)


def geglu_erf_fwd(gate, up):
    return _pair("geglu_erf", ref_gated.geglu_erf, gate, up)


def geglu_erf_bwd(dy, gate, up):
    return _pair_bwd("geglu_erf", ref_gated.geglu_erf, dy, gate, up)


def geglu_erf_packed_fwd(gate_up):
    return geglu_erf_fwd(*ref_gated.halves(gate_up))


def geglu_erf_packed_bwd(dy, gate_up):
    return torch.cat(geglu_erf_bwd(dy, *ref_gated.halves(gate_up)), dim=-1)


def gelu_fwd(x, approximate):
    check_dtypes("gelu", x)
    h = _hidden(x)
    k = kernel_for("gelu_fwd", {"approximate": approximate}, lambda a: ref_gated.gelu(a, approximate), [ArgSpec(ROW, (h,), x.dtype)])
    (y,) = k(_rows(x))
    return y.view(x.shape)


def gelu_bwd(dy, x, approximate):
    check_dtypes("gelu", dy, x)
    h = _hidden(x)
    k = kernel_for(
        "gelu_bwd", {"approximate": approximate},
        lambda g, a: vjp(ref_gated.gelu, (a,), g, approximate)[0],
        [ArgSpec(ROW, (h,), dy.dtype), ArgSpec(ROW, (h,), x.dtype)],
    )
    (dx,) = k(_rows(dy), _rows(x))
    return dx.view(x.shape)


# ---- rope ----------------------------------------------------------------------------------
# Rows are sequence positions: q viewed as S × B × Hq × D (a permuted view, no copy) shares row s
# with cos viewed as S × B × D (B broadcast when cos has one batch entry), so one kernel call covers
# the batch. rotate_half is written out on the halves of the last dim: the kernel reads and writes
# each half through a strided view and never concatenates:
#   forward  (out = t·cos + rotate_half(t)·sin):  o1 = t1·c1 − t2·s1,   o2 = t2·c2 + t1·s2
#   backward (its transpose, rope being linear):  g1' = g1·c1 + g2·s2,  g2' = g2·c2 − g1·s1
# (NOTES-mlir.md: the concatenating form, one call per batch entry, ran up to 4× slower than eager.)

def _rope_halves(transpose: bool):
    def fn(q1, q2, k1, k2, c1, c2, s1, s2):
        ct = compute_dtype(q1, k1)
        c1, c2, s1, s2 = (t.to(ct).unsqueeze(2) for t in (c1, c2, s1, s2))  # over the heads

        def rotate(a1, a2):
            x1, x2 = a1.to(ct), a2.to(ct)
            if transpose:
                return (x1 * c1 + x2 * s2).to(a1.dtype), (x2 * c2 - x1 * s1).to(a2.dtype)
            return (x1 * c1 - x2 * s1).to(a1.dtype), (x2 * c2 + x1 * s2).to(a2.dtype)

        return (*rotate(q1, q2), *rotate(k1, k2))

    return fn


def _rope(op: str, q, k, cos, sin):
    check_dtypes("rope", q, k, cos, sin)
    b, hq, s, d = q.shape
    hk, h = k.shape[1], cos.shape[-1] // 2  # 2h < d: partial rotary, the rest copied through on the host
    kern = kernel_for(
        op, {}, _rope_halves(op == "rope_bwd"),
        [ArgSpec(ROW, (b, hq, h), q.dtype)] * 2 + [ArgSpec(ROW, (b, hk, h), k.dtype)] * 2
        + [ArgSpec(ROW, (b, h), cos.dtype)] * 2 + [ArgSpec(ROW, (b, h), sin.dtype)] * 2,
    )
    qo, ko = ref_rope.empty_heads_inner(q), ref_rope.empty_heads_inner(k)

    def halves(t):  # B×H×S×D (or B×S×D) → the two halves of S×B×H×D (S×B×D)
        t = t.permute(2, 0, 1, 3) if t.dim() == 4 else t.expand(b, -1, -1).permute(1, 0, 2)
        return t[..., :h], t[..., h:2 * h]

    (o1, o2), (p1, p2) = halves(qo), halves(ko)
    kern(*halves(q), *halves(k), *halves(cos), *halves(sin), out=[o1, o2, p1, p2])
    if 2 * h < d:
        qo[..., 2 * h:].copy_(q[..., 2 * h:])
        ko[..., 2 * h:].copy_(k[..., 2 * h:])
    return qo, ko


def rope_fwd(q, k, cos, sin, out_dtype=None):
    return ref_rope.in_out_dtype(partial(_rope, "rope_fwd"), q, k, cos, sin, out_dtype)


def rope_bwd(dq, dk, cos, sin, out_dtype=None):
    return ref_rope.in_out_dtype(partial(_rope, "rope_bwd"), dq, dk, cos, sin, out_dtype)


# ---- residual add + layer_norm ---------------------------------------------------------------
# The add (forward) and the residual gradient's add (backward) run on the host around this backend's
# layer_norm kernels: torch's add and type promotion, then the compiled norm. Exact as the reference
# for fp32; for bf16 dx is rounded before dres is added (one more rounding than the Triton kernel).

def add_layer_norm_fwd(x, r, weight, bias, eps):
    check_dtypes("add_layer_norm", x, r, weight, bias)
    if x.shape != r.shape:
        raise ValueError(f"add_layer_norm: x and r must have the same shape (no broadcasting), got {tuple(x.shape)} "
                         f"and {tuple(r.shape)}")
    s = torch.add(x, r).contiguous()
    return (s, *layer_norm_fwd(s, weight, bias, eps))


def layer_norm_res_bwd(dy, x, weight, bias, mean, rstd, eps, dres=None):
    dx, dw, db = layer_norm_bwd(dy, x, weight, bias, mean, rstd, eps)
    if dres is None:
        return dx, dw, db
    if dres.shape != x.shape:
        raise ValueError(f"layer_norm_bwd: dres must have x's shape {tuple(x.shape)}, got {tuple(dres.shape)}")
    return (dx.float() + dres.float()).to(x.dtype) if x.dtype != torch.float32 else dx + dres, dw, db
