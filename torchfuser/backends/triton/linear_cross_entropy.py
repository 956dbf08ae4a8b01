"""Linear + cross-entropy in Triton, chunked over tokens: the full logits never exist.

Per token n with hidden h (H), label y, logits l = h·Wᵀ + b (V), z = softcap·tanh(l/softcap) or l:
    loss_n = logsumexp(z) − z_y                      (0 when y == ignore_index)
    ∂loss_n/∂l = (softmax(z) − onehot(y)) · (1 − tanh²(l/softcap) if softcap) · scale
with scale = 1/#counted tokens ('mean') or 1 ('sum'). For an upstream gradient of 1:
    dh = dl · W,   dW = Σ_chunks dlᵀ · h,   db = Σ_tokens dl
Nothing is saved for the backward but these gradients (the ops layer scales them by dloss).

Per chunk of C tokens: cuBLAS writes the logits (C×V, input dtype, fp32 accumulation), one Triton
program per token makes two passes over its row in fp32 (online max/sum-exp, then softmax −
onehot) and writes dl back in place over the logits; cuBLAS then reads dl for dh and dW.
Extra memory: one chunk of logits + the gradients, held near EXTRA_BYTES.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from ._common import Launcher, cdiv, check_dtypes, next_pow2
from ._math import tanh

# The op's extra memory (one chunk of logits + the dh, dW, db it returns) is held near
# EXTRA_BYTES; a chunk's logits get at least MIN_CHUNK_BYTES. Measured on an H200
# (benchmarks/lce_probe.py, NOTES-triton.md): chunks of 1024–2048 tokens run at the same speed,
# token counts that are not a multiple of 512 (1408, 1664) up to 10% slower, and fewer than
# ~1000 tokens per chunk slower again. At 8192×2048×128256 bf16 this gives 1536-token chunks and
# 0.89 GiB; at 8192×896×151936, 2048-token chunks and 0.85 GiB.
EXTRA_BYTES = 960 << 20
MIN_CHUNK_BYTES = 128 << 20
_BLOCK_V = 4096
_WARPS = 8


@triton.jit
def _logit(Z, B, cols, mask, softcap, HAS_BIAS: tl.constexpr, SOFTCAP: tl.constexpr):
    """(z, l/softcap's tanh) for the given columns; masked lanes give z = −inf."""
    z = tl.load(Z + cols, mask=mask, other=0.0).to(tl.float32)
    if HAS_BIAS:
        z += tl.load(B + cols, mask=mask, other=0.0).to(tl.float32)
    t = z
    if SOFTCAP:
        t = tanh(z / softcap)
        z = softcap * t
    return tl.where(mask, z, float("-inf")), t


@triton.jit
def _linear_cross_entropy_fwd_kernel(
    Z, stride_z, B, LABELS, LOSS, NVALID, V, ignore_index, softcap,
    HAS_BIAS: tl.constexpr, SOFTCAP: tl.constexpr, NEED_GRAD: tl.constexpr, MEAN: tl.constexpr,
    BLOCK_V: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    z_row = Z + row * stride_z
    label = tl.load(LABELS + row)
    valid = label != ignore_index
    target = tl.where(valid, label, 0)
    cols = tl.arange(0, BLOCK_V)

    # Pass 1: per-lane running max and sum of exp, merged once at the end. The max starts at a
    # finite floor so that all-masked lanes give exp(−inf − floor) = 0, never inf − inf = nan.
    m = tl.full([BLOCK_V], -1e30, dtype=tl.float32)
    s = tl.zeros([BLOCK_V], dtype=tl.float32)
    for start in range(0, V, BLOCK_V):
        c = start + cols
        z, _ = _logit(z_row, B, c, c < V, softcap, HAS_BIAS, SOFTCAP)
        m_new = tl.maximum(m, z)
        s = s * tl.exp(m - m_new) + tl.exp(z - m_new)
        m = m_new
    m_row = tl.max(m, axis=0)
    lse = m_row + tl.log(tl.sum(s * tl.exp(m - m_row), axis=0))

    # The target logit is read before pass 2 overwrites the row's bytes.
    z_y = tl.load(z_row + target).to(tl.float32)
    if HAS_BIAS:
        z_y += tl.load(B + target).to(tl.float32)
    if SOFTCAP:
        z_y = softcap * tanh(z_y / softcap)
    tl.store(LOSS + row, tl.where(valid, lse - z_y, 0.0))

    if NEED_GRAD:
        if MEAN:
            scale = 1.0 / tl.load(NVALID).to(tl.float32)
        else:
            scale = 1.0
        scale = tl.where(valid, scale, 0.0)
        # Pass 2 overwrites each block of logits with its dl after reading it.
        for start in range(0, V, BLOCK_V):
            c = start + cols
            mask = c < V
            z, t = _logit(z_row, B, c, mask, softcap, HAS_BIAS, SOFTCAP)
            g = tl.exp(z - lse) - (c == target).to(tl.float32)
            if SOFTCAP:
                g = g * (1.0 - t) * (1.0 + t)
            tl.store(z_row + c, (g * scale).to(Z.dtype.element_ty), mask=mask)


def ce_rows(z, bias, labels, losses, nvalid, ignore_index, softcap, need_grad, mean):
    """The CE kernel over the rows of one chunk's logits ``z`` (C×V), one program per row: losses,
    and dl in place. (Fewer programs walking rows in turn, so that pass 2 re-reads its row from L2,
    ran at 43–86% of this one's speed on an H200, with or without eviction hints: NOTES-triton.md.)"""
    rows, v = z.shape
    _ce_kernel(
        (rows,), z, z.stride(0), z if bias is None else bias, labels, losses, nvalid, v,
        int(ignore_index), 1.0 if softcap is None else float(softcap),
        HAS_BIAS=bias is not None, SOFTCAP=softcap is not None, NEED_GRAD=bool(need_grad), MEAN=mean,
        BLOCK_V=min(_BLOCK_V, next_pow2(v)), num_warps=_WARPS,
    )


_ce_kernel = Launcher(_linear_cross_entropy_fwd_kernel)


@triton.jit
def _scale_kernel(G, S, N, BLOCK: tl.constexpr):
    # g ← g · s in fp32, one rounding; nothing to do (each program exits) when s == 1.
    s = tl.load(S).to(tl.float32)
    if s != 1.0:
        offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
        mask = offs < N
        g = tl.load(G + offs, mask=mask, other=0.0).to(tl.float32)
        tl.store(G + offs, (g * s).to(G.dtype.element_ty), mask=mask)


_scale = Launcher(_scale_kernel)
_SCALE_BLOCK = 4096


def linear_cross_entropy_scale_(grads, scale):
    """The backward's scaling of the saved gradients by dloss (a device scalar), in place: one
    vectorised pass each, none when dloss is 1 (read on the device, no host sync). PyTorch's
    ``g.mul_(scale)`` broadcasts the 0-dim tensor through a non-vectorised kernel at about half the
    copy bandwidth (0.27 ms for qwen05b's 151936×896 bf16 dW on an H200, every step)."""
    for g in grads:
        if g.numel() == 0:
            continue
        if not g.is_contiguous():
            g.mul_(scale)
            continue
        _scale((cdiv(g.numel(), _SCALE_BLOCK),), g, scale, g.numel(), BLOCK=_SCALE_BLOCK, num_warps=8)


def chunks(n: int, most: int) -> list[tuple[int, int]]:
    """(start, rows) of each chunk: as few as ``most`` rows allow, their sizes as even as multiples
    of 512 tokens make them (8192 tokens at most 1536: 4 × 1536 + 2 × 1024, not 5 × 1536 + 512,
    whose last chunk's GEMMs would run far below the others' rate)."""
    if most >= n:
        return [(0, n)]
    unit = 512 if most % 512 == 0 else 64 if most % 64 == 0 else 1
    units, rest = divmod(n, unit)
    count = -(-n // most)
    out, start = [], 0
    for i in range(count):
        size = (units // count + (i < units % count)) * unit + (rest if i == count - 1 else 0)
        out.append((start, size))
        start += size
    return out


def chunk_rows(n: int, v: int, itemsize: int, grad_bytes: int) -> int:
    """Tokens per chunk: the most whose logits fit in what EXTRA_BYTES leaves beside the returned
    gradients, rounded down to a multiple of 512 when that many fit (cuBLAS's fast shapes)."""
    budget = max(MIN_CHUNK_BYTES, EXTRA_BYTES - grad_bytes)
    most = max(1, budget // (itemsize * v))
    if most >= n:
        return n
    unit = 512 if most >= 512 else 64 if most >= 128 else 1
    return most - most % unit


def linear_cross_entropy_fwd(hidden, weight, bias, labels, ignore_index, softcap, reduction, need_grad):
    check_dtypes("linear_cross_entropy", hidden=hidden, weight=weight, bias=bias)
    if hidden.dtype != weight.dtype:
        raise TypeError(f"linear_cross_entropy: hidden and weight dtypes differ ({hidden.dtype}, {weight.dtype})")
    if reduction not in ("mean", "sum"):
        raise ValueError(f"linear_cross_entropy: reduction must be 'mean' or 'sum', got {reduction!r}")
    n, _ = hidden.shape
    v = weight.shape[0]
    dev = hidden.device
    labels = labels.contiguous()
    losses = torch.empty(n, dtype=torch.float32, device=dev)
    nvalid = (labels != ignore_index).sum()  # stays on the device: no host sync, graph-capturable
    # Three distinct empties: a custom op's outputs may not alias one another.
    dh, dw, db = (hidden.new_empty(0) for _ in range(3))
    if need_grad:
        dh = torch.empty(hidden.shape, dtype=hidden.dtype, device=dev)
        # dW accumulates in the weight's dtype: an fp32 accumulator for a 128k×2k bf16 head would
        # alone cost 1 GiB. cuBLAS sums each chunk's product in fp32 and rounds once per chunk.
        dw = torch.empty(weight.shape, dtype=weight.dtype, device=dev)
        if bias is not None:
            db = torch.zeros(v, dtype=torch.float32, device=dev)
    rows = chunk_rows(n, v, hidden.element_size(), dh.nbytes + dw.nbytes + db.nbytes)
    mean = reduction == "mean"
    for start, size in chunks(n, rows):
        h = hidden[start:start + size]
        # Logits in the input dtype, as nn.Linear gives them (fp32 accumulation, one rounding);
        # the kernel works in fp32. bf16 logits halve its reads and double the tokens per chunk.
        z = torch.mm(h, weight.t())
        ce_rows(z, bias, labels[start:start + size], losses[start:start + size], nvalid, ignore_index, softcap,
                need_grad, mean)
        if need_grad:  # z now holds dl
            torch.mm(z, weight, out=dh[start:start + size])
            if start == 0:
                torch.mm(z.t(), h, out=dw)
            else:
                dw.addmm_(z.t(), h)
            if bias is not None:
                db += z.sum(0, dtype=torch.float32)
        del z  # before the next chunk's logits are allocated: one chunk alive at a time
    loss = losses.sum()
    if mean:
        loss = loss / nvalid
    if need_grad and bias is not None:
        db = db.to(bias.dtype)
    return loss, dh, dw, db
