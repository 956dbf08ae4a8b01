"""linear_cross_entropy on the CPU: matmuls in PyTorch (oneDNN/MKL), the head fused by MLIR.

    for each chunk of C tokens (C·V fp32 logits, one buffer reused by every chunk):
        z  = h_c @ W.T + b                          torch.addmm into the chunk buffer
        z ← ∂loss/∂z, loss_c = head(z, labels_c)    one MLIR row kernel, ∂z written over z
        dh_c = z @ W;  dW += z.T @ h_c;  db += Σ z   torch (only when gradients are wanted)

``head`` per token (a row of V logits), in fp32:
    s    = tanh(z / cap) · cap            (when softcap is set, else s = z)
    lse  = m + log Σ exp(s − m),  m = max s (a constant for the gradient: it cancels)
    loss = (lse − s[label]) · [label ≠ ignore_index]   (NaN for a label outside [0, V); raised before)
and ∂z = scale · ∂loss/∂z = scale · (softmax(s) − onehot(label)) · ∂s/∂z · [label ≠ ignore],
derived by ``torch.func.vjp`` from ``head`` (never written by hand); ``scale`` is 1/#valid
tokens for ``mean`` and 1 for ``sum``. The label is picked with an iota comparison instead of
gather/scatter, so the row stays a pure elementwise + reduction program for the pipeline.
``head`` is the reference's own ``token_loss`` (reference/linear_cross_entropy.py), the one
definition of the loss. Full logits never exist: peak extra memory is
one C×V fp32 chunk (``CHUNK_BYTES``) and, for bf16/fp16 weights, an fp32 copy of W.
"""
from __future__ import annotations

import torch

from torchfuser.backends.reference.linear_cross_entropy import check_labels, token_loss

from .capture import BCAST, ROW, ArgSpec
from .compile import kernel_for
from .ops import check_dtypes

CHUNK_BYTES = 32 << 20   # fp32 logits of one chunk
MIN_CHUNK_ROWS = 64      # below this the matmuls lose too much efficiency


def _head(ignore_index: int, softcap: float | None):
    def head(z, label):
        return token_loss(z, label, ignore_index, softcap)

    def head_and_grad(z, label, scale):
        loss, pullback = torch.func.vjp(lambda z_: head(z_, label), z)
        (dz,) = pullback(scale.expand(loss.shape))
        return loss, dz

    return head_and_grad


def _kernel(vocab: int, ignore_index: int, softcap: float | None):
    return kernel_for(
        "lce_head", {"ignore_index": ignore_index, "softcap": softcap},
        _head(ignore_index, softcap),
        [ArgSpec(ROW, (vocab,), torch.float32), ArgSpec(ROW, (), torch.int64), ArgSpec(BCAST, (), torch.float32)],
    )


def chunk_rows(n: int, vocab: int) -> int:
    return max(1, min(n, max(MIN_CHUNK_ROWS, CHUNK_BYTES // (4 * vocab))))


def linear_cross_entropy_fwd(hidden, weight, bias, labels, ignore_index, softcap, reduction, need_grad, fp8=None,
                             weight_grad=True):
    """Same contract as the reference: (loss fp32 scalar, dhidden, dweight, dbias) for an upstream
    gradient of 1; the gradients are empty unless ``need_grad``, dweight and dbias unless ``weight_grad``.
    No FP8 GEMMs here (``fp8`` must be None: ops.linear_cross_entropy routes FP8 elsewhere)."""
    assert fp8 is None, "the MLIR backend has no FP8 GEMMs"
    check_dtypes("linear_cross_entropy", hidden, weight, bias)
    h = hidden.reshape(-1, hidden.shape[-1])
    y = labels.reshape(-1).long()
    if y.stride(0) != 1:
        y = y.contiguous()
    n, vocab = h.shape[0], weight.shape[0]
    check_labels(y, vocab, ignore_index)  # the kernel would give NaN; on the CPU a clear error is free
    w32 = weight.float()
    b32 = None if bias is None else bias.float()
    valid = int((y != ignore_index).sum()) if reduction == "mean" else 0
    scale = torch.tensor(1.0 / valid if valid else float("nan")) if reduction == "mean" else torch.tensor(1.0)
    kernel = _kernel(vocab, ignore_index, softcap)
    c = chunk_rows(n, vocab)
    z_buf = torch.empty(c, vocab, dtype=torch.float32)
    loss_rows = torch.empty(n, dtype=torch.float32)
    if need_grad:
        dh = torch.empty_like(h, memory_format=torch.contiguous_format)
        dh32 = dh if dh.dtype == torch.float32 else torch.empty(c, h.shape[1], dtype=torch.float32)
        dw = torch.zeros(vocab, h.shape[1], dtype=torch.float32) if weight_grad else None
        db = None if bias is None or not weight_grad else torch.zeros(vocab, dtype=torch.float32)
    for s in range(0, n, c):
        e = min(n, s + c)
        hc = h[s:e].float()
        z = z_buf[: e - s]
        if b32 is None:
            torch.mm(hc, w32.t(), out=z)
        else:
            torch.addmm(b32, hc, w32.t(), out=z)
        # ∂loss/∂z overwrites z in place (the kernel reads each row before writing it).
        loss_c, _ = kernel(z, y[s:e], scale, out=[loss_rows[s:e], z])
        if need_grad:
            if dh32 is dh:
                torch.mm(z, w32, out=dh[s:e])
            else:
                dh[s:e].copy_(torch.mm(z, w32, out=dh32[: e - s]))
            if dw is not None:
                dw.addmm_(z.t(), hc)
            if db is not None:
                db += z.sum(0)
    # One rounding for the whole reduction: the per-token losses are added in fp64.
    total = loss_rows.double().sum()
    loss = (total * scale.double() if reduction == "mean" else total).float()
    if not need_grad:
        return loss, hidden.new_empty(0), hidden.new_empty(0), hidden.new_empty(0)
    if not weight_grad:
        return loss, dh.view(hidden.shape), hidden.new_empty(0), hidden.new_empty(0)
    dbias = hidden.new_empty(0) if bias is None else db.to(bias.dtype)
    return loss, dh.view(hidden.shape), dw.to(weight.dtype), dbias
