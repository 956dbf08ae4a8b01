"""Vision self-attention over variable-length image sequences (``cu_seqlens``): Qwen2-VL, Qwen2.5-VL
(windowed and full layers), Qwen3-VL, GLM-4V.

The module takes the patches of every image of the batch as one unbatched sequence (S × hidden) and
``cu_seqlens``, the offsets of the images (or of the windows, in a windowed layer); each patch attends to
the patches of its own image or window, with no causal mask. The original runs one attention call per
image or window in a Python loop (hundreds of small calls for a windowed layer of a large image) unless
it was loaded with FlashAttention. Here: q, k, v from the projections, rotate-half rotary on the whole
head with the (S × head_dim) tables the model passes (``functional.rope``), then

- on CUDA in fp16 / bf16: PyTorch's variable-length attention (``torch.nn.attention.varlen``) over
  ``cu_seqlens``, non-causal: one kernel for every image and window;
- elsewhere: SDPA over the block-diagonal mask that ``cu_seqlens`` delimits (made on the device, no host
  read), the same softmax over each segment.

Any call it cannot reproduce runs the original module (another attention implementation, no tables
where it rotates, batched input).
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor, nn

from torchfuser import functional as F
from torchfuser.modules import decode, fallbacks, packed
from torchfuser.modules.base import FusedModule, adopt, call_original
from torchfuser.modules.projections import project, single
from torchfuser.modules.attention import _deinterleave, _interleave

_IMPLEMENTATIONS = ("eager", "sdpa")


@dataclass(frozen=True)
class VarlenAttentionSpec:
    """out(attention within each cu_seqlens segment of rope(q), rope(k), v)."""

    layout: str  # "concat": one projection whose output is [q | k | v]; "separate": q, k, v projections
    qkv: tuple[str, ...]
    out: str
    num_heads: int
    head_dim: int
    scaling: float
    rotary: bool  # rotate-half rope of q and k with position_embeddings = (cos, sin), each S × head_dim
    q_norm: str | None = None  # per-head norms of q and k before the rotary (GLM-OCR's vision attention)
    k_norm: str | None = None
    positional: tuple[str, ...] = ()  # the original forward's parameters after hidden_states
    # Grouped k/v heads (EXAONE 4.5's vision attention): each serves num_heads / num_kv_heads query heads,
    # in order (transformers' repeat_kv). 0: as many as the query heads.
    num_kv_heads: int = 0
    returns_tuple: bool = False  # the original returns (output, attention weights) (LFM3-VL), not the output alone
    batched: bool = False  # the patches come as one row, 1 × S × hidden (HunYuan-VL), not S × hidden
    # The rotary turns adjacent channels 2i, 2i+1 together, cos / sin given per channel (Inkling 2's
    # rotate_pairwise), not rotate-half's i and i + D/2.
    rotary_pairs: bool = False

    @property
    def kv_heads(self) -> int:
        return self.num_kv_heads or self.num_heads


def segment_mask(cu: Tensor, s: int) -> Tensor:
    """S × S boolean: True where query and key lie in the same segment of ``cu`` (offsets 0 … S)."""
    starts = torch.zeros(s, dtype=torch.int32, device=cu.device)
    inner = cu[1:-1].to(device=cu.device, dtype=torch.long)
    starts.index_add_(0, inner, torch.ones_like(inner, dtype=torch.int32))
    seg = starts.cumsum(0)
    return seg[:, None] == seg[None, :]


class FusedVarlenAttention(FusedModule):
    """Drop-in for a vision attention module called as ``(hidden_states, cu_seqlens, position_embeddings)``."""

    def __init__(self, original: nn.Module, spec: VarlenAttentionSpec, backend: str = "auto"):
        super().__init__(spec, backend)
        wanted = {*spec.qkv, spec.out, spec.q_norm, spec.k_norm} - {None}
        adopt(self, original, [n for n in original._modules if n in wanted])
        self.config = getattr(original, "config", None)
        self.__dict__["_original"] = original

    def _fallback_reason(self, x: Tensor, kwargs) -> str | None:
        impl = getattr(self.config, "_attn_implementation", None)
        if impl not in _IMPLEMENTATIONS:
            return f"attention implementation {impl!r} (the fused attention reproduces eager and sdpa)"
        if x.dim() != 2 + self.spec.batched or (self.spec.batched and x.shape[0] != 1):
            want = "one row of patches, 1 × patches × hidden" if self.spec.batched else "the unbatched patches × hidden"
            return f"hidden states of shape {tuple(x.shape)}, not {want}"
        if not isinstance(kwargs.get("cu_seqlens"), Tensor):
            return "no cu_seqlens tensor given"
        if kwargs.get("attention_mask") is not None:  # LFM3-VL's vision attention adds one within each segment
            return "an attention mask given besides cu_seqlens (the fused attention masks by the segments only)"
        if self.spec.rotary:
            pe = kwargs.get("position_embeddings")
            if pe is None or tuple(pe[0].shape) != (x.shape[-2], self.spec.head_dim):
                return "no (patches × head_dim) rotary tables given"
            if torch.is_grad_enabled() and (pe[0].requires_grad or pe[1].requires_grad):
                # Tables made from trained parameters: the original differentiates through them, rope does not.
                return "rotary tables that require grad (made from trained parameters)"
        return None

    def forward(self, hidden_states: Tensor, *args, **kwargs):
        if not torch.is_grad_enabled() and (o := decode.original(self, hidden_states)) is not None:  # a decode step
            return decode.run(o, hidden_states, *args, **kwargs)
        s = self.spec
        kwargs.update(zip(s.positional, args))
        why = self._fallback_reason(hidden_states, kwargs)
        if why is not None:
            fallbacks.count(self, why)
            return call_original(self, hidden_states, **kwargs)
        x = hidden_states[0] if s.batched else hidden_states
        n, h, d = x.shape[0], s.num_heads, s.head_dim
        if s.layout == "concat":  # [q | k | v], k and v with kv_heads heads each
            qkv = single(x, getattr(self, s.qkv[0]), self)
            q, k, v = (t.view(n, -1, d) for t in qkv.split([h * d, s.kv_heads * d, s.kv_heads * d], dim=-1))
        else:
            q, k, v = (t.view(n, -1, d) for t in project(x, [getattr(self, m) for m in s.qkv], self))
        if s.q_norm is not None:
            q, k = getattr(self, s.q_norm)(q), getattr(self, s.k_norm)(k)
        q, k, v = (t.transpose(0, 1).unsqueeze(0) for t in (q, k, v))  # 1 × H × S × D
        if s.rotary:
            cos, sin = kwargs["position_embeddings"]
            if s.rotary_pairs:  # de-interleaved, pairs sit where rotate-half turns them; interleaved back after
                q, k, cos, sin = (_deinterleave(t) for t in (q, k, cos, sin))
            q, k = F.rope(q, k, cos.unsqueeze(0), sin.unsqueeze(0), backend=self.backend)
            if s.rotary_pairs:
                q, k = _interleave(q), _interleave(k)
        cu = kwargs["cu_seqlens"]
        kernel = packed.kernel_for(q)
        if kernel is not None:
            out = _varlen(kernel, q, k, v, cu, kwargs.get("max_seqlen"), s.scaling)  # S × H × D
        else:
            mask = segment_mask(cu, n)
            out = nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=s.scaling,
                                                             enable_gqa=s.kv_heads != h)
            out = out[0].transpose(0, 1)
        out = single(out.reshape(n, h * d).contiguous(), getattr(self, s.out), self)
        out = out.unsqueeze(0) if s.batched else out
        return (out, None) if s.returns_tuple else out


def _varlen(kernel, q: Tensor, k: Tensor, v: Tensor, cu: Tensor, longest, scale: float) -> Tensor:
    """Non-causal variable-length attention over the segments of ``cu``: q, k, v 1 × H × S × D → S × H × D."""
    flat = [t[0].transpose(0, 1) for t in (q, k, v)]
    cu = cu.to(device=q.device, dtype=torch.int32)
    if not isinstance(longest, int):
        longest = int(torch.diff(cu).max())
    kw = {"scale": scale}
    params = packed._parameters(kernel)
    if flat[1].shape[1] != flat[0].shape[1]:  # grouped k/v heads
        if "enable_gqa" in params:
            kw["enable_gqa"] = True
        else:  # each k/v head serves a run of query heads, as transformers' repeat_kv
            g = flat[0].shape[1] // flat[1].shape[1]
            flat[1:] = [t.repeat_interleave(g, dim=1) for t in flat[1:]]
    if "is_causal" in params:
        kw["is_causal"] = False
    else:
        kw["window_size"] = (-1, -1)  # no causal limit
    return kernel(*flat, cu, cu, longest, longest, **kw)
