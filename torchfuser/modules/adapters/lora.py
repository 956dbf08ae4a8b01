"""PEFT LoRA adapters on the projections of a fused block, run in its joint projection.

For projections i with frozen base W_i (b_i) and active adapters k (A_k, B_k, scaling s_k, dropout):

    y_i = x·W_iᵀ (+ b_i) + Σ_k s_k · (drop_k(x)·A_kᵀ)·B_kᵀ

as one autograd node: the bases as one GEMM (as ``projections.joint``), the A's of every adapter
without an active dropout as one GEMM on x ([A_q; A_k; A_v]), each B added into its projection's
columns of the output. Saved for the backward: x once (no copy of it per projection), the cast or
concatenated base weights only where a cast made them (else the parameters themselves), the
small h = x·Aᵀ (as its bf16 hi/lo parts on the split path below), the cast A's and B's. No gradient is computed for what does not require one (a
frozen base).

Dropout: each adapter's own ``nn.Dropout`` is called on the input PEFT would pass it, in PEFT's
order (projection by projection, adapter by adapter, before any product), so the masks are the
very ones PEFT draws: exact parity. Such an adapter's A product runs on its own dropped input.

Dtypes: under autocast every product is in the autocast dtype, as in PEFT; in fp32 (or fp16 base
weights with fp32 adapters) the products are in PEFT's dtypes too. Frozen bf16 base weights with
fp32 adapters and no autocast (PEFT's default way to train LoRA) run the adapter products on bf16
tensor cores at fp32-level accuracy instead of PEFT's fp32 casts and fp32 SIMT GEMMs: each fp32
operand t is split into two bf16 parts, hi = bf16(t), lo = bf16(t − hi) (t = hi + lo to ≈ 2⁻¹⁶
relative), x and dy are exactly bf16 already, and each product is one bf16 GEMM with fp32
accumulation over the parts concatenated along K or N (R: the adapters' summed rank):

    h   = x·[A_hi; A_lo]ᵀ                 (T × 2R fp32, halves summed)
    y  += [h_hi | h_lo | h_hi]·[B_hi | B_hi | B_lo]ᵀ    (in place on y's bf16 columns, K = 3r; s in h)
    dB  = gᵀ·[h_hi | h_lo],  dh = s·g·[B_hi | B_lo]   (g: y's bf16 gradient columns; halves summed)
    dA  = [dh_hi | dh_lo]ᵀ·x,  dx += [dh_hi | dh_lo | dh_hi]·[A_hi; A_hi; A_lo]   (after the base dx)

so no [tokens × out_features] fp32 tensor is made (PEFT's dtypes moved ≈ 5.6× the bytes on
llama8b's shapes: docs/performance/NOTES-lora.md). The split and the dropped lo·lo terms are
≈ 2⁻¹⁶ relative per product (measured on exact bf16 inputs: adapter gradients within ≈ 2⁻¹⁸ of their
largest value, PEFT's fp32 ones ≈ 2⁻²²), far below the bf16 roundings of y, dy and x that make PEFT's
own error in a bf16 model: there the repository's rule (max|fused − ref64| ≤ 2·max|peft − ref64| +
atol) holds for the loss, the output and every gradient; the rounding is no longer PEFT's bit for bit.
The switch ``lora_split_bf16`` off (``torchfuser.switches``) runs PEFT's dtypes literally instead (fp32
copies of y's columns, of dy, of x). fp16 keeps PEFT's dtypes: fp16's range would underflow the lo parts of small gradients.

Quantised bases (QLoRA: bitsandbytes NF4 / FP4 / int8 under PEFT's bnb LoRA layers): the base weights
are dequantised into a transient operand right before the joint GEMM and again for dx in the backward,
never kept (``modules.adapters.quantized_base``).

A LoRA layer this cannot reproduce (a DoRA or other variant, merged weights, a LoRA bias, hooks,
an in-place dropout) makes the caller run each projection as itself, counted in
``modules.fallbacks``; another PEFT method or a quantised base of another kind leaves the block unfused
at ``optimize`` (``unsupported``).
"""
from __future__ import annotations

import sys
from dataclasses import dataclass

import torch
from torch import Tensor, nn

from torchfuser.modules import fallbacks, fp8, gemm
from torchfuser.modules.adapters import quantized_base
from torchfuser.modules.base import hooked
from torchfuser.ops._call import autocast_enabled, plain_eager
from torchfuser.switches import SWITCHES as _SWITCHES

_AUTOCAST_CASTS = (torch.float32, torch.bfloat16, torch.float16)


def _lora_linear_type():
    """peft's lora.Linear, or None when peft was never imported (then no model holds one)."""
    layer = sys.modules.get("peft.tuners.lora.layer")
    return getattr(layer, "Linear", None)


def _lora_types() -> tuple[type, ...]:
    """PEFT's plain LoRA layer and its LoRA layers over bitsandbytes bases (QLoRA)."""
    return (_lora_linear_type(), *quantized_base.peft_layer_types())


def _tuner_layer(m: nn.Module) -> bool:
    tuners = sys.modules.get("peft.tuners.tuners_utils")
    return tuners is not None and isinstance(m, tuners.BaseTunerLayer)


def is_lora(m: nn.Module) -> bool:
    """Whether ``m`` is a PEFT adapter layer (LoRA or another method)."""
    return _tuner_layer(m)


def base_of(m: nn.Module) -> nn.Module:
    """The layer a PEFT adapter wraps (what a pattern reads shapes from), else ``m``."""
    return m.get_base_layer() if _tuner_layer(m) else m


def unsupported(name: str, m: nn.Module) -> str | None:
    """Why a block whose projection ``name`` is ``m`` cannot be fused, or None. Plain LoRA on an
    nn.Linear / Conv1D base runs fused or as itself; anything else PEFT puts there is left alone."""
    if not _tuner_layer(m):
        return None
    base = m.get_base_layer()
    if type(m) not in _lora_types():
        where = type(m).__module__.removeprefix("peft.tuners.")  # e.g. 'loha.layer', 'lora.bnb'
        return (f"{name} is PEFT's {where}.{type(m).__name__} over "
                f"{type(base).__name__} (a quantised base or another PEFT method): the fused block computes "
                "plain LoRA on an nn.Linear base only")
    if why := quantized_base.unsupported(base):
        return f"{name}'s LoRA adapter wraps {why}"
    if type(base) is not nn.Linear and type(base).__name__ != "Conv1D" and quantized_base.kind(base) is None:
        return f"{name}'s LoRA adapter wraps a {type(base).__name__}, not an nn.Linear"
    variants = getattr(m, "lora_variant", {})
    if variants:
        kinds = ", ".join(f"{a!r}: {type(v).__name__}" for a, v in variants.items())
        return (f"{name} carries LoRA variants ({kinds}; DoRA is one): the fused block computes plain "
                "x·Wᵀ + s·(x·Aᵀ)·Bᵀ only")
    return None


def summary(module: nn.Module, names) -> str | None:
    """'LoRA r=16' (the ranks of the active adapters on the projections ``names``; 'LoRA r=16 over NF4
    base' where they wrap quantised bases), None without any."""
    ranks, active, bases = set(), set(), []
    for n in names:
        m = module._modules.get(n) if n else None
        if m is None or type(m) not in _lora_types() or m.disable_adapters:
            continue
        bases.append(m.get_base_layer())
        for a in m.active_adapters:
            if a in m.lora_A:
                ranks.add(m.r[a])
                active.add(a)
    if not ranks:
        return None
    text = f"LoRA r={'/'.join(str(r) for r in sorted(ranks))}"
    if quant := quantized_base.describe(bases):
        text += f" over {quant} base"
    return text if active == {"default"} else f"{text} (adapters {', '.join(sorted(active))})"


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

    def split(self, items):
        """(dropped inputs, base weights, biases, A's, B's) of anything laid out as the node's tensors."""
        n, k = len(self.rows), len(self.term_proj)
        ends = (self.n_inputs, self.n_inputs + n, self.n_inputs + n * (1 + self.has_bias))
        items = list(items)  # sliced, not taken one by one: a node's host cost is counted (test_lora_host_calls)
        return (items[:ends[0]], items[ends[0]:ends[1]], items[ends[1]:ends[2]], items[ends[2]:ends[2] + k],
                items[ends[2] + k:ends[2] + 2 * k])


def _terms(m: nn.Module):
    """(base nn.Linear, [(A, B, scaling, dropout or None)]) of a projection, or why it must run as itself."""
    if type(m) is nn.Linear:
        return m, []
    if type(m) not in _lora_types():
        return f"{type(m).__name__} is not a LoRA layer on an nn.Linear"
    base = m.base_layer
    if type(base) is not nn.Linear and (quantized_base.kind(base) is None or quantized_base.unsupported(base)):
        return f"a LoRA layer on a {type(base).__name__}"
    if m.merged:
        return "merged LoRA weights (PEFT's merge(); its forward unmerges them when adapters are disabled)"
    if not getattr(m, "cast_input_dtype_enabled", True):
        return "PEFT's input dtype casting disabled"
    if hooked(m, base):
        return "hooks on a LoRA layer"
    if m.disable_adapters:
        return base, []
    terms = []
    for a in m.active_adapters:
        if a not in m.lora_A:
            continue
        if a in m.lora_variant:
            return f"LoRA variant {type(m.lora_variant[a]).__name__} (adapter {a!r})"
        A, B, drop = m.lora_A[a], m.lora_B[a], m.lora_dropout[a]
        if type(A) is not nn.Linear or type(B) is not nn.Linear or B.bias is not None or A.bias is not None:
            return f"adapter {a!r} has a LoRA bias or non-Linear A/B"
        if type(drop) not in (nn.Identity, nn.Dropout) or getattr(drop, "inplace", False) or hooked(A, B, drop):
            return f"adapter {a!r} has hooks or a dropout other than nn.Dropout"
        live = type(drop) is nn.Dropout and drop.training and drop.p > 0
        terms.append((A.weight, B.weight, float(m.scaling[a]), drop if live else None))
    return base, terms


def joint(x: Tensor, linears: list[nn.Module], owner: nn.Module | None) -> Tensor | None:
    """``torch.cat([m(x) for m in linears], -1)`` for projections some of which are PEFT LoRA
    layers, as one node (module docstring); None where the caller must call each as itself (why
    counted on ``owner``)."""
    parts = [_terms(m) for m in linears]
    why = next((p for p in parts if isinstance(p, str)), None)
    quant = why is None and any(quantized_base.kind(b) for b, _ in parts)
    if quant:
        why = _quant_problem(x, [b for b, _ in parts])
    elif why is None:
        why = _dtype_problem(x, parts)
    if why is None and quant and autocast_enabled(x.device.type) and x.dtype not in _AUTOCAST_CASTS:
        why = "float64 under autocast"
    if why is None and not plain_eager((x, *(t for b, ts in parts for t in (_weight(b), *(a for a, *_ in ts))))):
        why = "not plain eager mode (tracing, a dispatch mode, functorch or a tensor subclass)"
    if why is not None:
        if owner is not None:
            fallbacks.count(owner, f"LoRA projections ran as PEFT's own layers, not in the fused LoRA node: {why}")
        return None
    device = x.device.type
    base_dtype = torch.get_autocast_dtype(device) if autocast_enabled(device) else x.dtype
    terms = [(i, *t) for i, (_, ts) in enumerate(parts) for t in ts]
    lora_dtype = base_dtype if autocast_enabled(device) or not terms else terms[0][1].dtype
    inputs, term_input = [], []
    for _, A, _, _, drop in terms:  # PEFT's order of dropout draws: projection by projection
        if drop is None:
            term_input.append(0)
        else:
            inputs.append(drop(_as(x, A.dtype)))
            term_input.append(len(inputs))
    bases = [b for b, _ in parts]
    recipe = None if quant else fp8.usable(x, bases, owner)
    eight = None if recipe is None else (recipe, fp8.weights_cache(owner, bases))
    backend = getattr(owner, "backend", None)
    if quant:  # (layers, bnb's compute dtype, the GEMM's: autocast's where on, backend); the output in x's dtype
        cd = quantized_base.compute_dtype(bases[0], x)
        quant = (tuple(bases), cd, base_dtype if autocast_enabled(device) else cd, backend)
        base_dtype = x.dtype  # bitsandbytes returns x's dtype; under autocast PEFT adds the adapters' products to it
    else:
        quant = None
    hilo = (_SWITCHES.lora_split_bf16 and bool(terms) and base_dtype == torch.bfloat16
            and lora_dtype == torch.float32)
    plan = _Plan(tuple(b.out_features for b in bases), len(inputs), bases[0].bias is not None,
                 tuple(t[0] for t in terms), tuple(term_input), tuple(t[3] for t in terms), base_dtype, lora_dtype,
                 eight, hilo, quant)
    biases = [b.bias for b in bases] if plan.has_bias else []
    return _LoRALinear.apply(plan, x, *inputs, *(_weight(b) for b in bases), *biases,
                             *(t[1] for t in terms), *(t[2] for t in terms))


def _weight(base: nn.Module) -> Tensor:
    """What the node takes as a base's weight: the parameter, or a quantised base's bytes as a plain tensor."""
    return quantized_base.packed(base) if quantized_base.kind(base) else base.weight


def _quant_problem(x: Tensor, bases) -> str | None:
    """Why a call over quantised bases must run as PEFT's layers, or None (``modules.adapters.quantized_base``)."""
    if not all(quantized_base.kind(b) for b in bases):
        return "quantised and unquantised bases in one joint projection"
    if len({quantized_base.compute_dtype(b, x) for b in bases}) > 1 or len({b.bias is None for b in bases}) > 1:
        return "quantised bases of different compute dtypes, or some with a bias and some without"
    return next(filter(None, (quantized_base.call_problem(b, x) for b in bases)), None)


def _dtype_problem(x: Tensor, parts) -> str | None:
    """Why this call's dtypes are not ones the node reproduces PEFT's numerics for (then the layers
    run as themselves, and raise PyTorch's own error where they must)."""
    bases = [b for b, _ in parts]
    if len({b.bias is None for b in bases}) > 1:
        return "some projections have a bias and some do not"
    params = [t for b in bases for t in (b.weight, b.bias) if t is not None]
    adapters = [t for _, ts in parts for A, B, *_ in ts for t in (A, B)]
    if autocast_enabled(x.device.type):
        if any(t.dtype not in _AUTOCAST_CASTS for t in (x, *params, *adapters)):
            return "float64 under autocast"
        return None
    if any(t.dtype != x.dtype for t in params):
        return "input and base weights of different dtypes"
    if len({t.dtype for t in adapters}) > 1:
        return "adapters of different dtypes"
    return None


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
                    a_hl = _hilo(a0, "hl", 0, cb)
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
                layers, cd, gemm_dtype, backend = plan.quant
                w_hat = quantized_base.joint_weight(layers, cd, backend).to(gemm_dtype)
                dx = gemm.mm(dy2.to(gemm_dtype), w_hat, ctx.x_dtype)
            elif need_x:
                w = weights[0] if len(weights) == 1 else torch.cat(weights)
                dx = gemm.mm(dy2, w, ctx.x_dtype)
            if plain and plain_dh:
                dh0 = _cat([dh[j] for j in plain], 1)
                rows = [a[j].shape[0] for j in plain]
                if plan.hilo:  # dh = dh_hi + dh_lo: dA from one bf16 GEMM on x, dx += in one addmm (K = 3R)
                    d3 = _hilo(dh0, "hlh", 1, cb)
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
    h3 = [_hilo(h if s == 1 else h * s, "hlh", 1, cb) for h, s in zip(hs, plan.scaling)]
    b3 = [_hilo(b, "hhl", 1, cb) for b in bb]
    start = 0
    for i, rows in enumerate(plan.rows):
        js = [j for j, p in enumerate(plan.term_proj) if p == i]
        if js:
            left = torch.cat([h3[j] for j in js], 1) if len(js) > 1 else h3[js[0]]
            right = torch.cat([b3[j] for j in js], 1) if len(js) > 1 else b3[js[0]]
            _addmm_bf16_(y2[:, start:start + rows], left, right.t())
        start += rows
    return h3, b3


def _hilo(t: Tensor, parts: str, dim: int, dtype: torch.dtype) -> Tensor:
    """fp32 ``t`` as two bf16 parts, hi = bf16(t) and lo = bf16(t − hi), concatenated along ``dim`` in
    the order ``parts`` names them ("hl", "hlh", "hhl"), each written in place into the result (no
    temporaries). t − hi is exact in fp32 (hi is t rounded), so |t − hi − lo| ≤ 2⁻¹⁶·|t|; bf16 has
    fp32's exponent range, so neither part overflows or underflows where t does not (fp16's would: why
    fp16 bases keep PEFT's fp32 products)."""
    shape = list(t.shape)
    shape[dim] *= len(parts)
    out = t.new_empty(shape, dtype=dtype)
    chunks = out.chunk(len(parts), dim)
    hi = chunks[parts.index("h")]
    hi.copy_(t)
    torch.sub(t, hi, out=chunks[parts.index("l")])  # in fp32, rounded once to bf16 on the write
    for p, c in zip(parts, chunks):
        if p == "h" and c is not hi:
            c.copy_(hi)
    return out


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
