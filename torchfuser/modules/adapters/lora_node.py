"""The fused LoRA node: one autograd Function computing a projection group's base products (plain,
FP8 or dequantised QLoRA bases) and every active adapter's term in as few GEMMs as the numerics allow, and
its backward (``lora``'s docstring has the numerics; ``lora.joint`` builds the plan and calls it)."""
from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor, nn

from torchfuser.backends import kernel as _backend_kernel
from torchfuser.modules import fp8, gemm
from torchfuser.modules.adapters import quantized_base


@dataclass(frozen=True)
class _Plan:
    """What one call computes, beside the tensors. Terms are the active adapters in PEFT's order."""

    rows: tuple[int, ...]  # each projection's out_features
    n_inputs: int  # dropped inputs, one per adapter with an active dropout
    has_bias: bool
    term_proj: tuple[int, ...]  # the projection each term adds to
    term_input: tuple[int, ...]  # 0: x itself; t ≥ 1: the t-th dropped input
    scaling: tuple[float, ...]
    base_dtype: torch.dtype
    lora_dtype: torch.dtype
    fp8: tuple | None = None  # (recipe, the bases' quantised-weight cache): the base products as FP8 GEMMs
    hilo: bool = False  # bf16 base, fp32 adapters: the adapter products as bf16 hi/lo GEMMs (module docstring)
    quant: tuple | None = None  # (quantised base layers, compute dtype, GEMM dtype, backend): dequantised per GEMM
    splitter: str = "reference"  # the backend of the hi/lo splits: "triton" (one launch each) on CUDA, else torch's

    def split(self, items):
        """(dropped inputs, base weights, biases, A's, B's) of anything laid out as the node's tensors."""
        n, k = len(self.rows), len(self.term_proj)
        ends = (self.n_inputs, self.n_inputs + n, self.n_inputs + n * (1 + self.has_bias))
        items = list(items)  # sliced, not taken one by one: a node's host cost is counted (test_lora_host_calls)
        return (items[:ends[0]], items[ends[0]:ends[1]], items[ends[1]:ends[2]], items[ends[2]:ends[2] + k],
                items[ends[2] + k:ends[2] + 2 * k])


class _LoRALinear(torch.autograd.Function):
    @staticmethod
    def forward(ctx, plan: _Plan, x, *tensors):
        inputs, weights, biases, As, Bs = plan.split(tensors)
        cb, cl = plan.base_dtype, plan.lora_dtype
        with torch._C._DisableAutocast():  # every cast below is explicit: autocast's own
            xb = _as(x, cb)
            x2 = xb.reshape(-1, xb.shape[-1])
            b = None if not biases else (_as(biases[0], cb) if len(biases) == 1 else gemm.cast_cat(biases, cb))
            ctx.fp8_bwd = None
            if plan.fp8 is not None:  # the frozen (or not) bases as an FP8 GEMM, their copies made per call (or kept per step: fp8._Weights)
                recipe, cache = plan.fp8
                fwd8, ctx.fp8_bwd = cache.get(list(weights), recipe)
                y2 = fp8.mm(fp8.quantize(x2, recipe), fwd8, cb)
                if b is not None:
                    y2 = y2 + b
                y, w = y2.view(*xb.shape[:-1], y2.shape[-1]), weights[0]
            elif plan.quant is not None:  # Ŵ dequantised for this GEMM only (modules.adapters.quantized_base)
                y = quantized_base.linear(xb, plan.quant, biases).to(cb)
                y2, w = y.view(-1, y.shape[-1]), weights[0]
            else:
                w = _as(weights[0], cb) if len(weights) == 1 else gemm.cast_cat(weights, cb)
                y = nn.functional.linear(xb, w, b)
                y2 = y.view(-1, y.shape[-1])
            a = [_as(A, cl) for A in As]
            bb = [_as(B, cl) for B in Bs]
            plain = [k for k, t in enumerate(plan.term_input) if t == 0]
            hs = [None] * len(As)
            a_hl = None  # the plain A's [hi; lo] (bf16), kept for dx: small, and one split fewer in the backward
            if plain:  # the A's of every adapter without a live dropout: one GEMM on x
                a0 = _cat([a[k] for k in plain], 0)
                if plan.hilo:  # x·A_hiᵀ + x·A_loᵀ as one bf16 GEMM, fp32 out
                    a_hl = _hilo(a0, "hl", 0, cb, plan.splitter)
                    h0 = _halves(_mm_fp32(x2, a_hl.t()), 1)
                else:
                    h0 = torch.mm(_as(x2, cl), a0.t())
                for k, h in zip(plain, _split(h0, [a[k].shape[0] for k in plain], 1)):
                    hs[k] = h
            for k, t in enumerate(plan.term_input):
                if t:  # PEFT's fp32 dropped input: an fp32 GEMM ([T × d], not [T × out])
                    xd = _as(inputs[t - 1].reshape(-1, x2.shape[-1]), cl)
                    hs[k] = torch.mm(xd, a[k].t())
            b3 = []
            if plan.hilo:  # saved: s·h as [hi | lo | hi] (bf16), not h; each B's [hi | hi | lo] for dh
                hs, b3 = _add_split_terms(y2, plan, hs, bb)
            else:
                _add_terms(y2, plan, hs, bb)
        # The saved base weights: the cast/concatenation where autocast made one (as autocast saves
        # its cast), else the parameters themselves, concatenated again in the backward (no copy kept).
        cast = w.dtype != weights[0].dtype
        # x (as cast) only where a gradient reads it: a base weight's, or an A's on x itself.
        wants_x = any(plan.split(ctx.needs_input_grad[2:])[1]) or bool(plain)
        # a, bb: the parameters themselves where no cast was made (fp32 adapters); the split path keeps
        # its bf16 parts of A and B (N × 3r and 2R × K: ≈ 4 MB a llama8b layer) rather than making them
        # again in the backward: the step is bound by the host, and each split is several launches.
        ctx.save_for_backward(xb if wants_x else None, *inputs, *(weights if not cast else [w]), *a, *bb, *hs,
                              a_hl, *b3)
        ctx.plan, ctx.cast, ctx.x_dtype = plan, cast, x.dtype
        ctx.dtypes = [t.dtype for t in (*weights, *biases, *As, *Bs)]
        return y

    @staticmethod
    def backward(ctx, dy):
        plan = ctx.plan
        n, k, cb, cl = len(plan.rows), len(plan.term_proj), plan.base_dtype, plan.lora_dtype
        saved = list(ctx.saved_tensors)
        xb, inputs = saved[0], saved[1:1 + plan.n_inputs]
        rest = saved[1 + plan.n_inputs:]
        nw = 1 if ctx.cast else n
        weights, a, bb, hs = rest[:nw], rest[nw:nw + k], rest[nw + k:nw + 2 * k], rest[nw + 2 * k:nw + 3 * k]
        a_hl, b3 = rest[nw + 3 * k], rest[nw + 3 * k + 1:]
        need_x = ctx.needs_input_grad[1]
        need_in, need_w, need_b, need_a, need_bb = plan.split(ctx.needs_input_grad[2:])
        _, w_dtypes, b_dtypes, a_dtypes, bb_dtypes = plan.split([None] * plan.n_inputs + ctx.dtypes)
        plain = [j for j, t in enumerate(plan.term_input) if t == 0]
        plain_dh = need_x or any(need_a[j] for j in plain)
        with torch._C._DisableAutocast():
            x2 = None if xb is None else xb.reshape(-1, xb.shape[-1])
            dy2 = dy.reshape(-1, dy.shape[-1])
            cols = _split(dy2, list(plan.rows), 1)
            d_a, d_bb, d_in = [None] * k, [None] * k, [None] * plan.n_inputs
            dh = [None] * k
            for j, (i, s, t) in enumerate(zip(plan.term_proj, plan.scaling, plan.term_input)):
                want_dh = plain_dh if t == 0 else need_a[j] or need_in[t - 1]
                if plan.hilo:  # g stays bf16: gᵀ·[h_hi | h_lo] and g·[B_hi | B_lo], fp32 out (s is in h)
                    g, r = cols[i], bb[j].shape[1]
                    if need_bb[j]:
                        d_bb[j] = _as(_halves(_mm_fp32(g.t(), hs[j][:, :2 * r]), 1), bb_dtypes[j])
                    if want_dh:  # [B_hi | B_lo]: the last two thirds of the forward's [hi | hi | lo]
                        dh[j] = _halves(_mm_fp32(g, b3[j][:, r:]), 1).mul_(s)
                    continue
                g = _as(cols[i], cl)
                if need_bb[j]:
                    d_bb[j] = gemm.mm(g.t(), hs[j], bb_dtypes[j]).mul_(s)
                if want_dh:
                    dh[j] = torch.mm(g, bb[j]).mul_(s)
            dx = None
            if need_x and ctx.fp8_bwd is not None:
                dx = fp8.mm(fp8.quantize(dy2, plan.fp8[0]), ctx.fp8_bwd, ctx.x_dtype)
            elif need_x and plan.quant is not None:  # Ŵ dequantised again, not kept from the forward
                dx = quantized_base.grad_input(dy2, plan.quant, ctx.x_dtype)
            elif need_x:
                w = weights[0] if len(weights) == 1 else torch.cat(weights)
                dx = gemm.mm(dy2, w, ctx.x_dtype)
            if plain and plain_dh:
                dh0 = _cat([dh[j] for j in plain], 1)
                rows = [a[j].shape[0] for j in plain]
                if plan.hilo:  # dh = dh_hi + dh_lo: dA from one bf16 GEMM on x, dx += in one addmm (K = 3R)
                    d3 = _hilo(dh0, "hlh", 1, cb, plan.splitter)
                    if any(need_a[j] for j in plain):
                        da = _halves(_mm_fp32(d3[:, :2 * dh0.shape[1]].t(), x2), 0).split(rows)
                        for j, g in zip(plain, da):
                            d_a[j] = _as(g, a_dtypes[j]) if need_a[j] else None
                    if need_x:  # [A_hi; A_hi; A_lo] from the forward's [A_hi; A_lo]
                        _addmm_bf16_(dx, d3, torch.cat([a_hl[:dh0.shape[1]], a_hl]))
                else:
                    if any(need_a[j] for j in plain):
                        da = _split(gemm.mm(dh0.t(), _as(x2, cl), a_dtypes[plain[0]]), rows, 0)
                        for j, g in zip(plain, da):
                            d_a[j] = g if need_a[j] else None
                    if need_x:
                        dx += gemm.mm(dh0, _cat([a[j] for j in plain], 0), ctx.x_dtype)
            for j, t in enumerate(plan.term_input):
                if t:
                    xd = inputs[t - 1]
                    if need_a[j]:
                        d_a[j] = gemm.mm(dh[j].t(), _as(xd.reshape(-1, xd.shape[-1]), cl), a_dtypes[j])
                    if need_in[t - 1]:
                        d_in[t - 1] = gemm.mm(dh[j], a[j], xd.dtype).view(xd.shape)
            d_w, d_b = [None] * n, [None] * len(need_b)
            if any(need_w):
                for i, g in enumerate(cols):
                    d_w[i] = gemm.mm(g.t(), x2, w_dtypes[i]) if need_w[i] else None
            for i, g in enumerate(cols[:len(need_b)]):
                d_b[i] = _as(gemm.column_sums(g), b_dtypes[i]) if need_b[i] else None
        if dx is not None:
            dx = dx.view(*dy.shape[:-1], dx.shape[-1])
        return (None, dx, *d_in, *d_w, *d_b, *d_a, *d_bb)


# Host cost: the node runs ~50 ATen calls a step on a host-bound GPU step, so calls that do nothing are
# left out: a cast to the dtype a tensor has, a concatenation or split of one part (same values, no copy).
def _as(t: Tensor, dtype: torch.dtype) -> Tensor:
    return t if t.dtype == dtype else t.to(dtype)


def _cat(parts: list[Tensor], dim: int) -> Tensor:
    return parts[0] if len(parts) == 1 else torch.cat(parts, dim)


def _split(t: Tensor, sizes: list[int], dim: int):
    return (t,) if len(sizes) == 1 else t.split(sizes, dim)


def _add_terms(y2: Tensor, plan: _Plan, hs, bb) -> None:
    """y_i += s·h·Bᵀ per term, in place on y's columns. Where the LoRA dtype differs from the base's
    (fp32 adapters on a fp16 base, or the switch ``lora_split_bf16`` off) PEFT sums in the promoted dtype
    and rounds once to the base's: the same here, per projection."""
    starts = [sum(plan.rows[:i]) for i in range(len(plan.rows))]
    if plan.lora_dtype == plan.base_dtype:
        for i, s, h, b in zip(plan.term_proj, plan.scaling, hs, bb):
            y2[:, starts[i]:starts[i] + plan.rows[i]].addmm_(h, b.t(), alpha=s)
        return
    wide = torch.promote_types(plan.base_dtype, plan.lora_dtype)
    for i in sorted(set(plan.term_proj)):
        cols = y2[:, starts[i]:starts[i] + plan.rows[i]]
        acc = cols.to(wide)
        for j in (j for j, p in enumerate(plan.term_proj) if p == i):
            acc = acc + torch.mm(hs[j], bb[j].t()).mul_(plan.scaling[j]).to(wide)
        cols.copy_(acc)


def _add_split_terms(y2: Tensor, plan: _Plan, hs, bb) -> list[Tensor]:
    """y_i += Σ s·h·Bᵀ in place on y's bf16 columns, one addmm per projection over every term's
    [h_hi | h_lo | h_hi]·[B_hi | B_hi | B_lo]ᵀ (s·h split, so one alpha serves terms of different
    scalings): y read and written once, the product's fp32 accumulator added before the one rounding
    (PEFT's: the fp32 sum rounded once). Returns each term's split s·h (what dB reads) and split B
    (what dh reads)."""
    cb = plan.base_dtype
    h3 = [_hilo(h, "hlh", 1, cb, plan.splitter, s) for h, s in zip(hs, plan.scaling)]
    b3 = [_hilo(b, "hhl", 1, cb, plan.splitter) for b in bb]
    start = 0
    for i, rows in enumerate(plan.rows):
        js = [j for j, p in enumerate(plan.term_proj) if p == i]
        if js:
            left = torch.cat([h3[j] for j in js], 1) if len(js) > 1 else h3[js[0]]
            right = torch.cat([b3[j] for j in js], 1) if len(js) > 1 else b3[js[0]]
            _addmm_bf16_(y2[:, start:start + rows], left, right.t())
        start += rows
    return h3, b3


def _hilo(t: Tensor, parts: str, dim: int, dtype: torch.dtype, backend: str, scale: float = 1.0) -> Tensor:
    """fp32 ``t``·scale as two bf16 parts, hi = bf16(t·s) and lo = bf16(t·s − hi), concatenated along ``dim`` in
    the order ``parts`` names them ("hl", "hlh", "hhl"): t = hi + lo to ≈ 2⁻¹⁶ relative; bf16 has fp32's
    exponent range, so neither part overflows or underflows where t does not (fp16's would: why fp16 bases
    keep PEFT's fp32 products). One Triton launch on CUDA, torch's in-place copies elsewhere, bit for bit
    the same (backends/*/hilo_split.py)."""
    return _backend_kernel(backend, "hilo_split")(t, parts, dim, dtype, scale)


def _halves(t: Tensor, dim: int) -> Tensor:
    """The sum of t's two halves along ``dim`` (a product of the hi part plus that of the lo part), fp32."""
    first, second = t.chunk(2, dim)
    return first + second


def _mm_fp32(a: Tensor, b: Tensor) -> Tensor:
    """a·b of bf16 operands with fp32 accumulation, written in fp32: cuBLAS's ``out_dtype`` GEMM where
    there is one (CUDA); elsewhere (the CPU has no such overload) the same math as fp32 operands: the
    products of bf16 values are exact in fp32 either way, so the CPU tests check the GPU's algorithm."""
    if gemm.fp32_out_ok(a.device):
        return torch.mm(a, b, out_dtype=torch.float32)
    return torch.mm(a.float(), b.float())


def _addmm_bf16_(y: Tensor, a: Tensor, b: Tensor) -> None:
    """y += a·b in place, all bf16: cuBLAS adds y to the fp32 accumulator and rounds once; elsewhere
    the same math spelled in fp32 (a CPU bf16 addmm may round the product before adding)."""
    if gemm.fp32_out_ok(a.device):
        y.addmm_(a, b)
    else:
        y.copy_(torch.addmm(y.float(), a.float(), b.float()))
