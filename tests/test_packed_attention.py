"""Packed rows (position_ids restarting at each sample) in the fused attention: variable-length
attention runs exactly when transformers' mask is the samples' block-causal mask, and gives the loss
and every gradient the unfused model gives (which runs SDPA over the dense block mask).

On the CPU PyTorch's varlen kernel does not run, so ``packed.kernel_for`` is replaced by a per-sample
SDPA with the kernel's signature; on a CUDA machine the last test runs the real kernel."""
from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F
from transformers import LlamaConfig, LlamaForCausalLM

import torchfuser
from numerics import ATOL, assert_within_rule
from torchfuser.modules import packed

CFG = dict(vocab_size=100, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
           num_key_value_heads=2, max_position_embeddings=256)


def _positions(*lengths_per_row):
    return torch.stack([torch.cat([torch.arange(n) for n in row]) for row in lengths_per_row])


def _block_causal(pos):
    sample = (pos == 0).reshape(-1).cumsum(0).view(pos.shape)
    s = pos.shape[1]
    return (torch.ones(s, s, dtype=torch.bool).tril() & (sample[:, :, None] == sample[:, None, :]))[:, None]


class _PerSample:
    """PyTorch's varlen_attn signature, computed sample by sample with SDPA (causal, grouped k/v)."""

    def __init__(self):
        self.calls = 0

    def __call__(self, q, k, v, cu_q, cu_k, max_q, max_k, *, scale=None, window_size=(-1, -1)):
        assert window_size == (-1, 0) and torch.equal(cu_q, cu_k) and cu_q.dtype == torch.int32
        assert max_q == max_k == int(torch.diff(cu_q).max())
        self.calls += 1
        outs = []
        for a, b in zip(cu_q[:-1].tolist(), cu_q[1:].tolist()):
            qs, ks, vs = (t[a:b].transpose(0, 1)[None] for t in (q, k, v))
            outs.append(F.scaled_dot_product_attention(qs, ks, vs, is_causal=True, scale=scale, enable_gqa=True)[0]
                        .transpose(0, 1))
        return torch.cat(outs)


def test_segments_of_a_block_causal_mask():
    pos = _positions([3, 5], [2, 4, 2])
    mask = _block_causal(pos)
    cu, longest = packed.segments(mask, pos)
    assert cu.tolist() == [0, 3, 8, 10, 14, 16] and longest == 5
    additive = torch.zeros(mask.shape).masked_fill(~mask, torch.finfo(torch.float32).min)  # eager's form
    assert packed.segments(additive, pos)[0].tolist() == cu.tolist()
    assert packed.segments(mask, pos) is packed.segments(mask, pos)  # once per mask object


@pytest.mark.parametrize("case", ["one sample a row", "padding", "sliding window", "positions skip", "no mask"])
def test_other_masks_keep_sdpa(case):
    pos = _positions([3, 5], [2, 4, 2])
    mask = _block_causal(pos)
    if case == "one sample a row":
        pos = _positions([8], [8])
        mask = _block_causal(pos)
    elif case == "padding":
        mask = mask.clone()
        mask[1, :, :, -2:] = False
    elif case == "sliding window":
        idx = torch.arange(8)
        mask = mask & ((idx[:, None] - idx[None, :]) < 2)
    elif case == "positions skip":
        pos = pos.clone()
        pos[0, 4] += 1
    elif case == "no mask":
        mask = None
    assert packed.segments(mask, pos) is None


def _loss_and_grads(model, batch):
    model.zero_grad(set_to_none=True)
    loss = model(**batch, use_cache=False).loss
    loss.backward()
    return loss.detach(), {n: p.grad for n, p in model.named_parameters()}


@pytest.mark.parametrize("attn", ["sdpa", "eager"])
def test_packed_row_runs_varlen_and_equals_the_unfused_model(monkeypatch, attn):
    kernel = _PerSample()
    monkeypatch.setattr(packed, "kernel_for", lambda q: kernel)
    cfg = LlamaConfig(**CFG, attn_implementation=attn)
    torch.manual_seed(0)
    ref = LlamaForCausalLM(cfg).train()
    fused = torchfuser.optimize(LlamaForCausalLM(cfg).train(), backend="reference")
    fused.load_state_dict(ref.state_dict())
    pos = _positions([7, 12, 5], [20, 4])
    ids = torch.randint(0, 100, pos.shape)
    labels = ids.masked_fill(pos == 0, -100)
    batch = dict(input_ids=ids, position_ids=pos, labels=labels)
    want, want_g = _loss_and_grads(ref, batch)
    got, got_g = _loss_and_grads(fused, batch)
    assert kernel.calls == cfg.num_hidden_layers
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)
    for name, g in want_g.items():
        torch.testing.assert_close(got_g[name], g, rtol=1e-4, atol=1e-6, msg=lambda m: f"{name}: {m}")
    fused(input_ids=ids, use_cache=False)  # no position_ids given: one causal sample a row, SDPA
    assert kernel.calls == cfg.num_hidden_layers
    note = next(n for n in torchfuser.report(fused).notes if n.startswith("packed rows: "))
    assert note.startswith(f"packed rows: {cfg.num_hidden_layers} attention calls in {cfg.num_hidden_layers} modules")


@pytest.mark.skipif(not torch.cuda.is_available(), reason="PyTorch's varlen attention runs on CUDA")
def test_packed_row_on_cuda_uses_pytorchs_varlen_kernel(monkeypatch):
    if packed.kernel_for(torch.empty(1, 1, 1, 64, device="cuda", dtype=torch.bfloat16)) is None:
        pytest.skip("this PyTorch has no torch.nn.attention.varlen")
    calls = []
    real = packed.attention
    monkeypatch.setattr(packed, "attention", lambda *a: calls.append(1) or real(*a))
    cfg = LlamaConfig(**CFG, attn_implementation="sdpa")
    torch.manual_seed(0)
    ref = LlamaForCausalLM(cfg).cuda().train()
    fused = torchfuser.optimize(LlamaForCausalLM(cfg).cuda().train())
    fused.load_state_dict(ref.state_dict())
    pos = _positions([70, 120, 50], [200, 40]).cuda()
    ids = torch.randint(0, 100, pos.shape, device="cuda")
    batch = dict(input_ids=ids, position_ids=pos, labels=ids.masked_fill(pos == 0, -100))
    with torch.autocast("cuda", dtype=torch.bfloat16):
        same, same_g = _loss_and_grads(ref, batch)
        got, got_g = _loss_and_grads(fused, batch)
    ref64 = copy.deepcopy(ref).double()
    want, want_g = _loss_and_grads(ref64, batch)
    assert len(calls) == cfg.num_hidden_layers
    assert_within_rule(got, same, want, ATOL[torch.bfloat16], "loss")
    for name, g in want_g.items():
        assert_within_rule(got_g[name], same_g[name], g, ATOL[torch.bfloat16] * g.abs().max().item(), name)
