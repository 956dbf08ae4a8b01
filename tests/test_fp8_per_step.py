"""``optimize(model, fp8=..., fp8_weights="per_step")``: trainable weights quantised once per optimizer
step (not per micro-batch), the same training as per call bit for bit (fused AdamW, which leaves the
version counters alone, included), and a scoped optimizer hook."""
from __future__ import annotations

import copy
import gc

import pytest
import torch
from torch.optim import optimizer as _optim
from transformers import LlamaConfig, LlamaForCausalLM

import torchfuser
from torchfuser.modules import fp8
from torchfuser.modules.fp8 import step as fp8_step

CFG = dict(vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
           num_key_value_heads=2)
WEIGHTS_PER_PASS = 4 * CFG["num_hidden_layers"]  # q/k/v, o, gate/up, down in each layer


def _model():
    torch.manual_seed(0)
    return LlamaForCausalLM(LlamaConfig(**CFG))


def _count_weight_quantisations(monkeypatch) -> list:
    made = []
    real = fp8._both
    monkeypatch.setattr(fp8, "_both", lambda weights, recipe: made.append(len(weights)) or real(weights, recipe))
    return made


def _train(model, batches, accumulate: int, fused: bool, made: list | None = None):
    """Losses and final weights of a few optimizer steps, ``accumulate`` micro-batches each; with
    ``made``, the weight quantisations of each step's micro-batches."""
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, fused=fused, foreach=None if fused else False)
    losses, per_step = [], []
    for step in range(0, len(batches), accumulate):
        before = None if made is None else len(made)
        for ids in batches[step:step + accumulate]:
            with torch.autocast("cpu", dtype=torch.bfloat16):
                loss = model(input_ids=ids, labels=ids).loss / accumulate
            loss.backward()
            losses.append(loss.item())
        if made is not None:
            per_step.append(len(made) - before)
        opt.step()
        opt.zero_grad(set_to_none=True)
    return losses, {n: p.detach().clone() for n, p in model.named_parameters()}, per_step


@pytest.mark.parametrize("fused", [True, False], ids=["fused-adamw", "for-loop-adamw"])
def test_per_step_trains_as_per_call_and_quantises_once_a_step(fused, monkeypatch):
    base = _model()
    gen = torch.Generator().manual_seed(1)
    batches = [torch.randint(0, 128, (2, 16), generator=gen) for _ in range(6)]
    want_losses, want_w, _ = _train(torchfuser.optimize(copy.deepcopy(base), backend="reference", fp8="rowwise"),
                                    batches, 3, fused)
    made = _count_weight_quantisations(monkeypatch)
    model = torchfuser.optimize(copy.deepcopy(base), backend="reference", fp8="rowwise", fp8_weights="per_step")
    assert any("once per optimizer step" in n for n in torchfuser.report(model).notes)
    got_losses, got_w, per_step = _train(model, batches, 3, fused, made)
    # Each weight group once per optimizer step, however many micro-batches (per call: 3 times)
    assert per_step == [WEIGHTS_PER_PASS, WEIGHTS_PER_PASS]
    # A stale copy would change the second step's losses: every loss and weight is per call's, bit for bit
    assert got_losses == want_losses
    for name, w in want_w.items():
        assert torch.equal(got_w[name], w), name


def test_a_copy_is_remade_when_the_weights_are_loaded(monkeypatch):
    model = torchfuser.optimize(_model(), backend="reference", fp8="rowwise", fp8_weights="per_step")
    made = _count_weight_quantisations(monkeypatch)
    ids = torch.randint(0, 128, (2, 16))

    def loss():
        with torch.autocast("cpu", dtype=torch.bfloat16):
            return model(input_ids=ids, labels=ids).loss

    first = loss()
    assert len(made) == WEIGHTS_PER_PASS
    loss()
    assert len(made) == WEIGHTS_PER_PASS  # nothing changed: the copies kept
    other = _model()
    with torch.no_grad():
        for p in other.parameters():
            p.mul_(0.5)
    model.load_state_dict(other.state_dict())  # copy_ bumps the versions
    second = loss()
    assert len(made) == 2 * WEIGHTS_PER_PASS
    assert second.item() != first.item()


def test_the_optimizer_hook_is_scoped_to_the_models_that_keep_copies():
    gc.collect()  # earlier tests' models, in reference cycles, let go when collected
    assert fp8_step.holders() == 0
    hooks = dict(_optim._global_optimizer_post_hooks)
    a = torchfuser.optimize(_model(), backend="reference", fp8="rowwise", fp8_weights="per_step")
    b = torchfuser.optimize(_model(), backend="reference", fp8="rowwise", fp8_weights="per_step")
    assert fp8_step.holders() == 2 and len(_optim._global_optimizer_post_hooks) == len(hooks) + 1
    torchfuser.restore(a)
    assert len(_optim._global_optimizer_post_hooks) == len(hooks) + 1  # b still holds it
    torchfuser.optimize(b, fp8_weights="per_call")  # per call again: b lets go
    assert fp8_step.holders() == 0 and dict(_optim._global_optimizer_post_hooks) == hooks
    assert not any("_fp8_per_step" in m.__dict__ for m in b.modules())


def test_bad_fp8_weights_are_refused():
    with pytest.raises(ValueError, match="'per_call' or 'per_step'"):
        torchfuser.optimize(_model(), fp8="rowwise", fp8_weights="once")
    with pytest.raises(ValueError, match="needs fp8="):
        torchfuser.optimize(_model(), fp8_weights="per_step")


def test_a_copy_made_after_its_original_was_restored_quantises_per_call():
    """copy.deepcopy of a per-step model keeps its modules' setting, but restoring the original takes the
    step hook out: with nothing counting steps, the copy quantises per call and trains as per call."""
    gc.collect()
    base = _model()
    gen = torch.Generator().manual_seed(2)
    batches = [torch.randint(0, 128, (2, 16), generator=gen) for _ in range(3)]
    want, want_w, _ = _train(torchfuser.optimize(copy.deepcopy(base), backend="reference", fp8="rowwise"), batches, 1, True)
    original = torchfuser.optimize(copy.deepcopy(base), backend="reference", fp8="rowwise", fp8_weights="per_step")
    twin = copy.deepcopy(original)
    torchfuser.restore(original)
    assert fp8_step.holders() == 0 and fp8_step.steps() is None
    got, got_w, _ = _train(twin, batches, 1, True)
    assert got == want
    for name, w in want_w.items():
        assert torch.equal(got_w[name], w), name
