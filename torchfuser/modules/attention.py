"""Fused self-attention: projections → (q/k norm) → rotary via ``functional.rope`` → PyTorch SDPA →
output projection. One forward for every family; where families differ (a fused qkv projection
and its layout, q/k norms, partial rotary, scaling, dropout placement) the difference is a field
of ``AttentionSpec``.

The projections, norms and dropouts stay the original submodules (adopted under their original
names), so ``state_dict`` keys and values do not change. Anything this forward cannot reproduce
at call time (an attention implementation other than eager/sdpa, a request for attention
weights, rotary tables of an unexpected width) runs the original module instead, and is counted
(``modules.fallbacks``) so that the report says so; the checks are ``_attention_fallback.reason``.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor, nn
from torch.nn.attention import SDPBackend, sdpa_kernel
from torch.utils.weak import WeakTensorKeyDictionary
from transformers.integrations.sdpa_attention import sdpa_attention_forward

from torchfuser import functional as F, ops
from torchfuser.modules.base import (FusedModule, adopt, apply_dropout, call_original, decided, dropout_p, host_reads_allowed,
                                     keep_dropout)
from torchfuser.modules import _attention_fallback, attention_bias, decode, fallbacks, packed, rotary_complex
# (re-exported: the patterns and the other attention modules read them from here)
from torchfuser.modules._attention_fallback import _IMPLEMENTATIONS, _collector, _recorded_from  # noqa: F401
from torchfuser.modules.adapters import lora
from torchfuser.modules.projections import project, single
from torchfuser.ops._call import autocast_enabled

# Names the KV cache goes by in the attention forwards of different transformers versions and
# families: ``cache`` (5.24+), ``past_key_values`` (earlier 5.x), ``layer_past`` (GPT-NeoX).
_CACHE_KWARGS = ("cache", "past_key_values", "layer_past")

# mask tensor → (its version, whether some query row has every key masked). The model passes one
# mask object to every layer, so the check runs once per forward, not once per layer. Inference
# tensors (made under torch.inference_mode) have no version counter, so a write to one in place
# could not be told from the cached answer: they are checked on every call (inference only).
_EMPTY_ROWS = WeakTensorKeyDictionary()


def _has_empty_rows(mask: Tensor) -> bool:
    """Whether an additive float mask hides every key from some query (left padding does that)."""
    if mask.is_inference():
        return _empty_rows(mask)
    hit = _EMPTY_ROWS.get(mask)
    if hit is not None and hit[0] == mask._version:
        return hit[1]
    empty = _empty_rows(mask)
    _EMPTY_ROWS[mask] = (mask._version, empty)
    return empty


def _empty_rows(mask: Tensor) -> bool:
    return bool((mask.amax(dim=-1) <= torch.finfo(mask.dtype).min).any())


@dataclass(frozen=True)
class AttentionSpec:
    """softmax(q·kᵀ·scaling + mask)·v, with q, k, v from the projections below.

    layout: ``"separate"`` (``qkv`` = q, k, v projections), ``"concat"`` (one projection whose
    output is [q | k | v], Phi-3, GPT-2's ``c_attn``; or ``qkv_blocks`` such blocks in
    ``qkv_order``, each with its share of the heads, CodeGen's [q | v | k] per model-parallel
    shard) or ``"per_head"`` (one projection whose output is, per head, [q_h | k_h | v_h], GPT-NeoX).
    """

    layout: str
    qkv: tuple[str, ...]
    out: str
    num_heads: int
    num_kv_heads: int
    head_dim: int
    scaling: float
    qkv_blocks: int = 1  # "concat": the output is this many [q | k | v] blocks, each 1/qkv_blocks of the heads
    qkv_order: tuple[str, ...] = ("q", "k", "v")  # "concat": the order of q, k and v in each block
    rotary_dim: int = 0  # rope on the first rotary_dim channels of each head; 0: no rotary
    # Which channels rotate together: None, channel i with i + rotary_dim/2 (Llama's rotate-half);
    # "pairs", channels 2i and 2i+1 with cos/sin given per channel (Cohere); "half", pairs again with
    # the first half of cos/sin repeated per pair (GLM).
    rotary_interleave: str | None = None
    # How the model passes the tables: ``position_embeddings`` is (cos, sin), or (sin, cos) (GPT-J);
    # each rotary_dim wide, or rotary_dim/2 with one entry per rotating pair (GPT-J; with "half",
    # whose per-pair first half is then the whole table).
    rotary_sin_first: bool = False
    rotary_pair_tables: bool = False
    # The forward argument that carries the rotary table as complex numbers c + i·s, one per pair of
    # adjacent channels, applied as (q_2i + i·q_2i+1)·(c + i·s) (Llama 4's vision ``freqs_ci``): the
    # same math as "half" with per-pair tables cos = c, sin = s (rotary_complex.py converts them).
    rotary_complex: str | None = None
    uses_mask: bool = True  # False: the forward ignores the mask it is given (Llama 4's vision attention)
    q_norm: str | None = None
    k_norm: str | None = None
    norm_per_head: bool = True  # q/k norm over head_dim (Qwen3) or over all heads at once (OLMo2)
    # Per-head q/k norms after the rotary (HunYuan's; Llama 4's text qk_norm, one weightless norm for both).
    norm_after_rope: bool = False
    # A norm of v before the attention (Gemma 4's weightless RMS norm), over head_dim or over all k/v heads.
    v_norm: str | None = None
    v_norm_per_head: bool = True
    dropout: str | None = None  # float attribute or nn.Dropout child (its .p): the attention-prob dropout
    out_dropout: str | None = None  # nn.Dropout child (GPT-2) or float p (Starcoder2) applied after `out`
    is_causal: bool = True  # causal when no mask is given (the sdpa path's convention)
    # A position bias the model passes as the forward argument ``bias`` (ALiBi), its layout and where it is
    # added (attention_bias.py); ``mask_fill``: a boolean mask True where scores are hidden (MPT).
    bias: str | None = None
    bias_batched: bool = True
    bias_mode: str = "add"
    mask_fill: bool = False
    # The forward argument the output is added to, after the output dropout (BLOOM's ``residual``).
    residual: str | None = None
    # The attention implementation the probe ran under, where the module's math depends on it (Falcon 5.17's
    # alibi paths differ between eager and sdpa): another one at call time runs the original.
    implementation: str | None = None
    # (argument, key): the forward writes its (k, v), B × kv heads × S × D, into that dict argument under that
    # key, for later layers to attend over (Gemma 4's shared_kv_states, written by a layer of each type).
    kv_out: tuple[str, str] | None = None
    # Dropout children of p = 0 that the forward calls where the fused attention applies none (BLIP's, on the
    # probabilities whatever the attention implementation): identities while p stays 0; then the original runs.
    idle_dropouts: tuple[str, ...] = ()
    # rotate-half with the sign of its halves flipped, [x2, -x1] (NanoChat): the rope of -sin.
    rotary_sin_negated: bool = False
    # The head split in this many equal parts, each rotate-half with its part of the tables, one part per axis of
    # the B × S × axes ``position_ids`` the forward is given (Gemma 4's 2-D vision rotary; the whole head rotates).
    rotary_axes: int = 1
    positional: tuple[str, ...] = ()  # the original forward's parameters after hidden_states
    same_input: tuple[str, ...] = ()  # required parameters given the hidden states again (CTRL's forward(v, k, q))
    keep: tuple[str, ...] = ()  # buffers kept for state_dict

    @property
    def rotary_table_dim(self) -> int:
        """The width of cos and sin as the model passes them."""
        return self.rotary_dim // 2 if self.rotary_pair_tables else self.rotary_dim


def _deinterleave(x: Tensor) -> Tensor:
    """Channels (0, 1, 2, 3, ...) → (0, 2, ..., 1, 3, ...)."""
    return x.unflatten(-1, (-1, 2)).transpose(-1, -2).flatten(-2)


def _interleave(x: Tensor) -> Tensor:
    """The inverse of ``_deinterleave``."""
    return x.unflatten(-1, (2, -1)).transpose(-1, -2).flatten(-2)


def _pairs_in_half_order(t: Tensor, pairs: str, rd: int) -> Tensor:
    """cos or sin for de-interleaved channels: given per channel ("pairs"), or its first half
    standing for both channels of each pair ("half"; a per-pair table is all first half)."""
    if pairs == "pairs":
        return _deinterleave(t)
    half = t[..., : rd // 2]
    return torch.cat([half, half], dim=-1)


def _axes_to_half(x: Tensor, axes: int) -> Tensor:
    """Channels [a₀ | b₀ | a₁ | b₁ | …] (rotate-half within each of ``axes`` parts) → [a₀ a₁ … | b₀ b₁ …], where
    rotate-half over the whole head pairs the same channels with the same table entries."""
    return x.unflatten(-1, (axes, 2, -1)).transpose(-3, -2).flatten(-3)


def _half_to_axes(x: Tensor, axes: int) -> Tensor:
    """The inverse of ``_axes_to_half``."""
    return x.unflatten(-1, (2, axes, -1)).transpose(-3, -2).flatten(-3)


def _attention_dtype(s: AttentionSpec, q: Tensor, k: Tensor, cache) -> torch.dtype | None:
    """The dtype rope may write q and k in: autocast's, where they come fp32 (after fp32 q/k norms: Qwen3's,
    OLMo-2's under autocast) and go nowhere but to attention, which autocast rounds them to next (SDPA is on
    its lower-precision list on every device). Rounded once by the kernel instead, the values are the same, and
    the fp32 rope outputs, SDPA's casts of them and, in the backward, the casts of dq and dk back are not made.
    None elsewhere: a cache or a hand-out keeps k as rope gives it, a norm after rope reads its output, a bias
    mask is built in q's dtype, interleaved pairs rotate through slices."""
    if q.dtype != torch.float32 or k.dtype != torch.float32 or not torch._C._is_any_autocast_enabled():
        return None
    device = q.device.type
    if (cache is not None or s.kv_out is not None or s.norm_after_rope or s.rotary_interleave is not None
            or s.bias is not None or s.mask_fill or not autocast_enabled(device)):
        return None
    return torch.get_autocast_dtype(device)


def split_concat(spec: AttentionSpec, qkv: Tensor) -> tuple[Tensor, Tensor, Tensor]:
    """q, k, v (…, heads·head_dim) from a "concat" projection's output (…, (heads + 2·kv heads)·head_dim)."""
    q_width, kv_width = (n * spec.head_dim // spec.qkv_blocks for n in (spec.num_heads, spec.num_kv_heads))
    width = {"q": q_width, "k": kv_width, "v": kv_width}
    parts = qkv.unflatten(-1, (spec.qkv_blocks, -1)).split([width[p] for p in spec.qkv_order], dim=-1)
    # A view with one block (GPT-2, Phi-3); with several, each of q, k, v is gathered from its blocks.
    q, k, v = (parts[spec.qkv_order.index(p)].flatten(-2) for p in "qkv")
    return q, k, v


def _submodule_names(spec: AttentionSpec) -> list[str]:
    names = (*spec.qkv, spec.out, spec.q_norm, spec.k_norm, spec.v_norm, *spec.keep)
    return [n for n in names if n is not None]


class FusedAttention(FusedModule):
    """Drop-in for a Hugging Face self-attention module; returns ``(output, None)`` like the sdpa path."""

    def __init__(self, original: nn.Module, spec: AttentionSpec, backend: str = "auto"):
        super().__init__(spec, backend)
        wanted = set(_submodule_names(spec))
        wanted.update(n for n in (keep_dropout(self, original, spec.dropout), keep_dropout(self, original, spec.out_dropout)) if n)
        # In the original's order, so that state_dict keys come out in the same order too.
        order = [*original._parameters, *original._buffers, *original._modules]
        adopt(self, original, [n for n in order if n in wanted])
        # Read by transformers' sdpa function and by callers (e.g. cache setup).
        self.config = getattr(original, "config", None)
        self.layer_idx = getattr(original, "layer_idx", None)
        self.num_key_value_groups = spec.num_heads // spec.num_kv_heads
        self.is_causal = spec.is_causal
        # Not a submodule: the fallback path, never part of state_dict or parameters().
        self.__dict__["_original"] = original

    @property
    def lora_summary(self) -> str | None:
        """'LoRA r=16' while PEFT adapters are active on its projections (read by the report), else None."""
        return lora.summary(self, (*self.spec.qkv, self.spec.out))

    def extra_repr(self) -> str:
        return super().extra_repr() + (f", with {t}" if (t := self.lora_summary) else "")

    # -- fallback -------------------------------------------------------------------------
    def _fallback(self, hidden_states, kwargs):
        """Run the original module on whatever this module now holds (after .to(), re-tying...)."""
        out = call_original(self, hidden_states, **kwargs)
        _attention_fallback.record_attention_weights(self.__dict__["_original"], out)
        return out

    def _fallback_reason(self, kwargs, hidden: Tensor, impl=None) -> str | None:
        """Why this call must run the original module, or None (``_attention_fallback.reason``)."""
        return _attention_fallback.reason(self, kwargs, hidden, impl)

    # -- forward --------------------------------------------------------------------------
    def _project(self, x: Tensor):
        """q, k, v as B×S×H×D."""
        s = self.spec
        lead, d = x.shape[:-1], s.head_dim
        if s.layout == "separate":
            q, k, v = project(x, [getattr(self, n) for n in s.qkv], self)
        elif s.layout == "per_head":  # per-head views (norms over all heads at once are not probed for it)
            return single(x, getattr(self, s.qkv[0]), self).view(*lead, -1, 3 * d).chunk(3, dim=-1)
        else:
            q, k, v = split_concat(s, single(x, getattr(self, s.qkv[0]), self))
        if s.q_norm is not None and not s.norm_per_head:
            q, k = getattr(self, s.q_norm)(q), getattr(self, s.k_norm)(k)
        if s.v_norm is not None and not s.v_norm_per_head:
            v = getattr(self, s.v_norm)(v)
        return q.view(*lead, -1, d), k.view(*lead, -1, d), v.view(*lead, -1, d)

    def _rope(self, q: Tensor, k: Tensor, cos: Tensor, sin: Tensor, out_dtype: torch.dtype | None = None):
        rd, pairs = self.spec.rotary_dim, self.spec.rotary_interleave
        if pairs is not None:
            # Adjacent channels rotate together: de-interleave them into rotate-half's order (evens,
            # then odds), rope there, and interleave back, so q and k (and any cache) keep their layout.
            cos, sin = _pairs_in_half_order(cos, pairs, rd), _pairs_in_half_order(sin, pairs, rd)
            qr, kr = F.rope(_deinterleave(q[..., :rd]), _deinterleave(k[..., :rd]), cos, sin, backend=self.backend)
            qr, kr = _interleave(qr), _interleave(kr)
            if rd == q.shape[-1]:
                return qr, kr
            return torch.cat([qr, q[..., rd:]], dim=-1), torch.cat([kr, k[..., rd:]], dim=-1)
        # Partial rotary too (rd < head dim): the kernel copies the channels past rd through, no slices or cat.
        # Its checks and backend once per call signature (base.decided; they read requires_grad and grad mode).
        # (base.signature's tuples written inline: one Python call less a tensor, host time of a decode step)
        key = ("rope", (type(q), q.dtype, q.device, q.shape), (type(k), k.dtype, k.device, k.shape),
               (type(cos), cos.dtype, cos.device, cos.shape), (type(sin), sin.dtype, sin.device, sin.shape),
               cos.requires_grad, sin.requires_grad, torch.is_grad_enabled(), self.backend)
        backend = decided(self, key, lambda: F.backend_for(self.backend, F.check_rope(q, k, cos, sin)))
        return ops.rope(q, k, cos, sin, backend, out_dtype)

    def forward(self, hidden_states: Tensor, *args, **kwargs):
        if not torch.is_grad_enabled() and (o := decode.original(self, hidden_states)) is not None:  # a decode step
            out = decode.run(o, hidden_states, *args, **kwargs)  # (its q/k norms follow it)
            if type(out) is tuple and len(out) > 1 and out[1] is not None:  # weights formed (eager): as _fallback
                _attention_fallback.record_attention_weights(self.__dict__["_original"], out)
            return out
        s = self.spec
        if args:  # positional arguments, named as the original forward names them
            kwargs.update(zip(s.positional, args))
        impl = getattr(self.config, "_attn_implementation", None)  # read once a call (a config read costs µs)
        why = _attention_fallback.reason(self, kwargs, hidden_states, impl)
        if why is not None:
            fallbacks.count(self, why)
            return self._fallback(hidden_states, kwargs)
        if s.same_input:  # (checked the hidden states themselves by _fallback_reason)
            kwargs = {n: v for n, v in kwargs.items() if n not in s.same_input}
        lead = hidden_states.shape[:-1]
        q, k, v = self._project(hidden_states)
        if s.q_norm is not None and s.norm_per_head and not s.norm_after_rope:
            q, k = getattr(self, s.q_norm)(q), getattr(self, s.k_norm)(k)
        if s.v_norm is not None and s.v_norm_per_head:
            v = getattr(self, s.v_norm)(v)
        base = None if torch.compiler.is_compiling() else v._base  # (compiled: the compiler plans what is saved)
        if (s.rotary_dim or s.q_norm is not None) and base is not None and base.numel() > v.numel() and torch.is_grad_enabled():
            # q and k are made anew (rope, norms); v would be the one view left of the joint projection's
            # output, and the attention's saved v would keep all of [q | k | v] alive until the backward
            # (1.5 hidden-sized tensors a token a layer at Llama-3-8B's shapes, for v's 0.25): keep a copy.
            v = v.contiguous()
        q, k, v = q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)
        cache = None
        for n in _CACHE_KWARGS:  # (a loop, not a generator: host time)
            if (cache := kwargs.get(n)) is not None:
                break
        if s.rotary_dim:
            cos, sin = (rotary_complex.tables(kwargs[s.rotary_complex], q.shape[2]) if s.rotary_complex
                        else kwargs["position_embeddings"])
            if cos.dim() == 2:  # one S × D table for every row (Pixtral's 2-D patch positions)
                cos, sin = cos.unsqueeze(0), sin.unsqueeze(0)
            if s.rotary_sin_first:
                cos, sin = sin, cos
            if s.rotary_sin_negated:
                sin = -sin
            if s.rotary_axes > 1:  # one rotate-half part per axis: rotate-half over the whole head, channels reordered
                q, k, cos, sin = (_axes_to_half(t, s.rotary_axes) for t in (q, k, cos, sin))
            q, k = self._rope(q, k, cos, sin, _attention_dtype(s, q, k, cache))
            # q·kᵀ is the same over channels reordered alike in q and k: back only where k (or a norm's weight) sees them
            if s.rotary_axes > 1 and (cache is not None or s.kv_out is not None or s.norm_after_rope):
                q, k = _half_to_axes(q, s.rotary_axes), _half_to_axes(k, s.rotary_axes)
        if s.norm_after_rope:  # over each head's channels: the B×H×S×D layout does not matter
            q, k = getattr(self, s.q_norm)(q), getattr(self, s.k_norm)(k)
        if cache is not None:
            # GPT-2 under an encoder-decoder cache keeps its self-attention states in a sub-cache.
            cache = getattr(cache, "self_attention_cache", cache)
            k, v = cache.update(k, v, self.layer_idx)
        if s.kv_out is not None:
            kwargs[s.kv_out[0]][s.kv_out[1]] = (k, v)
        # Eager attention adds the mask it is given and nothing else; sdpa falls back on is_causal
        # when the model passes no mask. Same convention here.
        eager = impl == "eager"
        mask = kwargs.get("attention_mask") if s.uses_mask else None
        if s.bias is not None or s.mask_fill:  # the module computes its attention itself: eager's convention
            eager = True
            q, mask, exact_rows = attention_bias.prepared(s, kwargs.get(s.bias), mask, q, k, hidden_states, _has_empty_rows)
        else:
            exact_rows = None
        # Eager attention gives a query whose keys are all masked a uniform softmax (min + score
        # rounds to min) and differentiates through it as plain math. PyTorch's fused SDPA kernels
        # agree on the forward but not on the backward of such rows, so only then use the math kernel.
        # Compiled code and CUDA graphs cannot branch on the mask's values: take the exact kernel
        # whenever it might matter.
        exact = exact_rows if exact_rows is not None else eager and mask is not None and mask.is_floating_point() and (
            not host_reads_allowed() or _has_empty_rows(mask)
        )
        p = dropout_p(self, s.dropout) if s.dropout is not None else 0.0
        # Packed rows (position_ids restarting, transformers' block-causal mask): variable-length attention.
        plain = s.bias is None and not s.mask_fill  # a bias lives in the dense mask: no variable-length kernel
        varlen = packed.kernel_for(q) if plain and s.is_causal and cache is None and not p and host_reads_allowed() else None
        samples = packed.segments(mask, kwargs.get("position_ids")) if varlen is not None else None
        if samples is not None:
            packed.counted(self)
            out = packed.attention(varlen, q, k, v, *samples, s.scaling)
        else:
            causal = (False if eager else None) if s.uses_mask else s.is_causal
            if exact:
                with sdpa_kernel(SDPBackend.MATH):
                    out, _ = sdpa_attention_forward(self, q, k, v, mask, dropout=p, scaling=s.scaling, is_causal=causal)
            else:  # (no context manager to enter: host time)
                out, _ = sdpa_attention_forward(self, q, k, v, mask, dropout=p, scaling=s.scaling, is_causal=causal)
        out = single(out.reshape(*lead, -1).contiguous(), getattr(self, s.out), self)
        if s.out_dropout is not None:
            out = apply_dropout(self, s.out_dropout, out)
        return (out if s.residual is None else out + kwargs[s.residual]), None
