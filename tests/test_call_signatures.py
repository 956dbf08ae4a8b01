"""Fused modules do their ops' input checks and pick their backend once per call signature (``base.decided``):
FusedRMSNorm's forward, add and opening_residual, the gated MLP's activation, the attention's rotary call. A
call with anything the checks read changed (dtypes, shapes, devices, the weight object's dtype or shape, the
module's backend, GPU autocast, grad mode and requires_grad for rope) takes a fresh decision; nothing stale gives
a wrong result or skips an error."""
from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

import torchfuser
from torchfuser.modules.norms import FusedRMSNorm


class _Block(nn.Module):
    def __init__(self, width=16):
        super().__init__()
        self.norm = nn.RMSNorm(width, eps=1e-6)

    def forward(self, x):
        return self.norm(x)


def _pair():
    torch.manual_seed(0)
    ref = _Block()
    nn.init.normal_(ref.norm.weight)
    fused = torchfuser.optimize(copy.deepcopy(ref), backend="reference")
    assert isinstance(fused.norm, FusedRMSNorm)
    return ref, fused


def test_each_signature_change_is_a_fresh_decision():
    ref, fused = _pair()
    for dtype in (torch.float32, torch.bfloat16, torch.float64, torch.float32):
        x = torch.randn(3, 16, dtype=dtype)
        torch.testing.assert_close(fused(x), ref(x), rtol=0, atol=0)
    assert len(fused.norm._decisions) == 3
    ref.to(torch.bfloat16), fused.to(torch.bfloat16)  # the same Parameter object, another dtype
    x = torch.randn(5, 16, dtype=torch.bfloat16)
    got, want = fused(x), ref(x)
    assert got.dtype == want.dtype == torch.bfloat16
    torch.testing.assert_close(got.float(), want.float(), rtol=1e-2, atol=1e-2)
    assert len(fused.norm._decisions) == 4


def test_errors_are_raised_on_every_call():
    _, fused = _pair()
    fused(torch.randn(2, 16))
    for _ in range(2):
        with pytest.raises(TypeError, match="int64"):
            fused(torch.ones(2, 16, dtype=torch.long))
        with pytest.raises(ValueError, match=r"shape \(8,\)"):
            fused(torch.randn(2, 8))
    fused.norm.weight = nn.Parameter(torch.ones(8))  # another weight: checked again against x's width
    with pytest.raises(ValueError, match=r"shape \(16,\)"):
        fused(torch.randn(2, 16))


def test_backend_change_is_a_fresh_decision(monkeypatch):
    _, fused = _pair()
    seen = []
    from torchfuser import ops

    real = ops.rms_norm
    monkeypatch.setattr(ops, "rms_norm", lambda *a: seen.append(a[4]) or real(*a))  # (x, w, eps, offset, backend, out_dtype)
    x = torch.randn(2, 16)
    fused(x)
    fused.norm.backend = "reference"
    fused(x)
    assert seen == ["reference", "reference"]
    with pytest.raises(ValueError, match="valid backends"):
        fused.norm.backend = "cuda"
        fused(x)


def test_add_checks_each_signature():
    """``add`` (the residual add and the norm in one kernel, called by the fused decoder layers): the same."""
    _, fused = _pair()
    norm = fused.norm
    x, r = torch.randn(3, 16), torch.randn(3, 16)
    for _ in range(2):
        s, y = norm.add(x, r)
        torch.testing.assert_close(s, x + r, rtol=0, atol=0)
        torch.testing.assert_close(y, nn.functional.rms_norm(x + r, (16,), norm.weight, 1e-6))
    with pytest.raises(ValueError, match="same shape"):
        norm.add(x, torch.randn(2, 16))
    with pytest.raises(TypeError, match="out_dtype"):
        norm.add(x, r, out_dtype=torch.long)
    s, y = norm.add(x.bfloat16(), r.bfloat16())
    assert s.dtype == y.dtype == torch.bfloat16


def _llama():
    from transformers import LlamaConfig, LlamaForCausalLM

    cfg = LlamaConfig(hidden_size=32, intermediate_size=48, num_hidden_layers=1, num_attention_heads=4,
                      num_key_value_heads=2, vocab_size=64, attn_implementation="sdpa")
    torch.manual_seed(0)
    ref = LlamaForCausalLM(cfg)
    return ref, torchfuser.optimize(copy.deepcopy(ref), backend="reference")


def test_gated_activation_checks_each_signature():
    _, fused = _llama()
    mlp = fused.model.layers[0].mlp
    gate, up = torch.randn(2, 3, 48), torch.randn(2, 3, 48)
    for _ in range(2):
        torch.testing.assert_close(mlp._activate(gate, up), nn.functional.silu(gate) * up, rtol=0, atol=1e-6)
        packed = torch.cat([gate, up], -1)
        torch.testing.assert_close(mlp._activate(packed), nn.functional.silu(gate) * up, rtol=0, atol=1e-6)
        with pytest.raises(ValueError, match="same shape"):
            mlp._activate(gate, up[:, :2])
        with pytest.raises(TypeError, match="same dtype"):
            mlp._activate(gate, up.double())
        with pytest.raises(ValueError, match="even"):
            mlp._activate(packed[..., :-1])
    assert len(mlp._decisions) == 2


def test_rope_checks_each_signature():
    """rope's check that cos and sin need no gradient reads grad mode and requires_grad: both in the key."""
    _, fused = _llama()
    attn = fused.model.layers[0].self_attn
    q, k = torch.randn(1, 4, 5, 8), torch.randn(1, 2, 5, 8)
    cos, sin = torch.randn(1, 5, 8), torch.randn(1, 5, 8)
    from transformers.models.llama.modeling_llama import apply_rotary_pos_emb

    want = apply_rotary_pos_emb(q, k, cos, sin)
    for _ in range(2):
        got = attn._rope(q, k, cos, sin)
        torch.testing.assert_close(got[0], want[0])
        torch.testing.assert_close(got[1], want[1])
        with pytest.raises(ValueError, match="cos and sin require grad"):
            attn._rope(q, k, cos.requires_grad_(), sin)
        cos.requires_grad_(False)
        with torch.no_grad():  # requires_grad under no_grad: no error, as functional.rope
            attn._rope(q, k, cos.clone().requires_grad_(), sin)
        with pytest.raises(ValueError, match="k must be"):
            attn._rope(q, k[:, :, :4], cos, sin)
        with pytest.raises(TypeError, match="same dtype"):
            attn._rope(q, k.double(), cos, sin)


def test_generate_and_training_step_equal_unfused_after_signature_changes():
    """The decisions kept from a decode step (no grad, one token) do not leak into a training step, and back."""
    ref, fused = _llama()
    ids = torch.randint(0, 64, (2, 7), generator=torch.Generator().manual_seed(1))
    for _ in range(2):
        with torch.no_grad():
            want = ref.generate(input_ids=ids, max_new_tokens=4, do_sample=False, pad_token_id=0)
            assert torch.equal(fused.generate(input_ids=ids, max_new_tokens=4, do_sample=False, pad_token_id=0), want)
        for m in (ref, fused):
            m.zero_grad(set_to_none=True)
            m(input_ids=ids, labels=ids).loss.backward()
        for (n, p), q in zip(ref.named_parameters(), fused.parameters()):
            torch.testing.assert_close(q.grad, p.grad, rtol=1e-4, atol=1e-6, msg=n)


def _python_calls(fn, n=20) -> float:
    import cProfile
    import pstats

    fn()
    prof = cProfile.Profile()
    prof.enable()
    for _ in range(n):
        fn()
    prof.disable()
    return pstats.Stats(prof).total_calls / n


def test_python_calls_of_a_norm_call_are_bounded():
    """Host cost, counted, not timed (deterministic): a FusedRMSNorm call under no_grad (a decode step's)
    made 89 Python calls (cProfile's count, builtins included, the block around it too) before the per-signature
    decisions, 67 after (torch 2.13; transformers 5.17 and 5.25 alike)."""
    _, fused = _pair()
    x = torch.randn(8, 1, 16)
    with torch.no_grad():
        calls = _python_calls(lambda: fused(x))
    assert calls <= 70, calls
