"""Vision attention with decomposed relative positions (MViTv2; the SAM-style ViT of GOT-OCR2 and
PP-Chart2Table), as one SDPA call with an additive float mask.

The input is a (B, h, w, C) map (a whole image, or a window of one); q, k, v come from one projection
whose output is [q | k | v] (each heads × D); for query (i, j) and key (i', j') the logit is

    q·k·scale + q·R_h[i − i' + h − 1] + q·R_w[j − j' + w − 1]

with R_h, R_w the position tables (2·n − 1 rows of D, linearly resized to that length first, as the
model does: the identity at the size they were trained for). The two position terms depend on q only
through a (B·heads, h, w, h) and a (B·heads, h, w, w) product; their sum, broadcast to every (query, key)
pair, is the float mask SDPA adds to its logits. It is an ordinary differentiable tensor, so its
gradient reaches q and both tables exactly as the model's own math does. What the model materialises
besides (fp32 logits, softmax, probabilities for the backward) SDPA does not. A request for the
attention weights, input of another rank or a dropout in training runs the original module (counted).
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor, nn

from torchfuser.modules import decode, fallbacks
from torchfuser.modules.attention import _collector, _recorded_from
from torchfuser.modules.base import FusedModule, adopt, call_original
from torchfuser.modules.projections import single


@dataclass(frozen=True)
class RelPosAttentionSpec:
    """out(softmax(q·kᵀ·scaling + rel(q))·v) over a (B, h, w, C) map."""

    qkv: str  # one projection, output [q | k | v] per position (the order in qkv_order), heads × D each
    out: str
    num_heads: int
    head_dim: int
    scaling: float
    table_h: str  # position table along the map's height (rows)
    table_w: str  # along its width
    qkv_order: tuple[str, ...] = ("q", "k", "v")
    dropout: str | None = None  # float attribute: the attention-prob dropout (run by the original when > 0)
    positional: tuple[str, ...] = ()  # the original forward's parameters after hidden_states


def rel_table(table: Tensor, n: int) -> Tensor:
    """n × n × D: the row of ``table`` for each (query, key) offset along one axis of n positions, the table
    linearly resized to 2n − 1 rows first (the identity when it has that many)."""
    rows = 2 * n - 1
    resized = nn.functional.interpolate(table.t().unsqueeze(0), size=rows, mode="linear")[0].t()
    pos = torch.arange(n, device=table.device)
    return resized[pos[:, None] - pos[None, :] + n - 1]


def rel_pos_bias(q: Tensor, table_h: Tensor, table_w: Tensor, h: int, w: int) -> Tensor:
    """The position terms of the logits, N × (h·w) × (h·w), from q (N × h·w × D)."""
    qr = q.unflatten(1, (h, w))
    along_h = torch.einsum("nhwc,hkc->nhwk", qr, rel_table(table_h, h).to(q.dtype))  # N × h × w × h
    along_w = torch.einsum("nhwc,wkc->nhwk", qr, rel_table(table_w, w).to(q.dtype))  # N × h × w × w
    bias = along_h[..., :, None] + along_w[..., None, :]  # N × h × w × h × w
    return bias.reshape(q.shape[0], h * w, h * w)


class FusedRelPosAttention(FusedModule):
    """Drop-in for a relative-position vision attention called on a (B, h, w, C) map; returns (output, None)."""

    def __init__(self, original: nn.Module, spec: RelPosAttentionSpec, backend: str = "auto"):
        super().__init__(spec, backend)
        wanted = {spec.qkv, spec.out, spec.table_h, spec.table_w}
        adopt(self, original, [n for n in (*original._parameters, *original._modules) if n in wanted])
        self.num_attention_heads = spec.num_heads
        self.__dict__["_original"] = original

    def _fallback_reason(self, x: Tensor, kwargs) -> str | None:
        if x.dim() != 4:
            return f"hidden states of shape {tuple(x.shape)}, not a (batch, height, width, channels) map"
        if kwargs.get("output_attentions"):
            return "output_attentions=True (SDPA never forms the attention weights)"
        collected = _collector()
        if collected and _recorded_from(self.__dict__["_original"], collected) is not None:
            return "outputs recorded from the original module (output_attentions)"
        p = getattr(self.__dict__["_original"], self.spec.dropout, 0.0) if self.spec.dropout else 0.0
        if self.training and p:
            return f"attention dropout {p} in training (the original draws its mask on the probabilities)"
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
        b, h, w, _ = hidden_states.shape
        heads, d = s.num_heads, s.head_dim
        qkv = single(hidden_states, getattr(self, s.qkv), self).reshape(b, h * w, 3, heads, d)
        q, k, v = (qkv[:, :, s.qkv_order.index(r)].transpose(1, 2) for r in "qkv")  # B × heads × h·w × D
        bias = rel_pos_bias(q.reshape(b * heads, h * w, d), getattr(self, s.table_h), getattr(self, s.table_w), h, w)
        out = nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=bias.view(b, heads, h * w, h * w),
                                                         scale=s.scaling)
        out = out.transpose(1, 2).reshape(b, h, w, heads * d)
        return single(out, getattr(self, s.out), self), None
