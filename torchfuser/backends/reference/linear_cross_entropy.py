"""Linear + cross-entropy: loss of softcap(hidden @ W.T + b) against labels.

The reference holds all logits; it is the oracle, not the memory-lean path. Gradients are
computed in the forward (for an upstream gradient of 1), as every backend does, so the
backward is a scale.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from ._autodiff import compute_dtype, value_and_vjp


def linear_cross_entropy(hidden, weight, bias, labels, ignore_index: int, softcap: float | None, reduction: str):
    ct = compute_dtype(hidden, weight)
    logits = hidden.to(ct) @ weight.to(ct).T
    if bias is not None:
        logits = logits + bias.to(ct)
    if softcap is not None:
        logits = torch.tanh(logits / softcap) * softcap
    return F.cross_entropy(logits, labels, ignore_index=ignore_index, reduction=reduction)


def linear_cross_entropy_fwd(hidden, weight, bias, labels, ignore_index, softcap, reduction, need_grad):
    args = (labels, ignore_index, softcap, reduction)
    if not need_grad:  # three distinct empties: custom-op outputs must not alias each other
        loss = linear_cross_entropy(hidden, weight, bias, *args).float()
        return loss, hidden.new_empty(0), hidden.new_empty(0), hidden.new_empty(0)
    loss, (dh, dw, db) = value_and_vjp(
        lambda h, w, b: linear_cross_entropy(h, w, b, *args), (hidden, weight, bias), 1.0
    )
    db = hidden.new_empty(0) if db is None else db.contiguous()
    return loss.float(), dh.contiguous(), dw.contiguous(), db
