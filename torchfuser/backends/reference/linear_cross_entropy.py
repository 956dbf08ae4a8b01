"""Linear + cross-entropy: loss of softcap(hidden @ W.T + b) against labels.

The reference holds all logits; it is the oracle, not the memory-lean path. Gradients are
computed in the forward (for an upstream gradient of 1), as every backend does, so the
backward is a scale.
"""
from __future__ import annotations

import torch

from ._autodiff import compute_dtype, value_and_vjp


def token_loss(z, label, ignore_index: int, softcap: float | None):
    """Cross-entropy of each row of logits ``z`` (…×V) against ``label`` (…), 0 where ignored.

    The label's logit is picked by comparing with an iota rather than by gather, so that the
    same definition compiles as a pure elementwise + reduction row program (the MLIR backend
    derives its kernel from this function).
    """
    s = z if softcap is None else torch.tanh(z / softcap) * softcap
    m = s.amax(-1, keepdim=True).detach()  # a constant for the gradient: it cancels
    lse = (s - m).exp().sum(-1).log() + m.squeeze(-1)
    onehot = torch.arange(z.shape[-1], dtype=label.dtype, device=z.device) == label.unsqueeze(-1)
    picked = torch.where(onehot, s, torch.zeros((), dtype=s.dtype, device=s.device)).sum(-1)
    loss = torch.where(label != ignore_index, lse - picked, torch.zeros((), dtype=s.dtype, device=s.device))
    # A label outside the vocabulary would pick nothing and give a finite loss: NaN instead (a
    # factor, so that the row's gradient is NaN too), where the host check (``check_labels``) is
    # not free. Not NaN·0 for the others: that is NaN.
    nan, one = (torch.full((), v, dtype=s.dtype, device=s.device) for v in (float("nan"), 1.0))
    return loss * torch.where(outside_vocab(label, z.shape[-1], ignore_index), nan, one)


def outside_vocab(label, vocab: int, ignore_index: int):
    """Labels that are neither ignore_index nor a class in [0, vocab)."""
    return (label != ignore_index) & ((label < 0) | (label >= vocab))


def check_labels(labels, vocab: int, ignore_index: int) -> None:
    """Raise, as PyTorch's cross_entropy does, for a label outside the vocabulary. Only for labels
    on the CPU, where reading the answer costs no wait for a device (elsewhere the loss is NaN);
    fake or traced tensors have no values to check."""
    if type(labels) is not torch.Tensor or labels.device.type != "cpu":
        return
    bad = outside_vocab(labels, vocab, ignore_index)
    if bool(bad.any()):
        raise IndexError(
            f"linear_cross_entropy: label {int(labels[bad][0])} is outside the vocabulary [0, {vocab}) and is not "
            f"ignore_index ({ignore_index}); {int(bad.sum())} such label(s)")


def linear_cross_entropy(hidden, weight, bias, labels, ignore_index: int, softcap: float | None, reduction: str):
    ct = compute_dtype(hidden, weight)
    logits = hidden.to(ct) @ weight.to(ct).T
    if bias is not None:
        logits = logits + bias.to(ct)
    total = token_loss(logits, labels, ignore_index, softcap).sum()
    # mean over counted tokens; with none counted this is 0/0 = nan, as F.cross_entropy gives
    return total if reduction == "sum" else total / (labels != ignore_index).sum()


def linear_cross_entropy_fwd(hidden, weight, bias, labels, ignore_index, softcap, reduction, need_grad):
    check_labels(labels, weight.shape[0], ignore_index)
    args = (labels, ignore_index, softcap, reduction)
    if not need_grad:  # three distinct empties: custom-op outputs must not alias each other
        loss = linear_cross_entropy(hidden, weight, bias, *args).float()
        return loss, hidden.new_empty(0), hidden.new_empty(0), hidden.new_empty(0)
    loss, (dh, dw, db) = value_and_vjp(
        lambda h, w, b: linear_cross_entropy(h, w, b, *args), (hidden, weight, bias), 1.0
    )
    db = hidden.new_empty(0) if db is None else db.contiguous()
    return loss.float(), dh.contiguous(), dw.contiguous(), db
