"""Linear + cross-entropy in Triton, chunked over tokens: the full logits never exist.

Per token n with hidden h (H), label y, logits l = h·Wᵀ + b (V), z = softcap·tanh(l/softcap) or l:
    loss_n = logsumexp(z) − z_y                      (0 when y == ignore_index; NaN, and a NaN
                                                      gradient, when y is outside [0, V))
    ∂loss_n/∂l = (softmax(z) − onehot(y)) · (1 − tanh²(l/softcap) if softcap) · scale
with scale = 1/#counted tokens ('mean') or 1 ('sum'). For an upstream gradient of 1:
    dh = dl · W,   dW = Σ_chunks dlᵀ · h,   db = Σ_tokens dl
Nothing is saved for the backward but these gradients (the ops layer scales them by dloss).

Per chunk of C tokens: cuBLAS writes the logits (C×V, input dtype, fp32 accumulation). One Triton
program per token then reads its row once and writes back, in place, q = exp(z − m)·(1 − t²)
against a reference m fixed per row (the larger of z_y and the first block's max; raised, and the
row's earlier part rescaled, only if a later block exceeds it by RANGE), and at the target column
(exp(z_y − m) − Σexp(z − m))·(1 − t_y²). With S = Σexp(z − m) and a_n = scale_n / S_n the row's
dl is a_n·q_n, so the GEMMs read q and the per-row a_n goes elsewhere:
    dh_n = a_n · (q_n · W)    (cuBLAS, fp32 out; a small kernel scales and rounds once)
    dW  += qᵀ · (a ⊙ h)        db += Σ_n a_n q_n
One read and one write of the logits, where writing softmax − onehot takes two reads and a write
(what the kernel does for fp16, whose range q and S can pass: there a_n = scale_n).
Extra memory: one chunk of logits, its C×H scaled copies, and the gradients, held near EXTRA_BYTES; a trained
head's chunk may hold as many bytes of logits as its dW (DW_CHUNK_RATIO). A vocabulary whose logits rows are not
a multiple of 16 bytes adds a copy of W padded with zero rows (``_padded``), for cuBLAS's aligned kernels.

FP8 (``fp8`` "rowwise" / "tensorwise"; bf16 operands, tokens, H and V multiples of 16, checked by the
caller): the three products run as e4m3 GEMMs (``_fp8_gemm.mm``, ``torch._scaled_mm``), each operand
quantised by fp8_quant.py along the product's inner dimension (per row, or one scale a tensor):
    z   = q(h)·q(W)ᵀ          h (C×H) and W (V×H) along H; W's two copies made once per call
    dh  = a ⊙ (q(g)·q(Wᵀ)ᵀ)   g (C×V) and Wᵀ (H×V) along V; fp32 out, rounded once by the row kernel
    dW += q(gᵀ)·q(hsᵀ)ᵀ       gᵀ (V×C) and hsᵀ = (a ⊙ h)ᵀ (H×C) along the chunk's tokens
where g is what the CE kernel writes over the logits in its two-pass form (the fp16 one):
softmax − onehot itself, a_n = scale_n. The one-pass q = S_n·(softmax − onehot) would carry each
row's Σexp (1 to V·e^32) into the values: one scale for all of q (tensorwise), or per vocabulary
column across tokens (dW's qᵀ), would then be set by the rows of large S and flush a confident
row's gradient (a wrong, confident prediction: S ≈ 1, and the largest gradient) to e4m3's
subnormals. The second pass costs one more read of the chunk's logits. dW stays in the weight's
dtype: the first chunk's product is dW, the others' are added (one rounding more a chunk than
``addmm_``'s; far below e4m3's), their V×H product held meanwhile; db is the bf16 sum as without FP8.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from .. import _fp8_gemm
from .._gemm import fp32_out_ok
from ._common import Launcher, cdiv, check_dtypes, next_pow2, target_of, warps_as_threads
from ._math import tanh
from .fp8_quant import fp8_quantize, fp8_quantize_both

# The op's extra memory (one chunk of logits + the dh, dW, db it returns) is held near
# EXTRA_BYTES; a chunk's logits get at least MIN_CHUNK_BYTES. Measured on an H200
# (benchmarks/probes/lce_probe.py, NOTES-triton.md): chunks of 1024–2048 tokens run at the same speed,
# token counts that are not a multiple of 512 (1408, 1664) up to 10% slower, and fewer than
# ~1000 tokens per chunk slower again (the chunks this gives at the benchmark models' heads: NOTES-triton.md).
EXTRA_BYTES = 960 << 20
MIN_CHUNK_BYTES = 128 << 20
# Where dW sums over the chunks, each chunk after the first reads and writes all of dW again: a chunk's
# logits get at least DW_CHUNK_RATIO × dW's bytes, or that traffic outgrows the chunks' own work. Without
# this floor a large head's gradient left little of EXTRA_BYTES to the logits: Gemma-2B's 256k × 2048 head
# ran 32 chunks of 256 tokens, 32 ms a step of dW additions on an H100 (11 % of the step; NOTES-families.md).
DW_CHUNK_RATIO = 1.0
# FP8's chunks: at least this many tokens (each chunk adds its V × H dW product into dW, and its GEMMs run
# below their rate at a few hundred rows).
FP8_MIN_CHUNK = 1024
# The CE kernel's block and warps: the fastest of the configurations swept on an H200 (NOTES-triton.md).
_BLOCK_V = 1024
_WARPS = 4
# How far (in nats) a row's logits may exceed its reference m before m is raised: q ≤ e^32 and
# S ≤ V·e^32 stay far inside fp32 and bf16, and a_n = scale/S far above their smallest normals.
_RANGE = 32.0


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
    Z, stride_z, B, LABELS, LOSS, ROW_SCALE, REF, stride_ref, NVALID, V, ignore_index, softcap,
    HAS_BIAS: tl.constexpr, SOFTCAP: tl.constexpr, NEED_GRAD: tl.constexpr, MEAN: tl.constexpr,
    BLOCK_V: tl.constexpr, RANGE: tl.constexpr, ONE_PASS: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    z_row = Z + row * stride_z
    ref_row = REF + row * stride_ref
    label = tl.load(LABELS + row)
    valid = label != ignore_index
    # A label outside [0, V) (not ignore_index): a host check would wait for the device, so the
    # row's loss and gradient scale are NaN instead, and column 0 is read in place of the label's.
    outside = valid & ((label < 0) | (label >= V))
    target = tl.where(valid & ~outside, label, 0)
    cols = tl.arange(0, BLOCK_V)

    # The target logit, read before the row is overwritten. A confident row's max is often z_y.
    y = tl.load(z_row + target).to(tl.float32)
    if HAS_BIAS:
        y += tl.load(B + target).to(tl.float32)
    t_y = y
    if SOFTCAP:
        t_y = tanh(y / softcap)
        y = softcap * t_y

    m = y
    s = tl.zeros([BLOCK_V], dtype=tl.float32)  # per-lane Σ exp(z − m), merged once at the end
    for start in range(0, V, BLOCK_V):
        c = start + cols
        mask = c < V
        z, t = _logit(z_row, B, c, mask, softcap, HAS_BIAS, SOFTCAP)
        top = tl.max(z, axis=0)
        m = tl.where(start == 0, tl.maximum(m, top), m)
        if top > m + RANGE:  # rare: raise m; the blocks written so far are rescaled after the loop
            s = s * tl.exp(m - top)
            m = top
        e = tl.exp(z - m)  # masked lanes: exp(−inf) = 0
        s += e
        if NEED_GRAD and ONE_PASS:
            if SOFTCAP:
                e = e * (1.0 - t) * (1.0 + t)
            tl.store(z_row + c, e.to(Z.dtype.element_ty), mask=mask)  # the target's too: rewritten below
            tl.store(ref_row + start // BLOCK_V, m)  # the reference this block was written against
    total = tl.sum(s, axis=0)  # ≥ 1: the column that set m is in it
    tl.store(LOSS + row, tl.where(outside, float("nan"), tl.where(valid, m + tl.log(total) - y, 0.0)))

    if NEED_GRAD:
        if MEAN:
            scale = 1.0 / tl.load(NVALID).to(tl.float32)
        else:
            scale = 1.0
        scale = tl.where(outside, float("nan"), tl.where(valid, scale, 0.0))
    if NEED_GRAD and not ONE_PASS:  # fp16: q and S may pass its 65504, so dl itself (a_n = scale)
        lse = m + tl.log(total)
        for start in range(0, V, BLOCK_V):
            c = start + cols
            mask = c < V
            z, t = _logit(z_row, B, c, mask, softcap, HAS_BIAS, SOFTCAP)
            g = tl.exp(z - lse) - (c == target).to(tl.float32)
            if SOFTCAP:
                g = g * (1.0 - t) * (1.0 + t)
            tl.store(z_row + c, g.to(Z.dtype.element_ty), mask=mask)
        tl.store(ROW_SCALE + row, scale)
    if NEED_GRAD and ONE_PASS:
        # Every thread's stores of the row land before the ones below (a block barrier orders
        # global memory within the program); a mask per column would also cost the stores their
        # vector width (one element an instruction: 2.4× slower on an H200).
        tl.debug_barrier()
        if tl.load(ref_row) < m:  # m was raised: bring the blocks written before to the final m
            for start in range(0, V, BLOCK_V):
                ref = tl.load(ref_row + start // BLOCK_V)
                if ref < m:
                    c = start + cols
                    q = tl.load(z_row + c, mask=c < V, other=0.0).to(tl.float32)
                    tl.store(z_row + c, (q * tl.exp(ref - m)).to(Z.dtype.element_ty), mask=c < V)
            tl.debug_barrier()
        g_y = tl.exp(y - m) - total  # (p_y − 1)·S, without the cancellation of p_y − 1 in bf16
        if SOFTCAP:
            g_y = g_y * (1.0 - t_y) * (1.0 + t_y)
        tl.store(z_row + target, g_y.to(Z.dtype.element_ty))
        tl.store(ROW_SCALE + row, scale / total)


def ce_rows(z, bias, labels, losses, row_scale, nvalid, ignore_index, softcap, need_grad, mean, normalised=False):
    """The CE kernel over the rows of one chunk's logits ``z`` (C×V), one program per row: losses,
    and (need_grad) q in place of the logits and a_n in ``row_scale``; with ``normalised`` (FP8)
    softmax − onehot in place of q (two passes, as for fp16). (Fewer programs walking rows
    in turn ran at 43–86% of this one's speed on an H200, with or without eviction hints; several
    programs a row that wait for each other, slower still: NOTES-triton.md.)"""
    rows, v = z.shape
    block = min(_BLOCK_V, next_pow2(v))
    one_pass = z.dtype != torch.float16 and not normalised  # fp16's range is too small for q and S
    # Each block's reference m (a few bytes a row), for the rare row whose m is raised midway.
    ref = torch.empty((rows, cdiv(v, block)) if need_grad and one_pass else (1, 1), dtype=torch.float32,
                      device=z.device)
    _ce_kernel(
        (rows,), z, z.stride(0), z if bias is None else bias, labels, losses, row_scale, ref, ref.stride(0), nvalid,
        v, int(ignore_index), 1.0 if softcap is None else float(softcap),
        HAS_BIAS=bias is not None, SOFTCAP=softcap is not None, NEED_GRAD=bool(need_grad), MEAN=mean,
        BLOCK_V=block, RANGE=_RANGE, ONE_PASS=one_pass, num_warps=warps_as_threads(_WARPS, target_of(z)),
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


@triton.jit
def _row_scale_kernel(G, stride_g, X, stride_x, A, DH, stride_dh, XS, H, BLOCK_H: tl.constexpr):
    # dh = a ⊙ g (g: q·W in fp32, rounded once here) and xs = a ⊙ x, for one row's block of columns.
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
    mask = cols < H
    a = tl.load(A + row)
    g = tl.load(G + row * stride_g + cols, mask=mask).to(tl.float32)
    tl.store(DH + row * stride_dh + cols, (a * g).to(DH.dtype.element_ty), mask=mask)
    x = tl.load(X + row * stride_x + cols, mask=mask).to(tl.float32)
    tl.store(XS + row * H + cols, (a * x).to(XS.dtype.element_ty), mask=mask)


_row_scale = Launcher(_row_scale_kernel)


def _times_w(q, weight):
    """q·W with an fp32 result where cuBLAS can give one (the row-scale kernel then rounds once)."""
    if q.dtype == torch.float32:
        return torch.mm(q, weight)
    if fp32_out_ok(q.device):
        return torch.mm(q, weight, out_dtype=torch.float32)
    if q.device.type == "cpu":  # Triton's interpreter in the tests: what cuBLAS computes
        return torch.mm(q.float(), weight.float())
    return torch.mm(q, weight)  # no fp32-output GEMM on this device: one rounding more


def _chunk_grads(q, h, weight, a, dh, dw, db, first):
    """A chunk's share of the gradients from q (dl = a ⊙ q, in place of its logits): its rows of
    dh, and its terms of dW and db (written by the first chunk, added by the others; none where
    ``dw`` is None: a frozen head). q and ``weight`` may run past the vocabulary (dW's rows) in columns and rows
    (``_padded``: zeros there)."""
    rows, hdim = h.shape
    hs = torch.empty(h.shape, dtype=h.dtype, device=h.device)  # a ⊙ h (written by the kernel even where unused)
    g = _times_w(q, weight)
    block = min(4096, next_pow2(hdim))
    _row_scale((rows, cdiv(hdim, block)), g, g.stride(0), h, h.stride(0), a, dh, dh.stride(0), hs, hdim,
               BLOCK_H=block, num_warps=warps_as_threads(4, target_of(h)))
    del g
    if dw is None:
        pass
    elif first:
        torch.mm(q[:, :dw.shape[0]].t(), hs, out=dw)
    else:
        dw.addmm_(q[:, :dw.shape[0]].t(), hs)
    if db is not None:
        # Σ_n a_n q_n, with a split into two rounded parts so that the sum sees a to ~2⁻¹⁶.
        hi = a.to(q.dtype)
        db += _times_w(torch.stack([hi, (a - hi.float()).to(q.dtype)]), q).sum(0)[:db.shape[0]]


def _padded(weight):
    """W with zero rows up to a vocabulary whose logits rows are a multiple of 16 bytes, or W itself where they
    are. Unaligned rows (GPT-2's 50257 tokens) leave cuBLAS only its align-1 kernels for the three GEMMs of
    every chunk: GPT-2-medium's head took 20 ms a step on an H100 that way, against 3 ms for torch.compile's
    padded GEMMs (NOTES-families.md). The zero rows give zero logits, which the CE kernel never reads (it
    stops at the vocabulary's size), zero q·W terms, and dW rows that are never formed."""
    align = max(1, 16 // weight.element_size())
    v, hdim = weight.shape
    if v % align == 0:
        return weight
    return torch.cat([weight, weight.new_zeros(align - v % align, hdim)])


def _chunk_grads_fp8(g, h, qwt, a, dh, dw, db, tensorwise, dw_dtype, weight_grad=True):
    """``_chunk_grads`` with FP8 products (module docstring): g is the chunk's softmax − onehot and a
    its a_n; returns dW (this chunk's product where ``dw`` is None, the first chunk; else dw, added to), or None
    without ``weight_grad``."""
    rows, hdim = h.shape
    qg, qgt = fp8_quantize_both(g, tensorwise)  # along V for dh; transposed, along the tokens, for dW
    prod = _fp8_gemm.mm(qg, qwt, torch.float32)
    del qg
    hs = torch.empty(h.shape, dtype=h.dtype, device=h.device)  # a ⊙ h
    block = min(4096, next_pow2(hdim))
    _row_scale((rows, cdiv(hdim, block)), prod, prod.stride(0), h, h.stride(0), a, dh, dh.stride(0), hs, hdim,
               BLOCK_H=block, num_warps=warps_as_threads(4, target_of(h)))
    del prod
    if not weight_grad:  # a frozen head: dh alone
        return None
    part = _fp8_gemm.mm(qgt, fp8_quantize(hs, tensorwise, True), dw_dtype)
    del qgt, hs
    if db is not None:
        hi = a.to(g.dtype)
        db += _times_w(torch.stack([hi, (a - hi.float()).to(g.dtype)]), g).sum(0)
    return part if dw is None else dw.add_(part)


def linear_cross_entropy_scale_(grads, scale):
    """The backward's scaling of the saved gradients by dloss (a device scalar), in place: one
    vectorised pass each, none when dloss is 1 (read on the device, no host sync). PyTorch's
    ``g.mul_(scale)`` broadcasts the 0-dim tensor through a non-vectorised kernel at about half the
    copy bandwidth (measured on qwen05b's dW: NOTES-triton.md)."""
    for g in grads:
        if g.numel() == 0:
            continue
        if not g.is_contiguous():
            g.mul_(scale)
            continue
        _scale((cdiv(g.numel(), _SCALE_BLOCK),), g, scale, g.numel(), BLOCK=_SCALE_BLOCK,
               num_warps=warps_as_threads(8, target_of(g)))


def chunks(n: int, most: int) -> list[tuple[int, int]]:
    """(start, rows) of each chunk: as few as ``most`` rows allow, their sizes as even as multiples
    of 512 tokens make them (8192 tokens at most 1536: 4 × 1536 + 2 × 1024, not 5 × 1536 + 512,
    whose last chunk's GEMMs would run far below the others' rate)."""
    if most >= n:
        return [(0, n)]
    # 16: FP8's chunks (its GEMMs take multiples of 16 rows; the caller makes n one too)
    unit = 512 if most % 512 == 0 else 64 if most % 64 == 0 else 16 if most % 16 == 0 else 1
    units, rest = divmod(n, unit)
    count = -(-n // most)
    out, start = [], 0
    for i in range(count):
        size = (units // count + (i < units % count)) * unit + (rest if i == count - 1 else 0)
        out.append((start, size))
        start += size
    return out


def chunk_rows(n: int, v: int, itemsize: int, grad_bytes: int, hidden: int = 0, fp8: bool = False,
               dw_bytes: int = 0) -> int:
    """Tokens per chunk: the most whose logits (and, for a ``hidden`` wide input, the fp32 q·W and
    the scaled input; with ``fp8`` their e4m3 copies too) fit in what EXTRA_BYTES leaves beside the
    returned gradients, or in DW_CHUNK_RATIO × ``dw_bytes`` (a dW the chunks add into) where that is more,
    rounded down to a multiple of 512 when that many fit (cuBLAS's fast shapes);
    with ``fp8`` at least FP8_MIN_CHUNK tokens (multiples of 16: the FP8 GEMMs' rows)."""
    budget = max(MIN_CHUNK_BYTES, EXTRA_BYTES - grad_bytes, int(DW_CHUNK_RATIO * dw_bytes))
    per_token = itemsize * v + (4 + itemsize) * hidden
    if fp8:  # q's two e4m3 copies (when there are gradients), h's and hsᵀ's
        per_token += (2 * v if hidden else 0) + 2 * hidden
    most = max(FP8_MIN_CHUNK if fp8 else 1, budget // per_token)
    if most >= n:
        return n
    unit = 512 if most >= 512 else 64 if most >= 128 else 16 if fp8 else 1
    return most - most % unit


def linear_cross_entropy_fwd(hidden, weight, bias, labels, ignore_index, softcap, reduction, need_grad, fp8=None,
                             weight_grad=True):
    check_dtypes("linear_cross_entropy", hidden=hidden, weight=weight, bias=bias)
    if hidden.dtype != weight.dtype:
        raise TypeError(f"linear_cross_entropy: hidden and weight dtypes differ ({hidden.dtype}, {weight.dtype})")
    if reduction not in ("mean", "sum"):
        raise ValueError(f"linear_cross_entropy: reduction must be 'mean' or 'sum', got {reduction!r}")
    n, hdim = hidden.shape
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
        # With FP8 the first chunk's product is dW (see _chunk_grads_fp8): nothing to allocate yet.
        dw = torch.empty(weight.shape, dtype=weight.dtype, device=dev) if fp8 is None and weight_grad else None
        if bias is not None and weight_grad:
            db = torch.zeros(v, dtype=torch.float32, device=dev)
    # (With FP8, W's e4m3 copies and a chunk's dW product are a fixed cost of FP8, not counted against
    # the chunks: counted, they left llama1b's head dozens of small chunks, whose small GEMMs and V × H
    # additions were far slower than bf16's few; NOTES-triton.md.)
    grad_bytes = dh.nbytes + db.nbytes + (weight.nbytes if need_grad and weight_grad else 0)
    tensorwise = fp8 == "tensorwise"
    if fp8 is not None:
        # W's e4m3 copies (two with gradients), made once for all chunks; with gradients a chunk's dW
        # product beside dW
        if need_grad:
            qw, qwt = fp8_quantize_both(weight, tensorwise)  # along H for the logits, Wᵀ along V for dh
        else:
            qw = fp8_quantize(weight, tensorwise, False)
    wmm = weight if fp8 is not None else _padded(weight)
    rows = chunk_rows(n, wmm.shape[0], hidden.element_size(), grad_bytes, hdim if need_grad else 0, fp8 is not None,
                      0 if dw is None else dw.nbytes)
    mean = reduction == "mean"
    row_scale = torch.empty(min(rows, n), dtype=torch.float32, device=dev)  # a_n of a chunk's tokens
    for start, size in chunks(n, rows):
        h = hidden[start:start + size]
        # Logits in the input dtype, as nn.Linear gives them (fp32 accumulation, one rounding);
        # the kernel works in fp32. bf16 logits halve its reads and double the tokens per chunk.
        if fp8 is None:
            z = torch.mm(h, wmm.t())
        else:
            z = _fp8_gemm.mm(fp8_quantize(h, tensorwise, False), qw, hidden.dtype)
        a = row_scale[:size]
        ce_rows(z[:, :v], bias, labels[start:start + size], losses[start:start + size], a, nvalid, ignore_index,
                softcap, need_grad, mean, normalised=fp8 is not None)
        with_db = bias is not None and weight_grad
        if need_grad and fp8 is not None:
            dw = _chunk_grads_fp8(z, h, qwt, a, dh[start:start + size], None if start == 0 else dw,
                                  db if with_db else None, tensorwise, weight.dtype, weight_grad)
        elif need_grad:
            _chunk_grads(z, h, wmm, a, dh[start:start + size], dw, db if with_db else None, start == 0)
        del z  # before the next chunk's logits are allocated: one chunk alive at a time
    loss = losses.sum()
    if mean:
        loss = loss / nvalid
    if need_grad and bias is not None and weight_grad:
        db = db.to(bias.dtype)
    if dw is None:  # no dW asked for (a frozen head): an empty, as the fake impl gives
        dw = hidden.new_empty(0)
    return loss, dh, dw, db
