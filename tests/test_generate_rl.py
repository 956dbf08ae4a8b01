"""Rollouts as TRL's GRPO / RLOO / distillation trainers make them with transformers' own ``generate``: the
model in training mode (the Trainer's), under ``torch.no_grad()``, TRL's ``fused_lm_head`` wrapper on the
model's forward (put on after TorchFuserCallback fused it), a batch of prompts padded on the left, the KV
cache on. Greedy decoding of the fused model gives exactly the unfused model's tokens, the prefill on the fused
path and the decode steps by the original modules (``modules.decode``, counted apart), no call handed back to an
original module for want of a fused way."""
from __future__ import annotations

import copy

import pytest
import torch

import torchfuser
from torchfuser.modules import fallbacks
from test_trl import _model

trl = pytest.importorskip("trl")


def _prompts(pad_id: int = 0):
    """Four prompts of lengths 7, 3, 5 and 1, left-padded to 7."""
    gen = torch.Generator().manual_seed(3)
    lengths = (7, 3, 5, 1)
    ids = torch.full((len(lengths), max(lengths)), pad_id)
    mask = torch.zeros_like(ids)
    for row, n in enumerate(lengths):
        ids[row, -n:] = torch.randint(4, 128, (n,), generator=gen)
        mask[row, -n:] = 1
    return ids, mask


def _greedy(model, ids, mask, new_tokens=12):
    with torch.no_grad():
        return model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=new_tokens, do_sample=False,
                              pad_token_id=0, use_cache=True)


@pytest.mark.parametrize("lora", [False, True], ids=["full", "lora"])
@pytest.mark.parametrize("mode", ["train", "eval"])
def test_greedy_rollouts_equal_unfused(lora, mode):
    from trl.trainer.utils import add_fused_lm_head

    ref = _model()
    if lora:
        peft = pytest.importorskip("peft")
        torch.manual_seed(1)
        config = peft.LoraConfig(r=4, lora_alpha=8, target_modules="all-linear", lora_dropout=0.0,
                                 init_lora_weights=False)
        ref = peft.get_peft_model(ref, config)
    fused = copy.deepcopy(ref)
    torchfuser.optimize(fused, backend="reference")
    for m in (ref, fused):  # what TRL's trainers do after the callback fused the model
        add_fused_lm_head(m.get_base_model() if lora else m, outputs=("log_probs", "entropy"))
        m.train(mode == "train")
    ids, mask = _prompts()
    want = _greedy(ref, ids, mask)
    got = _greedy(fused, ids, mask)
    assert want.shape == (4, 7 + 12)
    assert torch.equal(got, want), (got, want)
    target = fused.get_base_model() if lora else fused
    assert not fallbacks.counts(target)
    rep = torchfuser.report(fused)
    assert rep.counts()["attention"]["fused"] == 2 and not rep.fallbacks, rep
    calls = {name.removeprefix("base_model.model."): n for name, n in rep.decode_calls.items()}  # (PEFT's wrapper)
    assert calls == {"model.layers.0": 11, "model.layers.1": 11, "model.norm": 11}  # 12 new tokens, the first prefilled


@pytest.mark.skipif(torch.cuda.is_available() and tuple(int(x) for x in trl.__version__.split(".")[:2]) < (1, 16),
                    reason="TRL < 1.16 runs its chunked log-prob Triton kernel on CPU tensors where CUDA is present")
def test_rollout_scores_match_after_generation():
    """TRL scores the rollout it generated with ``fused_lm_head=True``: the per-token log-probs of the fused
    model equal the unfused model's (the generation's KV cache left nothing behind in the fused modules)."""
    from trl.trainer.utils import add_fused_lm_head

    ref = _model()
    fused = torchfuser.optimize(copy.deepcopy(ref), backend="reference")
    for m in (ref, fused):
        add_fused_lm_head(m, outputs=("log_probs", "entropy"))
    ids, mask = _prompts()
    seqs = _greedy(ref, ids, mask, new_tokens=6)
    full_mask = torch.cat([mask, torch.ones(4, 6, dtype=mask.dtype)], 1)
    _greedy(fused, ids, mask, new_tokens=6)
    labels = seqs.masked_fill(full_mask == 0, -100)
    outs = [m(input_ids=seqs, attention_mask=full_mask, labels=labels, fused_lm_head=True) for m in (ref, fused)]
    torch.testing.assert_close(outs[1].log_probs, outs[0].log_probs, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(outs[1].entropy, outs[0].entropy, rtol=1e-5, atol=1e-5)
    outs[1].loss.backward()
    outs[0].loss.backward()
    grads = {n: p.grad for n, p in ref.named_parameters()}
    for n, p in fused.named_parameters():
        torch.testing.assert_close(p.grad, grads[n], rtol=1e-4, atol=1e-6, msg=n)
