"""The gated MLP's h = act(gate)·up is made again in the backward, not kept (modules/recompute.py):
the same loss and gradients, bit for bit, as keeping it; h's bytes no longer saved; and it stands
aside under hooks that decide what is kept (non-reentrant checkpointing, offloading)."""
from __future__ import annotations

import contextlib
import copy

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM

import torchfuser
from torchfuser.modules import recompute
from numerics import needs_mlir

H, I, T = 64, 160, 24


def _model(dtype=torch.float32, lora=False):
    torch.manual_seed(0)
    cfg = LlamaConfig(hidden_size=H, intermediate_size=I, num_hidden_layers=2, num_attention_heads=4,
                      num_key_value_heads=2, vocab_size=128)
    model = LlamaForCausalLM(cfg).to(dtype)
    if lora:
        peft = pytest.importorskip("peft")
        model = peft.get_peft_model(model, peft.LoraConfig(r=4, lora_alpha=8, lora_dropout=0.0, target_modules=[
            "q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]))
        for n, p in model.named_parameters():  # B = 0 would hide a wrong A gradient
            if "lora_B" in n:
                torch.nn.init.normal_(p, std=0.1)
    return model


def _step(model, hooks):
    ids = torch.randint(0, 128, (2, T), generator=torch.Generator().manual_seed(1))
    saved = []

    def pack(t):
        saved.append(t.untyped_storage().nbytes())
        return t

    setattr(pack, recompute.COUNTING, hooks == "counting")
    ctx = torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t)
    with ctx:
        loss = model(input_ids=ids, labels=ids).loss
    loss.backward()
    grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    model.zero_grad(set_to_none=True)
    return loss.detach(), grads, sum(saved)


CASES = [("reference", torch.float32, False), ("reference", torch.bfloat16, True), ("reference", torch.float32, True),
         pytest.param("mlir", torch.float32, True, marks=needs_mlir), pytest.param("mlir", torch.float32, False, marks=needs_mlir)]


@pytest.mark.parametrize("backend,dtype,lora", CASES)
def test_h_made_again_gives_the_kept_h_gradients_bit_for_bit_and_saves_its_bytes(backend, dtype, lora, monkeypatch):
    from torchfuser.modules import residual_norm

    monkeypatch.setattr(residual_norm, "_made_again", lambda *args: contextlib.nullcontext())  # h alone here
    model = _model(dtype, lora)
    torchfuser.optimize(model, backend=backend)
    assert torchfuser.report(model).fused
    loss_a, grads_a, bytes_a = _step(model, "counting")  # counting hooks: h is made again
    loss_b, grads_b, bytes_b = _step(model, "other")  # any other hook: h is kept
    assert torch.equal(loss_a, loss_b)
    assert grads_a.keys() == grads_b.keys() and grads_a
    for n in grads_a:
        assert torch.equal(grads_a[n], grads_b[n]), n
    h_bytes = 2 * T * I * torch.finfo(dtype).bits // 8
    assert bytes_b - bytes_a == 2 * h_bytes  # one h a layer, two layers


@pytest.mark.parametrize("backend,dtype,lora", CASES)
def test_norm_outputs_made_again_give_the_same_gradients_bit_for_bit(backend, dtype, lora, monkeypatch):
    """The decoder layer's two RMSNorm outputs are made again from what the norms keep (the layer's input, the
    sum after the attention) for the projections after them: bit for bit the gradients of keeping them, and
    the bytes saved less are those of the tensors made again (each layer: its two norm outputs and h)."""
    model = _model(dtype, lora)
    torchfuser.optimize(model, backend=backend)
    remade = []
    real = recompute._Recipe.__init__

    def init(self, make, t):
        remade.append((t.shape[-1], t.untyped_storage().nbytes()))
        real(self, make, t)

    monkeypatch.setattr(recompute._Recipe, "__init__", init)
    loss_a, grads_a, bytes_a = _step(model, "counting")  # recipes under counting hooks
    loss_b, grads_b, bytes_b = _step(model, "other")  # any other hook: everything kept
    assert torch.equal(loss_a, loss_b) and grads_a.keys() == grads_b.keys()
    for n in grads_a:
        assert torch.equal(grads_a[n], grads_b[n]), n
    assert bytes_b - bytes_a == sum(b for _, b in remade)
    widths = sorted(w for w, _ in remade)
    assert widths.count(I) == 2 and widths.count(H) >= 4, widths  # h, and both norms' outputs, in each layer


def test_the_unfused_model_trains_the_same():
    ref, fused = _model(lora=True), _model(lora=True)
    torchfuser.optimize(fused, backend="reference")
    loss_r, grads_r, _ = _step(ref, "counting")
    loss_f, grads_f, _ = _step(fused, "counting")
    torch.testing.assert_close(loss_f, loss_r, rtol=1e-6, atol=1e-6)
    for n in grads_r:
        torch.testing.assert_close(grads_f[n], grads_r[n], rtol=1e-4, atol=1e-6, msg=n)


def test_stands_aside_under_non_reentrant_checkpointing():
    """Checkpointing frees [gate | up]: a recipe holding it would keep what it frees."""
    model = _model(lora=True)
    torchfuser.optimize(model, backend="reference")
    made = []
    real = recompute._Recipe.__call__
    recompute._Recipe.__call__ = lambda self: made.append(1) or real(self)
    try:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        model.train()
        _step(model, "none")
    finally:
        recompute._Recipe.__call__ = real
    assert made == []


def test_made_again_only_where_a_gradient_is_recorded():
    model = _model()
    torchfuser.optimize(model, backend="reference")
    ids = torch.randint(0, 128, (1, T))
    with torch.no_grad():
        model(input_ids=ids)  # nothing saved, no hook pushed: it must simply run
    assert torch._C._autograd._top_saved_tensors_default_hooks(True) is None


@pytest.mark.parametrize("lora", [False, True], ids=["full", "lora"])
def test_the_attention_is_handed_a_v_of_its_own(lora, monkeypatch):
    """The attention kernel saves v for its backward: v, a view of the joint q/k/v projection's output, kept all of
    [q | k | v] alive until the backward (q and k are made anew by rope), 1.25 hidden-sized tensors a token a layer
    more than v at Llama-3-8B's shapes. v is now a copy of its own wherever grad mode is on. Under CPU autocast (the
    joint projection) and with LoRA (its fused node)."""
    from torchfuser.modules import attention

    model = _model(torch.bfloat16 if lora else torch.float32, lora)
    torchfuser.optimize(model, backend="reference")
    kept, real = [], attention.sdpa_attention_forward

    def recording(module, q, k, v, *args, **kwargs):
        kept.append(v.untyped_storage().nbytes() / (v.numel() * v.element_size()))
        return real(module, q, k, v, *args, **kwargs)

    monkeypatch.setattr(attention, "sdpa_attention_forward", recording)
    ids = torch.randint(0, 128, (2, T), generator=torch.Generator().manual_seed(1))
    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=not lora):
        model(input_ids=ids, labels=ids, use_cache=False).loss.backward()  # (a cache would hand back copies)
        assert kept == [1.0, 1.0], kept
        with torch.no_grad():  # generate and evaluation: no copy (nothing is saved)
            model(input_ids=ids, use_cache=False)
    assert kept[2:] == [4.0, 4.0], kept  # q 64 + k 32 + v 32 columns, of which v holds 32
