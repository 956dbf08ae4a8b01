"""Position biases on the attention scores, folded into SDPA's additive float mask.

ALiBi adds slope_h · position_k to every score of head h. Models pass it to their attention as a
tensor argument (BLOOM's and transformers 5.17 Falcon's ``alibi``, MPT's ``position_bias``) in one
of two layouts, which the pattern's probe tells apart (``AttentionSpec.bias_batched``):

- batched: (batch·heads, 1 or q, kv) (BLOOM, Falcon; or already (batch, heads, 1 or q, kv): Falcon in
  transformers 5.17), viewed as (batch, heads, 1 or q, kv);
- per head: (heads, 1 or q, n ≥ kv) (MPT, whose table is max_seq_len wide: the last kv columns).

and adds it at one of three points (``AttentionSpec.bias_mode``): ``"add"`` after the scaling
(BLOOM: alibi + q·kᵀ·scale, MPT), ``"scaled"`` before it ((q·kᵀ + alibi)·scale: Falcon's eager
path), or ``"ignore"`` (the argument only switches the rotary off and the bias arrives inside the
mask: Falcon's sdpa path in transformers 5.17). softmax(q·kᵀ·s + b + m) is then SDPA with the float
mask b + m, which the math, efficient and cuDNN kernels take, forward and backward. A bias that
does not fit the layout found (another width, a missing argument) makes the call run the
original module (counted), never a guess.

``mask_fill``: the mask is boolean and True where the score is *replaced* by the dtype's minimum
(MPT's ``masked_fill``), the opposite of SDPA's boolean convention; as an additive mask it is
min where True: min + a finite bias rounds to min, so both give the same softmax.
"""
from __future__ import annotations

import torch
from torch import Tensor

from torchfuser.modules.base import host_reads_allowed

BIAS_MODES = ("add", "scaled", "ignore")
BIAS_ARGS = ("alibi", "position_bias")  # the forward arguments that carry a position bias


def call_reason(spec, kwargs: dict, hidden: Tensor, impl: str | None) -> str | None:
    """Why this call must run the original module, as far as biases, the implementation and a residual
    argument go (FusedAttention's other reasons are its own), or None."""
    if spec.bias is None:
        for a in BIAS_ARGS:  # (a loop, not a generator: every fused attention call reads these)
            if kwargs.get(a) is not None:
                return "called with a position bias (alibi), which the fused attention does not add"
    if spec.implementation is not None and impl != spec.implementation:
        return f"attention implementation {impl!r}, not the {spec.implementation!r} it was fused under"
    if spec.bias is not None and (why := unusable(spec, kwargs.get(spec.bias), hidden)) is not None:
        return why
    if spec.residual is not None and kwargs.get(spec.residual) is None:
        return f"no {spec.residual!r} given (the fused attention adds it to its output)"
    return None


def prepared(spec, bias, mask, q: Tensor, k: Tensor, hidden: Tensor, has_empty_rows):
    """(q, the additive mask SDPA gets, whether the exact math kernel must run) for a module that adds a
    bias or hides scores with a boolean mask itself. ``has_empty_rows``: the cached check of a float mask."""
    if (why := unusable(spec, bias, hidden, k.shape[2])) is not None:  # after a cache update: never a fallback
        raise ValueError(f"fused attention: {why}")
    raw = mask
    mask = combined_mask(spec, bias, mask, q.shape[0], k.shape[2], q.dtype)
    # Rows with every key hidden are those of the mask alone (the bias is finite): checked on the model's
    # mask object, once per forward for a float one; always taken as possible where host reads are not.
    exact = raw is not None and (not host_reads_allowed() or (
        bool((raw if spec.mask_fill else ~raw).all(dim=-1).any()) if raw.dtype == torch.bool else has_empty_rows(raw)))
    if exact and spec.mask_fill and raw.dtype == torch.bool:
        # masked_fill passes no gradient to the scores it fills: a query with every key hidden gets none
        # through q·kᵀ there, which adding the minimum would pass. Zeroing that query keeps its scores
        # (min either way) and gives q and k the original's zero gradient from it.
        q = q * (~raw.all(dim=-1, keepdim=True)).to(q.dtype)
    return q, mask, exact


def unusable(spec, bias, hidden: Tensor, kv_len: int | None = None) -> str | None:
    """Why this call's position bias cannot be folded into the mask (the original runs), or None."""
    if spec.bias is None:
        return None
    if bias is None:
        return f"called without its position bias {spec.bias!r} (it was fused with one)"
    if spec.bias_mode == "ignore":
        return None
    batch, q_len, heads = hidden.shape[0], hidden.shape[1], spec.num_heads
    if isinstance(bias, Tensor) and bias.dim() == 4 and spec.bias_batched and bias.shape[:2] == (batch, heads):
        bias = bias.flatten(0, 1)  # (batch, heads, ...) as transformers 5.17's Falcon passes it: the same view
    if not isinstance(bias, Tensor) or bias.dim() != 3 or not bias.is_floating_point():
        return f"position bias {spec.bias!r} is not a 3-D float tensor"
    lead = batch * heads if spec.bias_batched else heads
    if bias.shape[0] != lead or bias.shape[1] not in (1, q_len):
        return (f"position bias {spec.bias!r} of shape {tuple(bias.shape)}, not ({lead}, 1 or {q_len}, keys) "
                "as found when it was fused")
    if kv_len is not None and (bias.shape[2] < kv_len if not spec.bias_batched else bias.shape[2] != kv_len):
        return f"position bias {spec.bias!r} {bias.shape[2]} keys wide for {kv_len} keys"
    return None


def _additive(masked: Tensor, dtype: torch.dtype) -> Tensor:
    """A boolean mask that is True where a score is hidden → an additive float mask (min there, 0 elsewhere)."""
    low, zero = (torch.tensor(v, dtype=dtype, device=masked.device) for v in (torch.finfo(dtype).min, 0.0))
    return torch.where(masked, low, zero)


def combined_mask(spec, bias: Tensor | None, mask: Tensor | None, batch: int, kv_len: int, dtype: torch.dtype):
    """The additive float mask SDPA is given: the bias as the module adds it, plus the mask (B×H×q×kv)."""
    if mask is not None and mask.dtype == torch.bool:
        # MPT's convention (True hides) or SDPA's (True attends): as a float mask, to add the bias to.
        mask = _additive(mask if spec.mask_fill else ~mask, dtype)
    if spec.bias is None or spec.bias_mode == "ignore":
        return mask
    rows = bias.shape[-2]
    b = bias.view(batch, spec.num_heads, rows, -1) if spec.bias_batched else bias[:, :, -kv_len:].unsqueeze(0)
    if spec.bias_mode == "scaled":
        b = b * spec.scaling
    if mask is None:
        return b
    # The module adds the bias to the scores and the mask after it; adding them here first gives the same
    # scores: the mask is 0 (b + 0 = b exactly) or the minimum (b + min rounds to min, as score + b + min does).
    return b.to(mask.dtype) + mask
