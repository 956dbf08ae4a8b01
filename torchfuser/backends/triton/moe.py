"""Mixture-of-experts in Triton: the router's top-k, and the elementwise and gather passes around the
experts' grouped GEMMs (those stay PyTorch's: backends/reference/grouped_mm.py). Formulas, layouts and
the sort by expert: backends/reference/moe.py; these kernels compute the same, in fp32.

Route, a token's logits l (E ≤ MAX_EXPERTS experts, padded to a power of two with −inf), a few tokens a program:
    s = softmax(l) | sigmoid(l);   c = s (+ correction, for the choice only)  |  c = l (softmax_topk)
    for j < k:  i_j = argmax c (the lowest index of equal maxima), c[i_j] = −inf
    w = s[i], w /= Σw + 1e-20 (renorm)   |   w = softmax(l[i]) (softmax_topk: never renormalised)
    w *= scale                                               → weights (T, k) fp32, indices (T, k) int64
Saved for the backward (by the op): the logits and indices. Backward, g = scale · dw:
    softmax_topk: p = softmax(l[i]),  dl[i_j] = p_j · (g_j − Σ p·g), 0 elsewhere
    else:         ds[i_j] = (g_j − Σ g·w̃) / (Σ s[i] + 1e-20), w̃ = s[i] / (Σ s[i] + 1e-20) (renorm), else g_j;
                  dl = s · (ds − Σ s·ds) (softmax) or ds · s · (1 − s) (sigmoid)
Group-limited routing (n_group > 1) chooses through the reference backend; its weights' backward is this one.

Experts, the S = T·k slots sorted by expert (row r of a sorted tensor is slot order[r], expert e):
    h = x[token] · GUᵀ                                                        grouped GEMM
    h += b[e] (in h's dtype, written back: h is saved);  a = act(h)          _moe_act_fwd_kernel
    o = a · Dᵀ                                                                grouped GEMM
    y[t] = Σ_j w[t, j] · (o[inv[t·k + j]] + d[e])  (o + d in o's dtype; Σ in fp32, j in order)
                                                                              _moe_combine_kernel
act: h's halves g, u (gate_up, up_gate, interleaved) → silu(g)·u, gelu_tanh(g)·u, or GPT-OSS's clamped
SwiGLU (clamp(u, ±limit) + 1) · g'·σ(α·g') with g' = min(g, limit); math in fp32, a rounded once.
Saved for the backward (by the op): the inputs, h (its bias added), order and offs; not a, o or x[token].
Backward (ct = h's dtype, f = fp32):
    g = dy[token] (ct), gw = g · w (ct), Σ_n g · d[e] (f, with a down bias)    _moe_gather_scale_kernel
    u = g · D                                                                 grouped GEMM
    a = act(h);  dh = act's vjp at h of (u · w rounded to ct), rounded to ct;
    dweights[slot] = Σ_i u · a + Σ_n g · d[e]   (f; written in slot order)   _moe_act_bwd_kernel
    dD = aᵀ gw, dGU = dhᵀ x[token] (grouped GEMMs), the bias gradients (index_add_) as the reference
    dx[t] = Σ_j (dh · GU)[inv[t·k + j]]                                       _moe_combine_kernel, unit weights
No (S, N) temporary but the GEMMs' operands and outputs: the weight scaling, the bias adds, the
activation and its vjp, the per-slot reductions and the un-permuting sums all run inside the kernels.
fp64 (the test oracle's dtype) and anything else these kernels do not cover run the reference backend.
"""
from __future__ import annotations

from functools import lru_cache

import torch
import triton
import triton.language as tl

from ..reference import grouped_mm as gmm, moe as R
from ._common import CPU, SUPPORTED, Launcher, Target, cdiv, next_pow2, target_of, warps_for
from .gated import _gelu_tanh, _silu

MAX_EXPERTS = 1024  # the router kernels hold a token's E scores in registers; more experts: the reference
_RENORM_EPS = tl.constexpr(R._RENORM_EPS)
_SCORING = {"softmax": 0, "sigmoid": 1, "softmax_topk": 2}
_ACT = {"silu": 0, "gelu_tanh": 1, "clamped_swiglu": 2}
_ROUTE_TILE = 2048  # scores a router program holds (a few fp32 tiles of it live at once)
_TILE = 4096  # elements a program of the elementwise / gather kernels handles at once
_LOOP_TILE = 2048  # a tile of the kernels that loop over a row's columns (a per-row reduction)
_BLOCK = 1024  # widest column block


# ---------------------------------------------------------------- router

@triton.jit
def _scores(l, SCORING: tl.constexpr):
    # l: fp32, −inf in the padding columns (exp gives 0 there); softmax_topk scores are the logits.
    if SCORING == 0:
        p = tl.exp(l - tl.max(l, axis=1)[:, None])
        return p / tl.sum(p, axis=1)[:, None]
    elif SCORING == 1:
        return tl.sigmoid(l)
    else:
        return l


@triton.jit
def _softmax_k(v, kmask):
    v = tl.where(kmask, v, float("-inf"))
    p = tl.exp(v - tl.max(v, axis=1)[:, None])
    p = tl.where(kmask, p, 0.0)
    return p / tl.sum(p, axis=1)[:, None]


@triton.jit
def _moe_route_fwd_kernel(
    L, C, W, IDX, T, E, K, stride_l, scale,
    SCORING: tl.constexpr, RENORM: tl.constexpr, HAS_CORR: tl.constexpr,
    ROWS: tl.constexpr, BLOCK_E: tl.constexpr, BLOCK_K: tl.constexpr,
):
    rows = (tl.program_id(0) * ROWS + tl.arange(0, ROWS)).to(tl.int64)
    row_ok = rows < T
    cols = tl.arange(0, BLOCK_E)
    col_ok = cols < E
    kcols = tl.arange(0, BLOCK_K)
    kmask = row_ok[:, None] & (kcols < K)[None, :]
    # Rows past T read zeros (finite: no NaN from a softmax of −infs); padding columns are −inf.
    l = tl.load(L + rows[:, None] * stride_l + cols[None, :], mask=row_ok[:, None] & col_ok[None, :], other=0.0)
    l = tl.where(col_ok[None, :], l.to(tl.float32), float("-inf"))
    s = _scores(l, SCORING)
    c = s
    if HAS_CORR:
        c = s + tl.load(C + cols, mask=col_ok, other=0.0).to(tl.float32)[None, :]
    avail = col_ok[None, :] & (rows >= 0)[:, None]  # [ROWS, BLOCK_E]: not chosen yet
    # A NaN score or choice: torch.topk ranks NaN first, so the model's weights come out NaN; here the
    # max would pass over it and give finite weights from a NaN input. The row's weights are made NaN.
    bad = tl.max(tl.where(avail & ((s != s) | (c != c)), 1, 0), axis=1) > 0
    wk = tl.zeros([ROWS, BLOCK_K], dtype=tl.float32)
    ik = tl.zeros([ROWS, BLOCK_K], dtype=tl.int32)
    for j in range(K):
        cm = tl.where(avail, c, float("-inf"))
        m = tl.max(cm, axis=1)
        i = tl.min(tl.where(avail & (cm == m[:, None]), cols[None, :], BLOCK_E), axis=1)
        # No score equals the max only with NaN scores: take the first one still free (in range).
        i = tl.where(i < BLOCK_E, i, tl.min(tl.where(avail, cols[None, :], BLOCK_E), axis=1))
        sel = cols[None, :] == i[:, None]
        v = tl.sum(tl.where(sel, s, 0.0), axis=1)
        wk = tl.where(kcols[None, :] == j, v[:, None], wk)
        ik = tl.where(kcols[None, :] == j, i[:, None], ik)
        avail = avail & ~sel
    if SCORING == 2:
        wk = _softmax_k(wk, (kcols < K)[None, :])  # columns only: rows past T stay finite
    elif RENORM:
        wk = wk / (tl.sum(wk, axis=1)[:, None] + _RENORM_EPS)
    wk = tl.where(bad[:, None], float("nan"), wk)
    out = rows[:, None] * K + kcols[None, :]
    tl.store(W + out, wk * scale, mask=kmask)
    tl.store(IDX + out, ik.to(tl.int64), mask=kmask)


@triton.jit
def _moe_route_bwd_kernel(
    DW, L, IDX, DL, T, E, K, stride_l, stride_dw, scale,
    SCORING: tl.constexpr, RENORM: tl.constexpr, ROWS: tl.constexpr, BLOCK_E: tl.constexpr, BLOCK_K: tl.constexpr,
):
    rows = (tl.program_id(0) * ROWS + tl.arange(0, ROWS)).to(tl.int64)
    row_ok = rows < T
    cols = tl.arange(0, BLOCK_E)
    col_ok = cols < E
    mask = row_ok[:, None] & col_ok[None, :]
    kcols = tl.arange(0, BLOCK_K)
    kmask = row_ok[:, None] & (kcols < K)[None, :]
    l = tl.load(L + rows[:, None] * stride_l + cols[None, :], mask=mask, other=0.0)
    l = tl.where(col_ok[None, :], l.to(tl.float32), float("-inf"))
    s = _scores(l, SCORING)
    g = tl.load(DW + rows[:, None] * stride_dw + kcols[None, :], mask=kmask, other=0.0).to(tl.float32) * scale
    # The chosen scores (logits for softmax_topk), gathered into [ROWS, BLOCK_K].
    sk = tl.zeros([ROWS, BLOCK_K], dtype=tl.float32)
    for j in range(K):
        i = tl.load(IDX + rows * K + j, mask=row_ok, other=0)
        v = tl.sum(tl.where(cols[None, :] == i[:, None], s, 0.0), axis=1)
        sk = tl.where(kcols[None, :] == j, v[:, None], sk)
    if SCORING == 2:
        p = _softmax_k(sk, (kcols < K)[None, :])
        dk = p * (g - tl.sum(p * g, axis=1)[:, None])
    elif RENORM:
        den = tl.sum(sk, axis=1)[:, None] + _RENORM_EPS
        dk = (g - tl.sum(g * (sk / den), axis=1)[:, None]) / den
    else:
        dk = g
    dk = tl.where(kmask, dk, 0.0)
    # Scattered back to the experts (a sum: a repeated index gets both, as autodiff gives).
    d = tl.zeros([ROWS, BLOCK_E], dtype=tl.float32)
    for j in range(K):
        i = tl.load(IDX + rows * K + j, mask=row_ok, other=0)
        dj = tl.sum(tl.where(kcols[None, :] == j, dk, 0.0), axis=1)
        d += tl.where(cols[None, :] == i[:, None], dj[:, None], 0.0)
    if SCORING == 0:
        s0 = tl.where(col_ok[None, :], s, 0.0)
        d = s0 * (d - tl.sum(s0 * d, axis=1)[:, None])
    elif SCORING == 1:
        d = d * s * (1.0 - s)
    tl.store(DL + rows[:, None] * E + cols[None, :], d.to(DL.dtype.element_ty), mask=mask)


@lru_cache(maxsize=None)
def route_config(e: int, k: int, target: Target = CPU) -> tuple[int, int, int, int]:
    """(ROWS, BLOCK_E, BLOCK_K, num_warps) of the router kernels for E experts and top-k."""
    block_e, block_k = max(2, next_pow2(e)), max(2, next_pow2(k))
    rows = max(1, min(64, _ROUTE_TILE // block_e))
    return rows, block_e, block_k, warps_for(rows * block_e, hi=8, warp_size=target.warp_size)


def _route_kernels_take(logits, scoring: str) -> bool:
    return (logits.dtype in SUPPORTED and logits.dim() == 2 and logits.numel() > 0
            and logits.shape[-1] <= MAX_EXPERTS and scoring in _SCORING)


def _dense_rows(t):
    return t if t.stride(-1) == 1 or t.shape[-1] == 1 else t.contiguous()


_route_fwd, _route_bwd = Launcher(_moe_route_fwd_kernel), Launcher(_moe_route_bwd_kernel)


def moe_route_fwd(logits, correction, top_k, scoring, renorm, n_group, topk_group, group_top, scale):
    grouped = n_group > 1 and scoring != "softmax_topk"  # softmax_topk chooses from the logits, ungrouped
    if grouped or not _route_kernels_take(logits, scoring):
        return R.moe_route_fwd(logits, correction, top_k, scoring, renorm, n_group, topk_group, group_top, scale)
    t, e = logits.shape
    l = _dense_rows(logits)
    has_corr = correction is not None and scoring != "softmax_topk"
    corr = correction.contiguous() if has_corr else None
    if has_corr and corr.dtype not in SUPPORTED:  # added in fp32, as the reference does
        corr = corr.float()
    w = torch.empty((t, top_k), dtype=torch.float32, device=logits.device)
    idx = torch.empty((t, top_k), dtype=torch.int64, device=logits.device)
    rows, block_e, block_k, warps = route_config(e, top_k, target_of(logits))
    _route_fwd((cdiv(t, rows),), l, corr if has_corr else w, w, idx, t, e, top_k, l.stride(0), float(scale),
               SCORING=_SCORING[scoring], RENORM=bool(renorm), HAS_CORR=has_corr,
               ROWS=rows, BLOCK_E=block_e, BLOCK_K=block_k, num_warps=warps)
    return w, idx


def moe_route_bwd(dw, logits, indices, scoring, renorm, scale):
    if not _route_kernels_take(logits, scoring) or dw.dtype not in SUPPORTED:
        return R.moe_route_bwd(dw, logits, indices, scoring, renorm, scale)
    t, e = logits.shape
    k = indices.shape[-1]
    l, d, idx = _dense_rows(logits), _dense_rows(dw), indices.contiguous()
    dl = torch.empty((t, e), dtype=logits.dtype, device=logits.device)
    rows, block_e, block_k, warps = route_config(e, k, target_of(logits))
    _route_bwd((cdiv(t, rows),), d, l, idx, dl, t, e, k, l.stride(0), d.stride(0), float(scale),
               SCORING=_SCORING[scoring], RENORM=bool(renorm), ROWS=rows, BLOCK_E=block_e, BLOCK_K=block_k,
               num_warps=warps)
    return dl


# ---------------------------------------------------------------- experts

@triton.jit
def _act(g, u, ACT: tl.constexpr, alpha, limit):
    if ACT == 0:
        a, _ = _silu(g)
        return a * u
    elif ACT == 1:
        a, _ = _gelu_tanh(g)
        return a * u
    else:
        gc = tl.minimum(g, limit)
        uc = tl.minimum(tl.maximum(u, -limit), limit)
        return (uc + 1.0) * (gc * tl.sigmoid(gc * alpha))


@triton.jit
def _act_vjp(g, u, da, ACT: tl.constexpr, alpha, limit):
    # (a, dg, du) for a = act(g, u) and the cotangent da, all fp32.
    if ACT == 2:
        # The clamps pass the gradient where the value is inside them, bounds included (as autograd's).
        gc = tl.minimum(g, limit)
        uc = tl.minimum(tl.maximum(u, -limit), limit)
        sg = tl.sigmoid(gc * alpha)
        glu = gc * sg
        dg = tl.where(g <= limit, da * (uc + 1.0) * (sg + alpha * glu * (1.0 - sg)), 0.0)
        du = tl.where((u >= -limit) & (u <= limit), da * glu, 0.0)
        return (uc + 1.0) * glu, dg, du
    else:
        if ACT == 0:
            f, df = _silu(g)
        else:
            f, df = _gelu_tanh(g)
        return f * u, da * u * df, da * f


@triton.jit
def _moe_act_fwd_kernel(
    H, B, IDS, A, S, I, stride_h, stride_b, alpha, limit, G0, U0,
    ACT: tl.constexpr, STEP: tl.constexpr, HAS_BIAS: tl.constexpr, ROWS: tl.constexpr, BLOCK_I: tl.constexpr,
):
    # Gate column c of a row is h[G0 + c·STEP], up h[U0 + c·STEP] (STEP 2: interleaved halves).
    rows = (tl.program_id(0) * ROWS + tl.arange(0, ROWS)).to(tl.int64)
    row_ok = rows < S
    cols = tl.program_id(1) * BLOCK_I + tl.arange(0, BLOCK_I)
    mask = row_ok[:, None] & (cols < I)[None, :]
    go, uo = G0 + cols[None, :] * STEP, U0 + cols[None, :] * STEP
    h_rows = H + rows[:, None] * stride_h
    g = tl.load(h_rows + go, mask=mask, other=0.0)
    u = tl.load(h_rows + uo, mask=mask, other=0.0)
    if HAS_BIAS:
        # As the reference's h + b.to(h.dtype)[e]: the bias rounded to h's dtype, the sum rounded once;
        # written back, as it is the h saved for the backward (computed values used, h never re-read).
        e = tl.load(IDS + rows, mask=row_ok, other=0)
        b_rows = B + e[:, None] * stride_b
        bg = tl.load(b_rows + go, mask=mask, other=0.0).to(H.dtype.element_ty)
        bu = tl.load(b_rows + uo, mask=mask, other=0.0).to(H.dtype.element_ty)
        g = (g.to(tl.float32) + bg.to(tl.float32)).to(H.dtype.element_ty)
        u = (u.to(tl.float32) + bu.to(tl.float32)).to(H.dtype.element_ty)
        tl.store(h_rows + go, g, mask=mask)
        tl.store(h_rows + uo, u, mask=mask)
    a = _act(g.to(tl.float32), u.to(tl.float32), ACT, alpha, limit)
    tl.store(A + rows[:, None] * I + cols[None, :], a.to(A.dtype.element_ty), mask=mask)


@triton.jit
def _moe_act_bwd_kernel(
    H, U, ORDER, W, DWSB, DH, A, DW, S, I, stride_h, alpha, limit, G0, U0,
    ACT: tl.constexpr, STEP: tl.constexpr, HAS_DWSB: tl.constexpr, ROWS: tl.constexpr, BLOCK_I: tl.constexpr,
):
    rows = (tl.program_id(0) * ROWS + tl.arange(0, ROWS)).to(tl.int64)
    row_ok = rows < S
    slot = tl.load(ORDER + rows, mask=row_ok, other=0)
    w = tl.load(W + slot, mask=row_ok, other=0.0).to(tl.float32)
    h_rows, dh_rows = H + rows[:, None] * stride_h, DH + rows[:, None] * stride_h
    acc = tl.zeros([ROWS, BLOCK_I], dtype=tl.float32)
    for start in range(0, I, BLOCK_I):
        cols = start + tl.arange(0, BLOCK_I)
        mask = row_ok[:, None] & (cols < I)[None, :]
        go, uo = G0 + cols[None, :] * STEP, U0 + cols[None, :] * STEP
        g = tl.load(h_rows + go, mask=mask, other=0.0).to(tl.float32)
        up = tl.load(h_rows + uo, mask=mask, other=0.0).to(tl.float32)
        u = tl.load(U + rows[:, None] * I + cols[None, :], mask=mask, other=0.0).to(tl.float32)
        # The cotangent of a is u·w rounded to the products' dtype, as the reference's vjp receives it.
        da = (u * w[:, None]).to(H.dtype.element_ty).to(tl.float32)
        a, dg, du = _act_vjp(g, up, da, ACT, alpha, limit)
        a = a.to(A.dtype.element_ty)
        tl.store(A + rows[:, None] * I + cols[None, :], a, mask=mask)
        tl.store(dh_rows + go, dg.to(DH.dtype.element_ty), mask=mask)
        tl.store(dh_rows + uo, du.to(DH.dtype.element_ty), mask=mask)
        acc += u * a.to(tl.float32)  # ⟨g·D, a⟩ with a as rounded (the reference's a is)
    dws = tl.sum(acc, axis=1)
    if HAS_DWSB:
        dws += tl.load(DWSB + rows, mask=row_ok, other=0.0)
    tl.store(DW + slot, dws.to(DW.dtype.element_ty), mask=row_ok)  # slot order: no un-permuting pass


@triton.jit
def _moe_combine_kernel(
    O, INV, W, IDX, D, Y, T, N, K, stride_d,
    HAS_W: tl.constexpr, HAS_BIAS: tl.constexpr, ROWS: tl.constexpr, BLOCK_N: tl.constexpr,
):
    # Token t's k slots are rows inv[t·k + j] of O (sorted by expert); fp32 sum in slot order.
    rows = (tl.program_id(0) * ROWS + tl.arange(0, ROWS)).to(tl.int64)
    row_ok = rows < T
    cols = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    mask = row_ok[:, None] & (cols < N)[None, :]
    acc = tl.zeros([ROWS, BLOCK_N], dtype=tl.float32)
    for j in range(K):
        slot = rows * K + j
        r = tl.load(INV + slot, mask=row_ok, other=0)
        v = tl.load(O + r[:, None] * N + cols[None, :], mask=mask, other=0.0)
        if HAS_BIAS:  # o + d[e] in o's dtype, as the reference adds it before weighting
            e = tl.load(IDX + slot, mask=row_ok, other=0)
            d = tl.load(D + e[:, None] * stride_d + cols[None, :], mask=mask, other=0.0).to(O.dtype.element_ty)
            v = (v.to(tl.float32) + d.to(tl.float32)).to(O.dtype.element_ty)
        v = v.to(tl.float32)
        if HAS_W:
            v = v * tl.load(W + slot, mask=row_ok, other=0.0).to(tl.float32)[:, None]
        acc += v
    tl.store(Y + rows[:, None] * N + cols[None, :], acc.to(Y.dtype.element_ty), mask=mask)


@triton.jit
def _moe_gather_scale_kernel(
    DY, ORDER, W, IDX, D, G, GW, DWSB, S, N, K, stride_dy, stride_d,
    HAS_BIAS: tl.constexpr, ROWS: tl.constexpr, BLOCK_N: tl.constexpr,
):
    # Sorted row r is slot order[r] of token order[r] // k: g = dy[token] (G's dtype), gw = g·w, and with a
    # down bias Σ g·d[e] (fp32, d unrounded: the reference's gathered bias is in fp32).
    rows = (tl.program_id(0) * ROWS + tl.arange(0, ROWS)).to(tl.int64)
    row_ok = rows < S
    slot = tl.load(ORDER + rows, mask=row_ok, other=0)
    token = slot // K
    w = tl.load(W + slot, mask=row_ok, other=0.0).to(tl.float32)
    if HAS_BIAS:
        e = tl.load(IDX + slot, mask=row_ok, other=0)
    acc = tl.zeros([ROWS, BLOCK_N], dtype=tl.float32)
    for start in range(0, N, BLOCK_N):
        cols = start + tl.arange(0, BLOCK_N)
        mask = row_ok[:, None] & (cols < N)[None, :]
        g = tl.load(DY + token[:, None] * stride_dy + cols[None, :], mask=mask, other=0.0).to(G.dtype.element_ty)
        tl.store(G + rows[:, None] * N + cols[None, :], g, mask=mask)
        g = g.to(tl.float32)
        tl.store(GW + rows[:, None] * N + cols[None, :], (g * w[:, None]).to(GW.dtype.element_ty), mask=mask)
        if HAS_BIAS:
            d = tl.load(D + e[:, None] * stride_d + cols[None, :], mask=mask, other=0.0).to(tl.float32)
            acc += g * d
    if HAS_BIAS:
        tl.store(DWSB + rows, tl.sum(acc, axis=1), mask=row_ok)


@lru_cache(maxsize=None)
def tile_config(n: int, loop: bool, heavy: bool = False, target: Target = CPU) -> tuple[int, int, int]:
    """(ROWS, BLOCK, num_warps) for rows of n columns: a 2-D grid of tiles, or (``loop``) programs of ROWS
    rows that walk the columns in BLOCK chunks (a per-row reduction). ``heavy``: the activation kernels,
    whose many live values an element (both halves, the bias, the vjp's terms) took 211 registers a
    thread on sm_90 at 16 elements a thread (GPT-OSS's clamped SwiGLU backward, cross-compiled): half the
    tile at 8 elements a thread (128 registers, no spills)."""
    block = min(_BLOCK, next_pow2(n))
    rows = max(1, min(16 if loop else 64, (_LOOP_TILE if loop or heavy else _TILE) // block))
    return rows, block, warps_for(rows * block * (2 if heavy else 1), hi=8, warp_size=target.warp_size)


_act_fwd, _act_bwd = Launcher(_moe_act_fwd_kernel), Launcher(_moe_act_bwd_kernel)
_combine, _gather_scale = Launcher(_moe_combine_kernel), Launcher(_moe_gather_scale_kernel)


def _halves(halves: str, i: int) -> tuple[int, int, int]:
    """(G0, U0, STEP): where a row's gate and up columns start in h, and their step."""
    return {"gate_up": (0, i, 1), "up_gate": (i, 0, 1), "interleaved": (0, 1, 2)}[halves]


def activation(h, halves, act, alpha, limit, bias=None, ids=None):
    """a = act(h) (S, I) in h's dtype; with ``bias`` (E, 2I), h += bias[ids] first, in place."""
    s, i = h.shape[0], h.shape[1] // 2
    a = torch.empty((s, i), dtype=h.dtype, device=h.device)
    if s == 0 or i == 0:
        return a
    g0, u0, step = _halves(halves, i)
    b = None if bias is None else _dense_rows(bias)
    rows, block, warps = tile_config(i, False, True, target_of(h))
    _act_fwd((cdiv(s, rows), cdiv(i, block)), h, h if b is None else b, ids if b is not None else h, a, s, i,
             h.stride(0), 0 if b is None else b.stride(0), float(alpha), float(limit), g0, u0,
             ACT=_ACT[act], STEP=step, HAS_BIAS=b is not None, ROWS=rows, BLOCK_I=block, num_warps=warps)
    return a


def combine(rows_sorted, inv, t, k, out_dtype, weights=None, indices=None, bias=None):
    """y[t] = Σ_j w[t, j] · (rows_sorted[inv[t·k + j]] + bias[indices[t, j]]), (T, N) in ``out_dtype``;
    unit weights without ``weights``, no bias without ``bias``."""
    n = rows_sorted.shape[1]
    y = torch.empty((t, n), dtype=out_dtype, device=rows_sorted.device)
    if t == 0 or n == 0:
        return y.zero_()
    o = rows_sorted.contiguous()
    w = None if weights is None else weights.contiguous()
    d = None if bias is None else _dense_rows(bias)
    idx = None if d is None else indices.contiguous()
    rows, block, warps = tile_config(n, False, False, target_of(o))
    _combine((cdiv(t, rows), cdiv(n, block)), o, inv, o if w is None else w, inv if idx is None else idx,
             o if d is None else d, y, t, n, k, 0 if d is None else d.stride(0),
             HAS_W=w is not None, HAS_BIAS=d is not None, ROWS=rows, BLOCK_N=block, num_warps=warps)
    return y


def _covered(*tensors) -> bool:
    """Whether the experts' kernels take these operands (fp32 / bf16 / fp16; fp64 is the reference's)."""
    return all(t is None or t.dtype in SUPPORTED for t in tensors)


def moe_experts_fwd(x, weights, indices, gate_up, gate_up_bias, down, down_bias, transposed, halves, act,
                    alpha, limit, out_dtype=None):
    if not _covered(x, weights, gate_up, gate_up_bias, down, down_bias) or act not in _ACT or x.shape[0] == 0:
        return R.moe_experts_fwd(x, weights, indices, gate_up, gate_up_bias, down, down_bias, transposed, halves,
                                 act, alpha, limit, out_dtype)
    t, k = indices.shape
    order, offs = gmm.sort_by_expert(indices, gate_up.shape[0])
    token = order // k
    ids = None if gate_up_bias is None else indices.reshape(-1)[order]
    gu, dn = R._forward_layouts(gate_up.to(x.dtype), down.to(x.dtype), transposed)  # cast here, never saved
    h = gmm.rows(x[token], gu, offs).contiguous()
    a = activation(h, halves, act, alpha, limit, gate_up_bias, ids)
    o = gmm.rows(a, dn, offs)
    y = combine(o, gmm.inverse(order), t, k, out_dtype or x.dtype, weights, indices, down_bias)
    return y, h, order, offs


def gather_scale(dy, order, weights, k, dtype, down_bias=None, indices=None):
    """(g = dy[order // k] in ``dtype``, gw = g · weights[order] in ``dtype``, Σ g · down_bias[e] in fp32
    or None), the S sorted rows."""
    s, n = order.shape[0], dy.shape[1]
    g = torch.empty((s, n), dtype=dtype, device=dy.device)
    gw = torch.empty_like(g)
    dwsb = None if down_bias is None else torch.empty(s, dtype=torch.float32, device=dy.device)
    if s == 0 or n == 0:
        return g, gw, None if dwsb is None else dwsb.zero_()
    d = _dense_rows(dy)
    b = None if down_bias is None else _dense_rows(down_bias)
    rows, block, warps = tile_config(n, True, False, target_of(d))
    _gather_scale((cdiv(s, rows),), d, order, weights, order if b is None else indices, d if b is None else b, g,
                  gw, g if dwsb is None else dwsb, s, n, k, d.stride(0), 0 if b is None else b.stride(0),
                  HAS_BIAS=b is not None, ROWS=rows, BLOCK_N=block, num_warps=warps)
    return g, gw, dwsb


def activation_bwd(h, u, order, weights, halves, act, alpha, limit, dws_bias=None):
    """(a (S, I), dh (S, 2I), both in h's dtype; dweights (T·k,) in slot order, in weights' dtype)."""
    s, i = h.shape[0], h.shape[1] // 2
    a = torch.empty((s, i), dtype=h.dtype, device=h.device)
    dh = torch.empty((s, 2 * i), dtype=h.dtype, device=h.device)
    dw = torch.empty(weights.numel(), dtype=weights.dtype, device=h.device)
    if s == 0:
        return a, dh, dw
    g0, u0, step = _halves(halves, i)
    uu = u.contiguous()
    rows, block, warps = tile_config(max(i, 1), True, True, target_of(h))
    _act_bwd((cdiv(s, rows),), h, uu, order, weights, h if dws_bias is None else dws_bias, dh, a, dw, s, i,
             h.stride(0), float(alpha), float(limit), g0, u0, ACT=_ACT[act], STEP=step,
             HAS_DWSB=dws_bias is not None, ROWS=rows, BLOCK_I=block, num_warps=warps)
    return a, dh, dw


def moe_experts_bwd(dy, x, weights, indices, gate_up, gate_up_bias, down, down_bias, h, order, offs, transposed,
                    halves, act, alpha, limit):
    """(dx, dweights, dgate_up, dgate_up_bias, ddown, ddown_bias), as the reference's."""
    if not _covered(dy, x, weights, gate_up, gate_up_bias, down, down_bias, h) or act not in _ACT or x.shape[0] == 0:
        return R.moe_experts_bwd(dy, x, weights, indices, gate_up, gate_up_bias, down, down_bias, h, order, offs,
                                 transposed, halves, act, alpha, limit)
    t, k = indices.shape
    ct, f = h.dtype, torch.float32  # the dtype the products ran in; the reductions'
    h = h.contiguous()
    w_flat, idx_flat = weights.contiguous().view(-1), indices.contiguous().view(-1)
    g, gw, dws_bias = gather_scale(dy, order, w_flat, k, ct, down_bias, idx_flat)
    gu, dn = R._forward_layouts(gate_up.to(ct), down.to(ct), transposed)
    u = gmm.rows(g, dn.transpose(1, 2), offs)  # (S, I): g · D
    a, dh, dw = activation_bwd(h, u, order, w_flat, halves, act, alpha, limit, dws_bias)
    ddown = gmm.k(a.t(), gw, offs) if transposed else gmm.k(gw.t(), a, offs)
    ids = None if gate_up_bias is None and down_bias is None else idx_flat[order]
    ddown_bias = None if down_bias is None else torch.zeros_like(down_bias, dtype=f).index_add_(0, ids, gw.to(f))
    xs = x[order // k].to(ct)
    dgate_up = gmm.k(xs.t(), dh, offs) if transposed else gmm.k(dh.t(), xs, offs)
    dgate_up_bias = None if gate_up_bias is None else torch.zeros_like(gate_up_bias, dtype=f).index_add_(
        0, ids, dh.to(f))
    dx = combine(gmm.rows(dh, gu.transpose(1, 2), offs), gmm.inverse(order), t, k, x.dtype)
    cast = lambda d, like: None if d is None else d.to(like.dtype).contiguous()  # noqa: E731
    return (dx, dw.view(t, k), cast(dgate_up, gate_up), cast(dgate_up_bias, gate_up_bias), cast(ddown, down),
            cast(ddown_bias, down_bias))
