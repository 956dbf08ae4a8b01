"""Outputs a model is asked for at call time come back from a fused model as from the original.

transformers 5 collects ``output_attentions`` / ``output_hidden_states`` with forward hooks
(``utils.output_capturing``: ``capture_outputs``, ``OutputRecorder``, ``_can_record_outputs``),
and a model may take the flag and not pass it on (GPT-2 pops it): the fused attention sees the
request in transformers' active collector, runs the original (SDPA never forms the weights) and
counts that call. Hidden states are recorded on the decoder layers, which keep their class: they
need no fallback, and the attention stays fused.
"""
from __future__ import annotations

import copy

import pytest
import torch

import torchfuser
from torchfuser.modules import FusedAttention, fallbacks

from test_architectures import ARCHS, batch, make

WHY = "output_attentions=True (SDPA never forms the attention weights)"


def _pair(model_type, impl="eager", **overrides):
    ref = make(model_type, **overrides)
    ref.config._attn_implementation = impl
    fused = torchfuser.optimize(copy.deepcopy(ref), backend="reference")
    return ref.eval(), fused.eval()


def _fused_attention(model):
    return {n: m for n, m in model.named_modules() if isinstance(m, FusedAttention)}


def _same_maps(got, want, layers=2):
    assert got is not None and want is not None
    assert len(got) == len(want) == layers
    for x, y in zip(got, want):
        assert x.shape == y.shape
        torch.testing.assert_close(x, y, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("model_type", list(ARCHS))
def test_output_attentions_at_call_time_every_architecture(model_type):
    """Eager attention, ``output_attentions=True`` passed to the call: one map per layer, (batch, heads,
    query, key), equal to the unfused model's; each fused attention's fallback counted with its reason."""
    ref, fused = _pair(model_type)
    attention = _fused_attention(fused)  # none where the pattern skips it (Gemma-2's softcapping): same maps
    ids, mask, _ = batch()
    with torch.no_grad():
        want = ref(input_ids=ids, attention_mask=mask, output_attentions=True)
        got = fused(input_ids=ids, attention_mask=mask, output_attentions=True)
    _same_maps(got.attentions, want.attentions)
    heads = want.attentions[0].shape[1]
    assert got.attentions[0].shape == (2, heads, 10, 10)
    torch.testing.assert_close(got.logits, want.logits, rtol=1e-5, atol=1e-5)
    assert fallbacks.counts(fused) == {n: {WHY: 1} for n in attention}


@pytest.mark.parametrize("hooked_before", [False, True])
@pytest.mark.parametrize("model_type", ["gpt2", "llama"])
def test_output_attentions_in_training_hooks_installed_before_or_after_fusion(model_type, hooked_before):
    """transformers installs its capture hooks on the first request: before fusion they sit on the
    original attention modules, after it on none. Either way the maps come back, in training mode
    too, with the loss and every gradient of the unfused model."""
    ref = make(model_type)
    ref.config._attn_implementation = "eager"
    fused = copy.deepcopy(ref)
    ids, mask, labels = batch()
    if hooked_before:
        with torch.no_grad():
            fused(input_ids=ids, attention_mask=mask, output_attentions=True)
    torchfuser.optimize(fused, backend="reference")
    outs = []
    for m in (ref, fused):
        m.train()
        m.zero_grad(set_to_none=True)
        out = m(input_ids=ids, attention_mask=mask, labels=labels, output_attentions=True)
        out.loss.backward()
        outs.append(out)
    _same_maps(outs[1].attentions, outs[0].attentions)
    torch.testing.assert_close(outs[1].loss, outs[0].loss, rtol=1e-5, atol=1e-6)
    for (name, p), q in zip(ref.named_parameters(), fused.parameters()):
        torch.testing.assert_close(q.grad, p.grad, rtol=1e-4, atol=1e-5, msg=name)
    assert set(fallbacks.counts(fused)) == set(_fused_attention(fused))


@pytest.mark.parametrize("model_type", ["gpt2", "llama"])
def test_output_attentions_in_the_config(model_type):
    """``config.output_attentions = True`` set after fusion: the maps come back, counted; set before,
    the attention is left unfused at match time (the report says why) and the maps come back."""
    ref, fused = _pair(model_type)
    ids, mask, _ = batch()
    ref.config.output_attentions = fused.config.output_attentions = True
    with torch.no_grad():
        want = ref(input_ids=ids, attention_mask=mask)
        _same_maps(fused(input_ids=ids, attention_mask=mask).attentions, want.attentions)
    assert fallbacks.counts(fused) == {n: {WHY: 1} for n in _fused_attention(fused)}
    before = torchfuser.optimize(copy.deepcopy(ref), backend="reference")
    assert not _fused_attention(before)
    entries = [e for e in torchfuser.report(before).entries if e.pattern == "attention"]
    assert entries and all("output_attentions" in e.reason for e in entries)
    with torch.no_grad():
        _same_maps(before(input_ids=ids, attention_mask=mask).attentions, want.attentions)


@pytest.mark.parametrize("model_type", ["gpt2", "llama"])
def test_output_hidden_states_keeps_the_fused_attention(model_type):
    """Hidden states are recorded on the decoder layers: they come back equal (count and values, the
    embeddings' included), and no call leaves the fused path. Asked for with the attentions, both come back."""
    ref, fused = _pair(model_type)
    ids, mask, _ = batch()
    with torch.no_grad():
        want = ref(input_ids=ids, attention_mask=mask, output_hidden_states=True)
        got = fused(input_ids=ids, attention_mask=mask, output_hidden_states=True)
    assert len(got.hidden_states) == len(want.hidden_states) == 3
    for x, y in zip(got.hidden_states, want.hidden_states):
        torch.testing.assert_close(x, y, rtol=1e-5, atol=1e-5)
    assert got.attentions is None and not fallbacks.counts(fused)
    with torch.no_grad():
        want = ref(input_ids=ids, attention_mask=mask, output_hidden_states=True, output_attentions=True)
        got = fused(input_ids=ids, attention_mask=mask, output_hidden_states=True, output_attentions=True)
    _same_maps(got.attentions, want.attentions)
    assert len(got.hidden_states) == len(want.hidden_states) == 3


@pytest.mark.parametrize("model_type", ["gpt2", "llama"])
def test_output_attentions_under_sdpa_as_unfused(model_type):
    """With sdpa the original returns what transformers' sdpa path returns; the fused model the same."""
    ref, fused = _pair(model_type, impl="sdpa")
    ids, mask, _ = batch()
    with torch.no_grad():
        want = ref(input_ids=ids, attention_mask=mask, output_attentions=True)
        got = fused(input_ids=ids, attention_mask=mask, output_attentions=True)
    assert len(got.attentions) == len(want.attentions)
    for x, y in zip(got.attentions, want.attentions):
        torch.testing.assert_close(x, y, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(got.logits, want.logits, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("model_type", ["gpt2", "llama"])
def test_output_attentions_under_torch_compile_fullgraph(model_type):
    """Under torch.compile transformers keeps its collector outside the ContextVar, where the fused
    attention reads it (no graph break): the maps come back, and a plain call has none."""
    from torch._dynamo.utils import counters

    ref, fused = _pair(model_type)
    ids, mask, _ = batch()
    with torch.no_grad():
        # transformers installs its hooks on the first request, under a lock: eagerly
        fused(input_ids=ids, attention_mask=mask, output_attentions=True)
        counters.clear()
        compiled = torch.compile(fused, fullgraph=True, backend="eager")
        want = ref(input_ids=ids, attention_mask=mask, output_attentions=True)
        _same_maps(compiled(input_ids=ids, attention_mask=mask, output_attentions=True).attentions, want.attentions)
        plain = compiled(input_ids=ids, attention_mask=mask)
    assert plain.attentions is None and not counters["graph_break"]
    torch.testing.assert_close(plain.logits, want.logits, rtol=1e-5, atol=1e-5)
