"""The reference backend's CPU path for linear + cross-entropy (reference/lce_chunked.py), a chunk of tokens at a
time with the gradients written out: loss and every gradient against the float64 oracle (the reference's own
definition, differentiated by torch.func), held to twice PyTorch's own error in the same dtype (F.linear +
F.cross_entropy on fp32 logits, as Hugging Face heads compute) plus a small atol."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from torchfuser.backends.reference import lce_chunked
from torchfuser.backends.reference import linear_cross_entropy as ref

IGNORE = -100


def _case(n, h, v, dtype, bias, seed=0, ignored=True):
    g = torch.Generator().manual_seed(seed)
    hidden = torch.randn(n, h, generator=g).to(dtype)
    weight = (torch.randn(v, h, generator=g) * h ** -0.5).to(dtype)
    b = (torch.randn(v, generator=g) * 0.1).to(dtype) if bias else None
    labels = torch.randint(0, v, (n,), generator=g)
    if ignored:
        labels[1::3] = IGNORE  # (row 0 counted: a single row is not all ignored)
    return hidden, weight, b, labels


def _oracle64(hidden, weight, bias, labels, softcap, reduction):
    out = ref.linear_cross_entropy_fwd(hidden.double(), weight.double(), None if bias is None else bias.double(),
                                       labels, IGNORE, softcap, reduction, True)
    return out[0], out[1], out[2], out[3] if bias is not None else None


def _torch_same_dtype(hidden, weight, bias, labels, softcap, reduction):
    leaves = [t.detach().clone().requires_grad_() for t in (hidden, weight) + ((bias,) if bias is not None else ())]
    z = F.linear(leaves[0], leaves[1], leaves[2] if bias is not None else None)
    if softcap is not None:
        z = torch.tanh(z / softcap) * softcap
    loss = F.cross_entropy(z.float().view(-1, z.shape[-1]), labels.view(-1), ignore_index=IGNORE, reduction=reduction)
    grads = torch.autograd.grad(loss, leaves)
    return loss, grads[0], grads[1], grads[2] if bias is not None else None


def _err(a, ref64):
    return (a.double() - ref64).abs().max().item()


def _check(got, ours, theirs, atol):
    names = ("loss", "dhidden", "dweight", "dbias")
    for name, g, o, t in zip(names, got, ours, theirs):
        if o is None:
            continue
        assert g.shape == o.shape, name
        assert torch.isfinite(g).all(), name
        assert _err(g, o) <= 2 * _err(t, o) + atol, (name, _err(g, o), _err(t, o))


@pytest.mark.parametrize("dtype, atol", [(torch.float32, 1e-6), (torch.bfloat16, 1e-3), (torch.float16, 1e-4)])
@pytest.mark.parametrize("n, h, v, bias, softcap, reduction", [
    (1, 16, 37, False, None, "mean"),  # a single row
    (123, 123, 123, True, None, "sum"),  # odd sides
    (200, 24, 1001, True, 30.0, "mean"),  # several chunks (CHUNK_BYTES shrunk below), a partial last one, softcap
])
def test_loss_and_every_gradient_against_float64(monkeypatch, dtype, atol, n, h, v, bias, softcap, reduction):
    monkeypatch.setattr(lce_chunked, "CHUNK_BYTES", 64 * 4 * v)
    monkeypatch.setattr(lce_chunked, "MIN_CHUNK_ROWS", 16)
    hidden, weight, b, labels = _case(n, h, v, dtype, bias)
    assert lce_chunked.applies(hidden, weight, b, labels, None)
    got = ref.linear_cross_entropy_fwd(hidden, weight, b, labels, IGNORE, softcap, reduction, True)
    assert got[1].dtype == dtype and got[2].dtype == dtype and got[0].dtype == torch.float32
    if b is None:
        assert got[3].numel() == 0
        got = got[:3] + (None,)
    _check(got, _oracle64(hidden, weight, b, labels, softcap, reduction),
           _torch_same_dtype(hidden, weight, b, labels, softcap, reduction), atol)


def test_three_dim_and_non_contiguous_hidden():
    hidden, weight, _, labels = _case(2 * 40, 32, 300, torch.float32, False)
    h3 = hidden.view(40, 2, 32).transpose(0, 1)  # B×S×H, not contiguous
    y3 = labels.view(40, 2).T
    got = ref.linear_cross_entropy_fwd(h3, weight, None, y3, IGNORE, None, "mean", True)
    want = _oracle64(h3.contiguous(), weight, None, y3.contiguous(), None, "mean")
    assert got[1].shape == h3.shape
    torch.testing.assert_close(got[0].double(), want[0].double(), rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(got[1].double(), want[1], rtol=1e-5, atol=1e-7)
    torch.testing.assert_close(got[2].double(), want[2], rtol=1e-5, atol=1e-7)


def test_without_grad_and_with_a_frozen_head_the_same_values():
    hidden, weight, b, labels = _case(50, 16, 70, torch.float32, True)
    full = ref.linear_cross_entropy_fwd(hidden, weight, b, labels, IGNORE, 5.0, "mean", True)
    nograd = ref.linear_cross_entropy_fwd(hidden, weight, b, labels, IGNORE, 5.0, "mean", False)
    frozen = ref.linear_cross_entropy_fwd(hidden, weight, b, labels, IGNORE, 5.0, "mean", True, None, False)
    assert torch.equal(nograd[0], full[0]) and all(t.numel() == 0 for t in nograd[1:])
    assert torch.equal(frozen[1], full[1]) and frozen[2].numel() == 0 and frozen[3].numel() == 0


def test_every_label_ignored_gives_nan_loss_and_zero_gradients_as_the_oracle():
    hidden, weight, b, labels = _case(8, 16, 20, torch.float32, True)
    labels[:] = IGNORE
    got = ref.linear_cross_entropy_fwd(hidden, weight, b, labels, IGNORE, None, "mean", True)
    want = _oracle64(hidden, weight, b, labels, None, "mean")
    assert torch.isnan(got[0]) and torch.isnan(want[0])
    for g, w in zip(got[1:], want[1:]):
        assert torch.equal(g.double(), w) and not g.any()


def test_a_label_outside_the_vocabulary_raises():
    hidden, weight, _, labels = _case(8, 16, 20, torch.float32, False)
    labels[2] = 20
    with pytest.raises(IndexError, match="outside the vocabulary"):
        ref.linear_cross_entropy_fwd(hidden, weight, None, labels, IGNORE, None, "mean", True)


def test_plain_tensors_and_parameters_take_it():
    hidden, weight, b, labels = _case(4, 8, 10, torch.float32, True)
    assert lce_chunked.applies(hidden, weight, b, labels, None)
    assert lce_chunked.applies(hidden, torch.nn.Parameter(weight), torch.nn.Parameter(b), labels, None)  # untied heads


def test_an_untied_head_runs_it(monkeypatch):
    from transformers import LlamaConfig, LlamaForCausalLM

    import torchfuser

    calls = []
    real = lce_chunked.linear_cross_entropy_fwd
    monkeypatch.setattr(lce_chunked, "linear_cross_entropy_fwd", lambda *a, **k: calls.append(1) or real(*a, **k))
    cfg = LlamaConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=4,
                      num_key_value_heads=2, vocab_size=64, tie_word_embeddings=False)
    torch.manual_seed(0)
    model = torchfuser.optimize(LlamaForCausalLM(cfg), backend="reference", patterns=["lm_head_loss"])
    ids = torch.randint(0, 64, (2, 8))
    model(input_ids=ids, labels=ids).loss.backward()
    assert calls and model.lm_head.weight.grad is not None


def test_what_takes_the_oracle_instead():
    hidden, weight, b, labels = _case(4, 8, 10, torch.float32, True)
    assert not lce_chunked.applies(hidden.double(), weight.double(), None, labels, None)  # the fp64 oracle itself
    assert not lce_chunked.applies(hidden.bfloat16(), weight.bfloat16(), None, labels, "rowwise")  # FP8 GEMMs
    assert not lce_chunked.applies(hidden, weight, b.double(), labels, None)
    assert not lce_chunked.applies(hidden.to("meta"), weight.to("meta"), None, labels.to("meta"), None)
