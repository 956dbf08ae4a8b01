"""A causal LM whose forward writes into its logits by vocabulary position before the loss (Chameleon sets its image
tokens' logits to the lowest value): the LM head + loss is left alone, with the reason. Its forward does not run on
the narrow probe logits the fused forward hands it too (the columns it writes are past their width), but does at the
vocabulary's width; before, the fallback for forwards that do not run on a stand-in decoder fused it, and the fused
training step raised an IndexError."""
from __future__ import annotations

import copy

import torch
from transformers import LlamaConfig, LlamaForCausalLM
from transformers.modeling_outputs import CausalLMOutputWithPast

import torchfuser

from tiny_lm import loss_and_grads

MASKED = [60, 61, 62, 63]  # vocabulary ids never predicted (an image tokenizer's codes, say)


class MaskedColumnsForCausalLM(LlamaForCausalLM):
    def forward(self, input_ids=None, labels=None, attention_mask=None, use_cache=None, **kwargs):
        hidden = self.model(input_ids=input_ids, attention_mask=attention_mask, use_cache=use_cache).last_hidden_state
        logits = self.lm_head(hidden)
        logits[:, :, MASKED] = torch.finfo(logits.dtype).min
        loss = None if labels is None else self.loss_function(logits=logits, labels=labels,
                                                              vocab_size=self.config.vocab_size)
        return CausalLMOutputWithPast(loss=loss, logits=logits)


def _model():
    cfg = LlamaConfig(vocab_size=128, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                      num_attention_heads=4, num_key_value_heads=2)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        return MaskedColumnsForCausalLM(cfg).float().train()



def test_logits_written_by_vocabulary_position_leave_the_head_alone_with_the_reason():
    ref = _model()
    fused = copy.deepcopy(ref)
    torchfuser.optimize(fused, backend="reference")
    rep = torchfuser.report(fused)
    assert not [e for e in rep.fused if e.pattern == "lm_head_loss"]
    reasons = [e.reason for e in rep.skipped if e.pattern == "lm_head_loss"]
    assert reasons and "vocabulary position" in reasons[0], reasons
    assert "forward" not in fused.__dict__
    ids = torch.randint(0, 60, (2, 7), generator=torch.Generator().manual_seed(1))
    loss_ref, grads_ref = loss_and_grads(ref, ids)
    loss, grads = loss_and_grads(fused, ids)  # the model's own head and loss run (other blocks fused)
    torch.testing.assert_close(loss, loss_ref, rtol=1e-5, atol=1e-6)
    for name, g in grads_ref.items():
        torch.testing.assert_close(grads[name], g, rtol=1e-4, atol=1e-6, msg=name)
