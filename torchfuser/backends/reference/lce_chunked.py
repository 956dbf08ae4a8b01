"""Linear + cross-entropy on the CPU in fp32, a chunk of tokens at a time: the reference backend's fast path.

The same function as ``linear_cross_entropy.linear_cross_entropy`` (the oracle, which holds every logit and
derives the gradients with torch.func), computed the way a compiled kernel does, for an upstream gradient of 1:
for each chunk of C rows (C×V fp32 logits, ``CHUNK_BYTES``)

    z  = h_c·Wᵀ + b   (bf16/fp16 operands: the product in their dtype, as nn.Linear; then fp32)
                                      s = softcap·tanh(z/softcap) (or z)
    ℓ  = logsumexp(s) − s[label]      0 where the label is ignore_index
    g  = a ⊙ (softmax(s) − onehot(label)) ⊙ ∂s/∂z       ∂s/∂z = 1 − tanh²(z/softcap)
    dh_c = g·W        dW += gᵀ·h_c        db += Σ_rows g

with a = 1/#counted ('mean') or 1, 0 on ignored rows (0 counted: the loss is 0/0 = NaN and the gradients 0, as
the oracle gives). Nothing V-wide outlives a chunk: no N×V logits, no N×V gradient; three elementwise passes
over a chunk (logsumexp, softmax in place, the scale) where PyTorch's head + F.cross_entropy makes about six over
N×V (log_softmax, its backward, nll's zero-filled gradient, the fp32 copy) and the oracle a dozen.
Labels outside the vocabulary raise before (``check_labels``): plain CPU tensors only (the caller checks).
"""
from __future__ import annotations

import torch

# fp32 logits of one chunk. Smaller chunks (1-16 MiB) measured slower on the CPU, the three products losing
# more to their shorter row counts (dW's inner dimension) than the cache gives back; 32 and 64 MiB were even on
# one thread, and fewer chunks mean fewer parallel regions where threads wait for a busy machine's cores
# (a small model's step: 512 tokens × 32k vocabulary in one chunk).
CHUNK_BYTES = 64 << 20
MIN_CHUNK_ROWS = 64


_PLAIN = (torch.Tensor, torch.nn.Parameter)  # an untied head's weight comes as its Parameter; subclasses do not


def chunk_rows(n: int, vocab: int) -> int:
    return max(1, min(n, max(MIN_CHUNK_ROWS, CHUNK_BYTES // (4 * vocab))))


def applies(hidden, weight, bias, labels, fp8) -> bool:
    """Whether the fast path computes this call: plain fp32/bf16/fp16 CPU tensors, no FP8 (fp64: the oracle)."""
    if fp8 is not None or hidden.device.type != "cpu":
        return False
    tensors = (hidden, weight, labels) if bias is None else (hidden, weight, labels, bias)
    return (all(type(t) in _PLAIN for t in tensors)
            and all(t.dtype in (torch.float32, torch.bfloat16, torch.float16) for t in tensors if t is not labels))


def linear_cross_entropy_fwd(hidden, weight, bias, labels, ignore_index: int, softcap, reduction: str,
                             need_grad: bool, weight_grad: bool = True):
    """(loss fp32 scalar, dhidden, dweight, dbias), the reference kernel's contract (empty tensors where no
    gradient is asked for)."""
    f32 = torch.float32
    h = hidden.reshape(-1, hidden.shape[-1])
    y = labels.reshape(-1)
    n, vocab = h.shape[0], weight.shape[0]
    # The products in the operands' dtype where both are bf16/fp16 (autocast's), as nn.Linear and the
    # fused head's contract have them: the logits rounded to it once, then fp32. An fp32 GEMM of bf16
    # operands would be the slower product for no gain over that contract (6× on a CPU with bf16 dot products).
    mm = hidden.dtype if hidden.dtype == weight.dtype else f32
    w = weight.to(mm)
    b = None if bias is None else bias.to(mm)
    valid = y != ignore_index
    scale = 1.0 / valid.sum().to(f32) if reduction == "mean" else torch.ones((), dtype=f32)  # inf if none counted
    a = torch.where(valid, scale, torch.zeros((), dtype=f32))
    target = torch.where(valid, y, torch.zeros_like(y))
    total = torch.zeros((), dtype=f32)
    empty = hidden.new_empty(0)
    grads = need_grad
    dh = torch.empty(h.shape, dtype=hidden.dtype) if grads else empty
    dw = torch.zeros(weight.shape, dtype=f32) if grads and weight_grad else None
    db = torch.zeros(vocab, dtype=f32) if grads and weight_grad and b is not None else None
    c = chunk_rows(n, vocab)
    for i in range(0, n, c):
        hc = h[i:i + c].to(mm)
        z = (hc @ w.T if b is None else torch.addmm(b, hc, w.T)).to(f32)
        t = None if softcap is None else torch.tanh(z / softcap)
        s = z if t is None else t * softcap
        lse = torch.logsumexp(s, -1)
        rows = torch.arange(s.shape[0])
        picked = s[rows, target[i:i + c]]
        total += torch.where(valid[i:i + c], lse - picked, torch.zeros((), dtype=f32)).sum()
        if not grads:
            continue
        g = s.sub_(lse.unsqueeze(1)).exp_()  # softmax, in the chunk's buffer
        g[rows, target[i:i + c]] -= 1.0
        if t is not None:
            g.mul_(t.mul_(t).neg_().add_(1.0))
        g.mul_(a[i:i + c].unsqueeze(1))
        db_c = g.sum(0) if db is not None else None
        g = g.to(mm)
        dh[i:i + c] = g @ w
        if dw is not None and mm == f32:
            dw.addmm_(g.T, hc)
        elif dw is not None:
            dw += g.T @ hc  # each chunk's product rounded to bf16 once, summed in fp32
        if db is not None:
            db += db_c
    loss = total / valid.sum() if reduction == "mean" else total  # 0/0 = NaN with none counted, as the oracle
    if not grads:
        return loss, empty, empty.clone(), empty.clone()
    dh = dh.view(hidden.shape)
    if dw is None:
        return loss, dh, empty.clone(), empty.clone()
    return loss, dh, dw.to(weight.dtype), empty.clone() if db is None else db.to(bias.dtype)
