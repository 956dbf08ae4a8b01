"""Fused models under ``torch.inference_mode()`` and ``torch.no_grad()``, with padding masks.

Tensors made under inference_mode have no version counter, which the attention's mask checks
(``modules.attention._has_empty_rows``, ``modules.packed.segments``) key their per-mask caches on:
such masks are checked on every call instead, and a write to one in place is seen.
"""
from __future__ import annotations

import copy

import pytest
import torch

import torchfuser
from torchfuser.modules import attention, fallbacks, packed

from test_architectures import batch, make
from test_packed_attention import CFG, _PerSample, _positions

CONTEXTS = {"inference_mode": torch.inference_mode, "no_grad": torch.no_grad}


@pytest.mark.parametrize("context", list(CONTEXTS))
@pytest.mark.parametrize("impl", ["eager", "sdpa"])
@pytest.mark.parametrize("model_type", ["llama", "gpt2", "qwen2"])
def test_padded_forward_and_generate_equal_unfused(model_type, impl, context):
    """A left-padded batch (rows whose keys are all masked: eager's exact path) gives the unfused
    logits, and greedy generation the unfused tokens, with no call leaving the fused path."""
    ref = make(model_type)
    ref.config._attn_implementation = impl
    fused = torchfuser.optimize(copy.deepcopy(ref), backend="reference")
    ref.eval(), fused.eval()
    ids, mask, _ = batch(padded=True)
    with CONTEXTS[context]():
        for _ in range(2):  # the second call with a mask of the same values: no stale answer
            want = ref(input_ids=ids, attention_mask=mask, use_cache=False).logits
            got = fused(input_ids=ids, attention_mask=mask, use_cache=False).logits
            torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
        kw = dict(input_ids=ids, attention_mask=mask, max_new_tokens=4, do_sample=False, pad_token_id=0)
        assert torch.equal(fused.generate(**kw), ref.generate(**kw))
    assert not fallbacks.counts(fused)


def test_empty_rows_of_an_inference_mask_follow_writes_in_place():
    """An inference tensor has no version to cache on: a write in place must change the answer."""
    with torch.inference_mode():
        mask = torch.zeros(1, 1, 3, 3)
        assert mask.is_inference() and not attention._has_empty_rows(mask)
        mask[0, 0, 1] = torch.finfo(mask.dtype).min
        assert attention._has_empty_rows(mask)
        mask.zero_()
        assert not attention._has_empty_rows(mask)


def test_packed_segments_of_an_inference_mask():
    pos = _positions([3, 5], [2, 4, 2])
    sample = (pos == 0).reshape(-1).cumsum(0).view(pos.shape)
    with torch.inference_mode():
        mask = (torch.ones(8, 8, dtype=torch.bool).tril() & (sample[:, :, None] == sample[:, None, :]))[:, None]
        cu, longest = packed.segments(mask, pos)
        assert cu.tolist() == [0, 3, 8, 10, 14, 16] and longest == 5
        mask[1, :, :, -2:] = False  # padding now: not the samples' block-causal mask
        assert packed.segments(mask, pos) is None


@pytest.mark.parametrize("context", list(CONTEXTS))
def test_packed_rows_under_inference_mode(monkeypatch, context):
    """Packed rows in eval (variable-length attention; on the CPU a per-sample stand-in for PyTorch's
    kernel): the unfused logits, under inference_mode as under no_grad."""
    kernel = _PerSample()
    monkeypatch.setattr(packed, "kernel_for", lambda q: kernel)
    from transformers import LlamaConfig, LlamaForCausalLM

    cfg = LlamaConfig(**CFG, attn_implementation="eager")
    torch.manual_seed(0)
    ref = LlamaForCausalLM(cfg).eval()
    fused = torchfuser.optimize(copy.deepcopy(ref), backend="reference")
    pos = _positions([7, 12, 5], [20, 4])
    ids = torch.randint(0, 100, pos.shape, generator=torch.Generator().manual_seed(2))
    with CONTEXTS[context]():
        want = ref(input_ids=ids, position_ids=pos, use_cache=False).logits
        got = fused(input_ids=ids, position_ids=pos, use_cache=False).logits
    assert kernel.calls == cfg.num_hidden_layers
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
