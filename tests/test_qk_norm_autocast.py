"""Qwen3's q/k norms under autocast (issue 38): the norms read the bf16 projections as they are and write fp32
(no cast kernel before them, no fp32 copy saved), rope writes q and k in autocast's dtype (SDPA would round them
to it next: no fp32 rope outputs, no casts on either side of attention), and the model computes what it computed:
loss and every gradient of a tiny Qwen3 under CPU autocast within the numerics rule against float64."""
from __future__ import annotations

import copy

import pytest
import torch
from transformers import Qwen3Config, Qwen3ForCausalLM

import torchfuser
import torchfuser.modules.attention as attention
from torchfuser import ops

from numerics import assert_within_rule, needs_mlir

BF16 = torch.bfloat16


def _model():
    cfg = Qwen3Config(hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
                      num_key_value_heads=2, head_dim=16, vocab_size=128, attn_implementation="sdpa", use_cache=False)
    torch.manual_seed(0)
    return Qwen3ForCausalLM(cfg)


def _grads(model, ids, autocast: bool):
    model.zero_grad(set_to_none=True)
    with torch.autocast("cpu", dtype=BF16, enabled=autocast):
        loss = model(input_ids=ids, labels=ids).loss
    loss.backward()
    return loss.detach(), {n: p.grad for n, p in model.named_parameters()}


@pytest.mark.parametrize("backend", ["reference", pytest.param("mlir", marks=needs_mlir)])
def test_loss_and_gradients_within_rule(backend, monkeypatch):
    ids = torch.randint(0, 128, (2, 24), generator=torch.Generator().manual_seed(1))
    eager = _model()
    fused = copy.deepcopy(eager)
    torchfuser.optimize(fused, backend=backend)
    seen = []
    real = attention.sdpa_attention_forward
    monkeypatch.setattr(attention, "sdpa_attention_forward",
                        lambda m, q, k, *a, **kw: seen.append((q.dtype, k.dtype)) or real(m, q, k, *a, **kw))
    loss64, g64 = _grads(copy.deepcopy(eager).double(), ids, autocast=False)
    loss_e, g_e = _grads(eager, ids, autocast=True)
    loss_f, g_f = _grads(fused, ids, autocast=True)
    assert seen == [(BF16, BF16)] * 2  # rope wrote q and k in autocast's dtype, in both layers
    assert_within_rule(loss_f.double(), loss_e.double(), loss64, 1e-2, "loss")
    for name, g in g64.items():
        assert_within_rule(g_f[name].double(), g_e[name].double(), g, 1e-2, name)


def test_outside_autocast_rope_keeps_fp32(monkeypatch):
    """Without autocast nothing rounds q and k: rope writes them in their own dtype."""
    fused = _model()
    torchfuser.optimize(fused, backend="reference")
    asked = []
    real = ops.rope
    monkeypatch.setattr(ops, "rope", lambda *a: asked.append(a[-1]) or real(*a))
    fused(input_ids=torch.randint(0, 128, (1, 8)))
    assert asked == [None, None]


def test_qk_norms_save_the_bf16_projection(monkeypatch):
    """The q/k norms' input is saved as the projection gave it (bf16), not as an fp32 copy."""
    fused = _model()
    torchfuser.optimize(fused, backend="reference")
    calls = []
    real = ops.rms_norm
    monkeypatch.setattr(ops, "rms_norm", lambda x, *a: calls.append((x.dtype, a[-1])) or real(x, *a))
    with torch.autocast("cpu", dtype=BF16):
        fused(input_ids=torch.randint(0, 128, (1, 8))).logits.sum().backward()
    qk = [c for c in calls if c[0] == BF16]
    assert qk and all(out == torch.float32 for _, out in qk)  # bf16 read, fp32 written, in one call


def test_per_head_rows_copied_once_and_saved_dense():
    """A per-head norm of q sliced from a joint projection's output: rows not one stride apart. The op copies them
    dense once and saves that copy, so the backward reads it without copying again; values as on dense input."""
    from torchfuser.ops.rms_norm import _evenly_strided_rows

    joint = torch.randn(2, 5, 3 * 4 * 8, generator=torch.Generator().manual_seed(3), requires_grad=True)
    q = joint[..., : 4 * 8].view(2, 5, 4, 8)  # B × S × H × D, token rows 96 apart, head rows 8 apart
    assert not _evenly_strided_rows(q) and _evenly_strided_rows(joint[..., :8]) and _evenly_strided_rows(q[:, :1, :1])
    w = torch.randn(8, generator=torch.Generator().manual_seed(4))
    saved = []
    with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(t) or t, lambda t: t):
        y = ops.rms_norm(q, w, 1e-6, 0.0, "reference")
    assert any(t.shape == q.shape and t.is_contiguous() for t in saved)
    assert not any(t.shape == q.shape and not t.is_contiguous() for t in saved)
    g = torch.randn(y.shape, generator=torch.Generator().manual_seed(5))
    (dq,) = torch.autograd.grad(y, joint, g)
    dense = q.detach().contiguous().requires_grad_()
    y_dense = ops.rms_norm(dense, w, 1e-6, 0.0, "reference")
    (d_dense,) = torch.autograd.grad(y_dense, dense, g)
    assert torch.equal(y, y_dense) and torch.equal(dq[..., : 4 * 8].view(q.shape), d_dense)
