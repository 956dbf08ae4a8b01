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

import torch
from torch import Tensor, nn

from torchfuser.backends import BackendUnavailable, resolve
from torchfuser.modules import fallbacks, fp8
from torchfuser.modules.adapters import quantized_base
from torchfuser.modules.adapters.lora_node import _as, _LoRALinear, _Plan
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
                 eight, hilo, quant, _split_backend(backend, x.device) if hilo else "reference")
    biases = [b.bias for b in bases] if plan.has_bias else []
    return _LoRALinear.apply(plan, x, *inputs, *(_weight(b) for b in bases), *biases,
                             *(t[1] for t in terms), *(t[2] for t in terms))


_SPLIT_BACKENDS: dict = {}


def _split_backend(backend: str | None, device: torch.device) -> str:
    """Where the hi/lo splits run: the Triton kernel on CUDA / ROCm where the module's backend resolves to
    Triton, else the torch spelling. Remembered per (backend, device type): ``resolve`` is host time a call."""
    if device.type != "cuda":  # the CPU keeps the torch spelling (a Triton backend there is the interpreter)
        return "reference"
    key = (backend, device.type)
    found = _SPLIT_BACKENDS.get(key)
    if found is None:
        try:
            found = "triton" if resolve(backend, device) == "triton" else "reference"
        except BackendUnavailable:  # a backend named for another device (the node's own GEMMs are torch's)
            found = "reference"
        _SPLIT_BACKENDS[key] = found
    return found


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
