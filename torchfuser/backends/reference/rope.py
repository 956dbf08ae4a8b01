"""Rotary embedding, rotate-half convention: out = t · cos + rotate_half(t) · sin for t in (q, k)."""
from __future__ import annotations

import torch

from ._autodiff import cast, compute_dtype, vjp, widened


def _rotate_half(t):
    half = t.shape[-1] // 2
    return torch.cat((-t[..., half:], t[..., :half]), dim=-1)


def rope(q, k, cos, sin):
    """q: B×Hq×S×D, k: B×Hk×S×D, cos/sin: (B or 1)×S×R shared by every head; R < D: partial rotary, the
    first R channels rotate and the rest pass through unchanged."""
    rd = cos.shape[-1]
    if rd < q.shape[-1]:
        qr, kr = rope(q[..., :rd], k[..., :rd], cos, sin)
        return torch.cat([qr, q[..., rd:]], dim=-1), torch.cat([kr, k[..., rd:]], dim=-1)
    ct = compute_dtype(q, k)
    if q.dtype == ct and k.dtype == ct and cos.dtype == ct and sin.dtype == ct:  # no cast anywhere (host time)
        c, s = cos.unsqueeze(1), sin.unsqueeze(1)
        return q * c + _rotate_half(q) * s, k * c + _rotate_half(k) * s
    c, s = cast(cos, ct).unsqueeze(1), cast(sin, ct).unsqueeze(1)
    qf, kf = cast(q, ct), cast(k, ct)
    return cast(qf * c + _rotate_half(qf) * s, q.dtype), cast(kf * c + _rotate_half(kf) * s, k.dtype)


def empty_heads_inner(t, dtype=None):
    """An uninitialised B×H×S×D tensor like ``t`` (of ``dtype``, default t's) over B×S×H×D memory: the layout of
    every backend's rope outputs and of its fake impl (torchfuser.ops.rope says why)."""
    b, h, s, d = t.shape
    return t.new_empty((b, s, h, d), dtype=dtype).transpose(1, 2)


def _heads_inner(t, dtype=None):
    # Not ``contiguous``: with a size-1 dim it may keep strides other than the fake impl's.
    return empty_heads_inner(t, dtype).copy_(t)


def in_out_dtype(rope_fn, q, k, cos, sin, out_dtype):
    """``rope_fn(q, k, cos, sin)`` (a rope forward or backward whose outputs have their inputs' dtypes) with both
    outputs in ``out_dtype``, each rounded once: the inputs widened first where out_dtype is wider (a bf16
    gradient whose input was fp32), the fp32 results rounded after where it is narrower (fp32 q and k rotated
    for attention under autocast, which would round them to bf16 next)."""
    qo, ko = rope_fn(widened(q, out_dtype), widened(k, out_dtype), cos, sin)
    if out_dtype is None or qo.dtype == ko.dtype == out_dtype:
        return qo, ko
    return _heads_inner(qo, out_dtype), _heads_inner(ko, out_dtype)


def _rope_fwd(q, k, cos, sin):
    qo, ko = rope(q, k, cos, sin)
    return _heads_inner(qo), _heads_inner(ko)


def rope_fwd(q, k, cos, sin, out_dtype=None):
    return in_out_dtype(_rope_fwd, q, k, cos, sin, out_dtype)


def rope_infer(q, k, cos, sin, out_dtype=None):
    """``rope_fwd`` for a call with no backward (``ops._call.nograd_forward``): the same values, laid out as
    the arithmetic leaves them (B×H×S×D, as the unfused model's), without the copies into B×S×H×D memory
    that only spare the backward's. Tensors of their own, never views (called unwrapped).

    Full rotary of an even width, no cast: rotate_half(t)·sin as roll(t, D/2)·sin', sin' = [−sin₁ | sin₂], made
    once for q and k: the sign moves from t's half to sin's (−a·b = a·(−b) exactly), so every product and sum is
    rope's, bit for bit: two ATen calls less a call, and per tensor a roll in place of two slices and a cat
    (a decode step's rope is host time: 5–10 % less there on the CPU, and not slower at longer inputs)."""
    if out_dtype is not None and not q.dtype == k.dtype == out_dtype:
        return tuple(t.contiguous() for t in rope_fwd(q, k, cos, sin, out_dtype))  # (tensors of their own)
    rd = cos.shape[-1]
    if rd % 2 or rd != q.shape[-1] or not (q.dtype == k.dtype == cos.dtype == sin.dtype == compute_dtype(q, k)):
        return rope(q, k, cos, sin)
    half = rd // 2
    c, s = cos.unsqueeze(1), torch.cat((-sin[..., :half], sin[..., half:]), dim=-1).unsqueeze(1)
    return q * c + q.roll(half, -1) * s, k * c + k.roll(half, -1) * s


def _rope_bwd(dq, dk, cos, sin):
    # rope is linear in (q, k): its vjp does not depend on the point it is taken at.
    gq, gk = vjp(lambda a, b: rope(a, b, cos, sin), (dq, dk), (dq, dk))
    return _heads_inner(gq), _heads_inner(gk)


def rope_bwd(dq, dk, cos, sin, out_dtype=None):
    return in_out_dtype(_rope_bwd, dq, dk, cos, sin, out_dtype)
