"""benchmarks/workloads.py: the varying, packed and padded batches the training-step benchmark feeds
models are what its doc says, and a fused model trained on a packed row computes the loss and every
gradient the unfused model computes on the same samples as a padded batch."""
from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM

import torchfuser

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
import workloads  # noqa: E402


def test_varying_lengths_and_padding():
    got = workloads.batches("varying", 6, 100, 3, 64, 0, "cpu")
    assert len({b["input_ids"].shape[1] for b in got}) > 1  # the length changes
    for b in got:
        length, mask = b["input_ids"].shape[1], b["attention_mask"]
        assert 32 <= length <= 64
        real = mask.sum(1)
        assert (real >= length - length // 4).all() and b["tokens"] == int(real.sum())
        assert torch.equal(mask.cumprod(1), mask)  # right padding
        assert ((b["labels"] == -100) == (mask == 0)).all()
    assert [b["input_ids"].shape for b in got] == [b["input_ids"].shape for b in workloads.batches("varying", 6, 100, 3, 64, 0, "cpu")]


def test_packed_rows_and_the_same_samples_padded(monkeypatch):
    monkeypatch.setattr(workloads, "PACK", 512)
    packed = workloads.batches("packed", 2, 100, 2, 128, 0, "cpu")
    padded = workloads.batches("padded-samples", 2, 100, 2, 128, 0, "cpu")
    for b in packed:
        ids, pos, labels = b["input_ids"], b["position_ids"], b["labels"]
        assert ids.shape == (2, 512) and "attention_mask" not in b
        assert (pos[:, 0] == 0).all() and ((pos[:, 1:] == 0) | (pos[:, 1:] == pos[:, :-1] + 1)).all()
        assert ((labels == -100) == (pos == 0)).all()
        for p in pos:
            lengths = torch.diff(torch.cat([(p == 0).nonzero().flatten(), torch.tensor([512])]))
            assert lengths.max() <= 128 and lengths.min() >= 1
    # The padded batches hold exactly the packed samples, in order, within the packed rows' tokens.
    flat = torch.cat([b["input_ids"].flatten() for b in packed])
    real = torch.cat([row[m.bool()] for b in padded for row, m in zip(b["input_ids"], b["attention_mask"])])
    assert torch.equal(real, flat)
    assert all(b["input_ids"].numel() <= 2 * 512 for b in padded)
    assert sum(b["tokens"] for b in padded) == sum(b["tokens"] for b in packed) == 2 * 2 * 512


def _sum_loss(model, batch):
    """The summed loss over the batch's predicted tokens (means are over different counts otherwise)."""
    inputs = {k: v for k, v in batch.items() if k != "tokens"}
    logits = model(**{k: v for k, v in inputs.items() if k != "labels"}, use_cache=False).logits  # a cache hides packing
    labels = inputs["labels"][:, 1:]
    return torch.nn.functional.cross_entropy(logits[:, :-1].flatten(0, 1), labels.flatten(), ignore_index=-100,
                                             reduction="sum")


@pytest.mark.parametrize("attn", ["sdpa", "eager"])
def test_a_fused_model_on_a_packed_row_equals_the_samples_padded(monkeypatch, attn):
    monkeypatch.setattr(workloads, "PACK", 96)
    cfg = LlamaConfig(vocab_size=100, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                      num_key_value_heads=2, max_position_embeddings=256, attn_implementation=attn)
    torch.manual_seed(0)
    ref = LlamaForCausalLM(cfg).train()
    fused = torchfuser.optimize(LlamaForCausalLM(cfg).train(), backend="reference")
    fused.load_state_dict(ref.state_dict())
    packed = workloads.batches("packed", 1, 100, 1, 48, 0, "cpu")[0]
    padded = workloads.batches("padded-samples", 1, 100, 1, 48, 0, "cpu")
    assert (packed["position_ids"] == 0).sum() > 1  # several samples in the row
    want = sum(_sum_loss(ref, b) for b in padded)
    got = _sum_loss(fused, packed)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-4)
    gw = torch.autograd.grad(want, list(ref.parameters()))
    gg = torch.autograd.grad(got, list(fused.parameters()))
    for (name, _), a, b in zip(ref.named_parameters(), gg, gw):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-5, msg=lambda m: f"{name}: {m}")
    assert torchfuser.report(fused).counts()["attention"]["fused"] == 2
