"""Logits in training with the fused LM head + loss: ``keep_logits=True`` returns the original's logits with
the fused loss; without it every dict / tuple read the Trainer, TRL and PEFT make works as on any
ModelOutput with a None field, and ``outputs.logits`` itself raises on use, saying what to pass."""
from __future__ import annotations

import copy

import pytest
import torch
from transformers.modeling_outputs import CausalLMOutputWithPast

import torchfuser
from torchfuser import settings
from torchfuser.modules.lm_head import NOT_KEPT, LogitsNotKeptError

from test_architectures import batch, make


def pair(model_type="llama", tied=False, **optimize_kwargs):
    ref = make(model_type, tie_word_embeddings=tied)
    fused = copy.deepcopy(ref)
    torchfuser.optimize(fused, backend="reference", patterns=["lm_head_loss"], **optimize_kwargs)
    return ref.train(), fused.train()


def test_an_output_without_logits_reads_as_any_model_output_with_a_none_field():
    _, fused = pair()
    ids, mask, labels = batch()
    out = fused(input_ids=ids, attention_mask=mask, labels=labels)
    assert isinstance(out, CausalLMOutputWithPast) and out.logits is NOT_KEPT
    assert out[0] is out.loss and out["loss"] is out.loss and out.to_tuple()[0] is out.loss  # Trainer, TRL, PEFT
    assert "logits" not in out and "logits" not in out.keys() and out.get("logits") is None
    assert not any(v is NOT_KEPT for v in out.to_tuple())
    assert not hasattr(out.logits, "shape") and "keep_logits=True" in repr(out.logits)
    out.loss.backward()  # the loss is the fused one, with its gradient


@pytest.mark.parametrize("use", [
    lambda t: t.argmax(-1), lambda t: t[:, -1], lambda t: t / 2.0, lambda t: torch.softmax(t, -1),
    lambda t: t.shape, lambda t: len(t), lambda t: t.float(),
], ids=["method", "index", "arithmetic", "torch-function", "shape", "len", "cast"])
def test_using_logits_that_were_not_kept_says_why_and_what_to_pass(use):
    _, fused = pair()
    ids, mask, labels = batch()
    out = fused(input_ids=ids, attention_mask=mask, labels=labels)
    with pytest.raises(LogitsNotKeptError, match=r"never formed.*keep_logits=True"):
        use(out.logits)


@pytest.mark.parametrize("model_type,tied", [("llama", False), ("llama", True), ("gemma2", True)])
def test_keep_logits_returns_the_originals_logits_and_the_fused_loss(model_type, tied):
    ref, fused = pair(model_type, tied, keep_logits=True)
    assert (fused.lm_head.weight is fused.get_input_embeddings().weight) == tied
    ids, mask, labels = batch()
    a = ref(input_ids=ids, attention_mask=mask, labels=labels)
    b = fused(input_ids=ids, attention_mask=mask, labels=labels)
    assert "logits" in b and torch.equal(b.logits, a.logits)  # the forward's own head, scale and softcap
    torch.testing.assert_close(b.loss, a.loss, rtol=1e-5, atol=1e-6)
    # The logits carry their gradient, as the original's do: a term of the loss on them reaches the weights.
    (a.loss + a.logits.square().mean()).backward()
    (b.loss + b.logits.square().mean()).backward()
    for (n, p), q in zip(ref.named_parameters(), fused.parameters()):
        torch.testing.assert_close(q.grad, p.grad, rtol=1e-4, atol=1e-6, msg=n)
    assert fused.forward.calls.n == 1  # the fused path ran


def test_keep_logits_under_autocast_gives_the_originals_dtype_and_a_tuple_keeps_them():
    ref, fused = pair(keep_logits=True)
    ids, mask, labels = batch()
    with torch.autocast("cpu", dtype=torch.bfloat16):
        a = ref(input_ids=ids, attention_mask=mask, labels=labels)
        b = fused(input_ids=ids, attention_mask=mask, labels=labels)
        t = fused(input_ids=ids, attention_mask=mask, labels=labels, return_dict=False)
    assert b.logits.dtype == a.logits.dtype == torch.bfloat16 and torch.equal(b.logits, a.logits)
    assert torch.equal(t[1], b.logits) and t[0].ndim == 0
    torchfuser.optimize(fused, keep_logits=False)
    short = fused(input_ids=ids, attention_mask=mask, labels=labels, return_dict=False)
    assert short[0].ndim == 0 and len(short) == len(t) - 1  # (loss, cache): the logits left out


def test_keep_logits_is_kept_across_calls_dropped_when_passed_false_and_checked():
    _, fused = pair(keep_logits=True)
    ids, mask, labels = batch()
    torchfuser.optimize(fused)  # TorchFuserCallback() does this: the setting stays
    assert settings.of(fused).keep_logits and torch.is_tensor(fused(input_ids=ids, attention_mask=mask, labels=labels).logits)
    torchfuser.optimize(fused, keep_logits=False)
    assert fused(input_ids=ids, attention_mask=mask, labels=labels).logits is NOT_KEPT
    with pytest.raises(TypeError, match="keep_logits must be True or False"):
        torchfuser.optimize(fused, keep_logits="yes")
    torchfuser.restore(fused)
    torchfuser.optimize(fused, backend="reference")  # restore forgets it
    assert not settings.of(fused).keep_logits


def test_eval_and_calls_without_labels_return_logits_as_before():
    ref, fused = pair()
    ids, mask, labels = batch()
    assert torch.equal(fused(input_ids=ids, attention_mask=mask).logits, ref(input_ids=ids, attention_mask=mask).logits)
    ref.eval(), fused.eval()
    assert torch.equal(fused(input_ids=ids, attention_mask=mask, labels=labels).logits,
                       ref(input_ids=ids, attention_mask=mask, labels=labels).logits)


@pytest.mark.parametrize("keep", [False, True])
def test_under_torch_compile_in_one_graph(keep):
    from torch._dynamo.utils import counters

    ref, fused = pair(keep_logits=keep)
    ids, _, labels = batch()
    torch._dynamo.reset()
    counters.clear()
    b = torch.compile(fused, fullgraph=True, backend="eager")(input_ids=ids, labels=labels)
    a = ref(input_ids=ids, labels=labels)
    assert not counters["graph_break"]
    torch.testing.assert_close(b.loss, a.loss, rtol=1e-5, atol=1e-6)
    assert torch.equal(b.logits, a.logits) if keep else b.logits is None
