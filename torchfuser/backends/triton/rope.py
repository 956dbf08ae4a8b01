"""Rotary embedding in Triton, rotate-half convention, q and k in one launch.

For t in (q, k), split each head vector into halves t = [t1, t2] (and cos = [c1, c2], sin = [s1, s2]):
    forward:   o1 = t1·c1 − t2·s1,   o2 = t2·c2 + t1·s2          (o = t·cos + rotate_half(t)·sin)
    backward:  d1 = g1·c1 + g2·s2,   d2 = g2·c2 − g1·s1          (the transpose of that linear map)
Nothing but cos and sin is saved for the backward: rope is linear in (q, k).
Partial rotary (cos/sin narrower than the head, GPT-NeoX's rotary_pct, Phi's partial_rotary_factor): the
first cos.shape[-1] channels rotate, the rest are copied through in the same pass (forward and backward),
with no slicing and concatenation around the kernel.

One program per (batch, position): cos/sin for that position are read once and reused by every
q and k head. q/k are read through their strides (B×H×S×D views made by transposing B×S×H×D
projections cost no copy). Outputs are B×H×S×D views of B×S×H×D memory, so each program writes
one dense H·D block; SDPA lays out its output and dq/dk like its query, so attention's output
and rope's gradients then reach B×S×(H·D) without a copy. Math in fp32, one rounding.
"""
from __future__ import annotations

from functools import lru_cache

import torch
import triton
import triton.language as tl

from torchfuser.backends.reference.rope import empty_heads_inner

from ._common import CPU, Launcher, Target, check_dtypes, next_pow2, target_of, warps_for


@triton.jit
def _rotate_heads(X, sxh, O, soh, H, HALF, PASS, d, dm, c1, c2, s1, s2,
                  BLOCK_H: tl.constexpr, BLOCK_P: tl.constexpr, BACKWARD: tl.constexpr):
    for h0 in range(0, H, BLOCK_H):
        h = (h0 + tl.arange(0, BLOCK_H)).to(tl.int64)
        mask = (h < H)[:, None] & dm[None, :]
        xp = X + h[:, None] * sxh + d[None, :]
        x1 = tl.load(xp, mask=mask, other=0.0).to(tl.float32)
        x2 = tl.load(xp + HALF, mask=mask, other=0.0).to(tl.float32)
        if BACKWARD:
            o1 = x1 * c1 + x2 * s2
            o2 = x2 * c2 - x1 * s1
        else:
            o1 = x1 * c1 - x2 * s1
            o2 = x2 * c2 + x1 * s2
        op = O + h[:, None] * soh + d[None, :]
        tl.store(op, o1.to(O.dtype.element_ty), mask=mask)
        tl.store(op + HALF, o2.to(O.dtype.element_ty), mask=mask)
        if BLOCK_P > 0:  # the channels past the rotary part, copied through
            pd = 2 * HALF + tl.arange(0, BLOCK_P)
            pmask = (h < H)[:, None] & (pd < 2 * HALF + PASS)[None, :]
            x = tl.load(X + h[:, None] * sxh + pd[None, :], mask=pmask, other=0.0)
            tl.store(O + h[:, None] * soh + pd[None, :], x.to(O.dtype.element_ty), mask=pmask)


@triton.jit
def _rope_fwd_kernel(
    Q, K, COS, SIN, QO, KO, S, HQ, HK, HALF, PASS,
    sqb, sqh, sqs, skb, skh, sks, sob, soh, sos, spb, sph, sps, scb, scs, ssb, sss,
    BLOCK_H: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_P: tl.constexpr, BACKWARD: tl.constexpr,
):
    pid = tl.program_id(0).to(tl.int64)
    b = pid // S
    s = pid % S
    d = tl.arange(0, BLOCK_D)
    dm = d < HALF
    cp = COS + b * scb + s * scs + d
    sp = SIN + b * ssb + s * sss + d
    c1 = tl.load(cp, mask=dm, other=0.0).to(tl.float32)[None, :]
    c2 = tl.load(cp + HALF, mask=dm, other=0.0).to(tl.float32)[None, :]
    s1 = tl.load(sp, mask=dm, other=0.0).to(tl.float32)[None, :]
    s2 = tl.load(sp + HALF, mask=dm, other=0.0).to(tl.float32)[None, :]
    _rotate_heads(Q + b * sqb + s * sqs, sqh, QO + b * sob + s * sos, soh, HQ, HALF, PASS,
                  d, dm, c1, c2, s1, s2, BLOCK_H, BLOCK_P, BACKWARD)
    _rotate_heads(K + b * skb + s * sks, skh, KO + b * spb + s * sps, sph, HK, HALF, PASS,
                  d, dm, c1, c2, s1, s2, BLOCK_H, BLOCK_P, BACKWARD)


@lru_cache(maxsize=None)
def _config(h: int, half: int, target: Target = CPU) -> tuple[int, int, int]:
    block_d = next_pow2(half)
    block_h = max(1, min(next_pow2(h), 2048 // block_d))
    return block_h, block_d, warps_for(2 * block_h * block_d, hi=8, warp_size=target.warp_size)


_rope = Launcher(_rope_fwd_kernel)


def _dense_last(t: torch.Tensor) -> torch.Tensor:
    return t if t.stride(-1) == 1 else t.contiguous()


def _launch(q, k, cos, sin, backward: bool, out_dtype: torch.dtype | None):
    check_dtypes("rope", q=q, k=k, cos=cos, sin=sin)
    q, k, cos, sin = _dense_last(q), _dense_last(k), _dense_last(cos), _dense_last(sin)
    b, hq, s, d = q.shape
    hk = k.shape[1]
    qo, ko = empty_heads_inner(q, out_dtype), empty_heads_inner(k, out_dtype)  # (fp32 math, one rounding to it)
    if q.numel() == 0 and k.numel() == 0:
        return qo, ko
    rd = cos.shape[-1]  # < d: partial rotary, the rest copied through
    block_h, block_d, warps = _config(max(hq, hk), rd // 2, target_of(q))
    block_p = next_pow2(d - rd) if d > rd else 0
    # A broadcast batch dim of cos/sin (size 1) is read with stride 0.
    scb = cos.stride(0) if cos.shape[0] > 1 else 0
    ssb = sin.stride(0) if sin.shape[0] > 1 else 0
    _rope(
        (b * s,), q, k, cos, sin, qo, ko, s, hq, hk, rd // 2, d - rd,
        *q.stride()[:3], *k.stride()[:3], *qo.stride()[:3], *ko.stride()[:3],
        scb, cos.stride(1), ssb, sin.stride(1),
        BLOCK_H=block_h, BLOCK_D=block_d, BLOCK_P=block_p, BACKWARD=backward, num_warps=warps,
    )
    return qo, ko


def rope_fwd(q, k, cos, sin, out_dtype=None):
    return _launch(q, k, cos, sin, False, out_dtype)


def rope_bwd(dq, dk, cos, sin, out_dtype=None):
    return _launch(dq, dk, cos, sin, True, out_dtype)
