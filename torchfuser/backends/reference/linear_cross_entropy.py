"""Linear + cross-entropy: loss of softcap(hidden @ W.T + b) against labels.

The reference holds all logits; it is the oracle, not the memory-lean path. On the CPU, fp32/bf16/fp16 calls
take ``lce_chunked`` instead (the same function a chunk of tokens at a time; fp64 keeps this oracle). Gradients are
computed in the forward (for an upstream gradient of 1), as every backend does, so the
backward is a scale.

With ``fp8`` ("rowwise" / "tensorwise"; bf16 inputs, every dimension a multiple of 16, checked by the
caller) the three products are FP8 GEMMs (``_fp8_gemm.mm``) of operands quantised by reference/fp8_quant.py,
each along the product's inner dimension, and the rest is fp32, written out as the Triton backend
computes it (the oracle of its FP8 path):
    z  = q(h)·q(W)ᵀ + b                              h along H, W along H
    g  = (softmax(s) − onehot(t)) · ∂s/∂z            s = softcap(z); t = the label, column 0 where
                                                     ignored (as the Triton CE kernel writes it)
    a  = 1/#counted ('mean') or 1, 0 where ignored   (NaN for a label outside [0, V))
    dh = a ⊙ (q(g)·q(Wᵀ)ᵀ)                           g along V, Wᵀ along V
    dW = q(gᵀ)·q((a ⊙ h)ᵀ)ᵀ                          both along the tokens
    db = Σ_n a_n g_n
"""
from __future__ import annotations

import torch

from .. import _fp8_gemm
from . import lce_chunked
from ._autodiff import compute_dtype, value_and_vjp
from .fp8_quant import fp8_quantize, fp8_quantize_both


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


def linear_cross_entropy_fwd(hidden, weight, bias, labels, ignore_index, softcap, reduction, need_grad, fp8=None,
                             weight_grad=True):
    check_labels(labels, weight.shape[0], ignore_index)
    if fp8 is not None:
        return _fp8_fwd(hidden, weight, bias, labels, ignore_index, softcap, reduction, need_grad, fp8 == "tensorwise",
                        weight_grad)
    if lce_chunked.applies(hidden, weight, bias, labels, fp8):  # the CPU's fp32 path: no N×V logits (lce_chunked.py)
        return lce_chunked.linear_cross_entropy_fwd(hidden, weight, bias, labels, ignore_index, softcap, reduction,
                                                    need_grad, weight_grad)
    args = (labels, ignore_index, softcap, reduction)
    if not need_grad:  # three distinct empties: custom-op outputs must not alias each other
        loss = linear_cross_entropy(hidden, weight, bias, *args).float()
        return loss, hidden.new_empty(0), hidden.new_empty(0), hidden.new_empty(0)
    if not weight_grad:  # a frozen head: dh alone
        loss, (dh,) = value_and_vjp(lambda h: linear_cross_entropy(h, weight, bias, *args), (hidden,), 1.0)
        return loss.float(), dh.contiguous(), hidden.new_empty(0), hidden.new_empty(0)
    loss, (dh, dw, db) = value_and_vjp(
        lambda h, w, b: linear_cross_entropy(h, w, b, *args), (hidden, weight, bias), 1.0
    )
    db = hidden.new_empty(0) if db is None else db.contiguous()
    return loss.float(), dh.contiguous(), dw.contiguous(), db


def _fp8_fwd(hidden, weight, bias, labels, ignore_index, softcap, reduction, need_grad, tensorwise: bool,
             weight_grad: bool = True):
    """The FP8 form (module docstring): fp32 throughout but for the three e4m3 products."""
    f32 = torch.float32
    if need_grad:
        qw, qwt = fp8_quantize_both(weight, tensorwise)  # W for the logits, Wᵀ for dh: once per call
    else:
        qw = fp8_quantize(weight, tensorwise, False)
    z = _fp8_gemm.mm(fp8_quantize(hidden, tensorwise, False), qw, f32)
    if bias is not None:
        z = z + bias.to(f32)
    valid = labels != ignore_index
    total = token_loss(z, labels, ignore_index, softcap).sum()
    loss = total if reduction == "sum" else total / valid.sum()
    empty = hidden.new_empty(0)
    if not need_grad:
        return loss, empty, empty.clone(), empty.clone()
    vocab = weight.shape[0]
    outside = outside_vocab(labels, vocab, ignore_index)
    target = torch.where(valid & ~outside, labels, torch.zeros_like(labels))
    t = None if softcap is None else torch.tanh(z / softcap)
    s = z if t is None else t * softcap
    g = torch.softmax(s, dim=-1)
    g[torch.arange(g.shape[0], device=g.device), target] -= 1.0
    if t is not None:
        g = g * (1.0 - t) * (1.0 + t)
    scale = 1.0 if reduction == "sum" else 1.0 / valid.sum().to(f32)
    a = torch.where(valid, scale, torch.zeros((), dtype=f32, device=z.device))
    a = torch.where(outside, torch.full((), float("nan"), dtype=f32, device=z.device), a).unsqueeze(1)
    qg, qgt = fp8_quantize_both(g, tensorwise)
    dh = (a * _fp8_gemm.mm(qg, qwt, f32)).to(hidden.dtype)
    if not weight_grad:
        return loss.float(), dh, empty.clone(), empty.clone()
    hs = a * hidden.to(f32)
    dw = _fp8_gemm.mm(qgt, fp8_quantize(hs, tensorwise, True), f32).to(weight.dtype)
    db = empty.clone() if bias is None else (a * g).sum(0).to(bias.dtype)
    return loss.float(), dh, dw, db
