"""On CUDA the fused LoRA node's hi/lo splits (bf16 base, fp32 adapters) run as one Triton launch each
(backends/triton/hilo_split.py): a training step gives the loss and every gradient bit for bit as with the
torch spelling of the splits (backends/reference/hilo_split.py), and the kernel is really what ran.
Skipped without CUDA (the kernel itself is checked under TRITON_INTERPRET=1: tests/backends/test_hilo_split.py)."""
from __future__ import annotations

import copy

import pytest
import torch

import torchfuser
import torchfuser.backends as backends
from torchfuser.modules.adapters import lora

peft = pytest.importorskip("peft")
pytest.importorskip("triton")
pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")


def _step(model, ids):
    model.zero_grad(set_to_none=True)
    loss = model(input_ids=ids, labels=ids).loss
    loss.backward()
    return loss.detach(), {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


def test_triton_splits_equal_torch_splits_bit_for_bit(monkeypatch):
    from test_lora_fused import _base, ALL

    torch.manual_seed(0)
    ref = peft.get_peft_model(_base("llama", torch.bfloat16), peft.LoraConfig(
        r=8, lora_alpha=16, target_modules=ALL, lora_dropout=0.0, init_lora_weights=False)).cuda()
    for n, p in ref.named_parameters():  # PEFT's default: fp32 adapters on the bf16 base
        if "lora_" in n:
            p.data = p.data.float()
    fused = torchfuser.optimize(copy.deepcopy(ref), backend="triton")
    ids = torch.randint(0, 128, (2, 33), device="cuda", generator=torch.Generator("cuda").manual_seed(1))
    calls = []
    kernel = backends.kernel("triton", "hilo_split")
    monkeypatch.setitem(backends._KERNELS, ("triton", "hilo_split"), lambda *a: calls.append(a[1]) or kernel(*a))
    got = _step(fused, ids)
    assert len(calls) >= 3 * 8, calls  # every node: A, h and B splits in the forward, dh in the backward
    monkeypatch.setattr(lora, "_SPLIT_BACKENDS", {k: "reference" for k in ((None, "cuda"), ("triton", "cuda"))})
    calls.clear()
    want = _step(fused, ids)
    assert not calls
    again = _step(fused, ids)  # the step itself is deterministic, or the comparison below would mean nothing
    assert torch.equal(want[0], again[0]) and all(torch.equal(want[1][n], again[1][n]) for n in want[1])
    assert torch.equal(got[0], want[0])
    assert got[1].keys() == want[1].keys() and any("lora_A" in n for n in got[1])
    for n in want[1]:
        assert torch.equal(got[1][n], want[1][n]), n
