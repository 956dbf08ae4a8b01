"""A decode step under no grad runs the original modules (``modules.decode``): TRL's rollout setting (training mode,
no_grad, left-padded prompts, KV cache, greedy) gives the unfused model's tokens and every step's logits bit for bit,
the prefill and every grad-mode call still run fused, the original's state follows the fused module's (parameters
swapped in, training flags), the switch turns it off and the report counts the calls."""
from __future__ import annotations

import copy

import pytest
import torch
from torch import nn
from transformers import DynamicCache

import torchfuser
from torchfuser import switches
from torchfuser.modules import decode
from torchfuser.modules.residual_norm import ResidualNormForward

from tiny_lm import VOCAB, left_padded_prompts, lm_step, tiny_model

NEW = 6


def _pair(model_type: str, backend: str = "reference"):
    base = tiny_model(model_type)
    return base, torchfuser.optimize(copy.deepcopy(base), backend=backend)


def _prompts():
    return left_padded_prompts(4, 10, 2, 3, VOCAB)  # left padding of 0, 2, 4, 6 tokens


def _generate(model):
    ids, mask = _prompts()
    model.train()  # TRL's rollouts: the trainer's mode, under no_grad
    with torch.no_grad():
        return model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=NEW, min_new_tokens=NEW,
                              do_sample=False, pad_token_id=0, use_cache=True, output_logits=True,
                              return_dict_in_generate=True)


@pytest.fixture
def fused_layer_calls(monkeypatch):
    """How many times a fused decoder layer ran its fused computation."""
    calls = []
    fused = ResidualNormForward._fused

    def spy(self, *args, **kwargs):
        calls.append(self.layer)
        return fused(self, *args, **kwargs)

    monkeypatch.setattr(ResidualNormForward, "_fused", spy)
    return calls


def _decode_counts(model) -> dict[str, int]:
    report = torchfuser.report(model)
    assert not report.fallbacks  # none left the fused path for want of a way: those handed on are counted apart
    return report.decode_calls


@pytest.mark.parametrize("model_type", ["llama", "qwen2", "qwen3"])  # (qwen3: q/k norms inside the attention)
def test_rollouts_give_the_unfused_tokens_and_logits_bit_for_bit(model_type, fused_layer_calls):
    base, fused = _pair(model_type)
    want, got = _generate(base), _generate(fused)
    assert torch.equal(got.sequences, want.sequences)
    assert len(got.logits) == NEW and all(torch.equal(g, w) for g, w in zip(got.logits, want.logits))
    layers = [m for m in fused.modules() if isinstance(m.__dict__.get("forward"), ResidualNormForward)]
    assert fused_layer_calls == layers  # the prefill ran fused, once a layer; the decode steps did not
    counts = _decode_counts(fused)  # the decode steps' top-level calls: the layers and the final norm
    assert len(counts) == len(layers) + 1 and set(counts.values()) == {NEW - 1}


@pytest.mark.parametrize("model_type", ["gpt_neox", "qwen2_moe"])
def test_decode_steps_equal_the_unfused_ones_on_the_same_cache(model_type):
    """Exact by construction, also where the fused prefill rounds otherwise than the unfused one (GPT-NeoX's
    LayerNorms and parallel residual, the MoE blocks' grouped experts): from one cache, each decode step gives the
    unfused model's logits."""
    base, fused = _pair(model_type)
    ids, mask = _prompts()
    cache = DynamicCache(config=base.config)
    with torch.no_grad():
        nxt = fused(input_ids=ids, attention_mask=mask, past_key_values=cache, use_cache=True).logits[:, -1:].argmax(-1)
        for _ in range(3):
            mask = torch.cat([mask, torch.ones_like(nxt)], dim=1)
            twin = copy.deepcopy(cache)
            got = fused(input_ids=nxt, attention_mask=mask, past_key_values=cache, use_cache=True).logits
            want = base(input_ids=nxt, attention_mask=mask, past_key_values=twin, use_cache=True).logits
            assert torch.equal(got, want)
            nxt = got[:, -1:].argmax(-1)
    assert set(_decode_counts(fused).values()) == {3}


def test_the_switch_turns_the_dispatch_off(fused_layer_calls):
    base, fused = _pair("llama")
    with switches.switched(decode_to_original=False):
        got = _generate(fused)
    assert torch.equal(got.sequences, _generate(base).sequences)  # the fused kernels' decode path: same bits here
    assert len(fused_layer_calls) == NEW * 2 and _decode_counts(fused) == {}


def test_the_report_counts_the_calls():
    _, fused = _pair("llama")
    assert not any(decode.REASON in n for n in torchfuser.report(fused).notes)
    _generate(fused)
    notes = [n for n in torchfuser.report(fused).notes if decode.REASON in n]
    assert notes == [f"decode: model.layers.* (2 modules): {2 * (NEW - 1)} calls ran the original modules: {decode.REASON}",
                     f"decode: model.norm: {NEW - 1} calls ran the original modules: {decode.REASON}"]
    assert torchfuser.report(fused).to_dict()["decode_calls"] == {"model.layers.0": NEW - 1, "model.layers.1": NEW - 1,
                                                                  "model.norm": NEW - 1}


def test_grad_mode_long_rows_and_packed_rows_run_fused(fused_layer_calls):
    _, fused = _pair("llama")
    one = torch.randint(3, VOCAB, (4, 1))
    fused(input_ids=one, use_cache=False).logits.sum().backward()  # grad mode, one position a row
    with torch.no_grad():
        fused(input_ids=torch.randint(3, VOCAB, (4, decode.DECODE_POSITIONS + 1)), use_cache=False)  # scoring
        fused(input_ids=torch.randint(3, VOCAB, (1, 24)), position_ids=torch.arange(12).repeat(2)[None],
              use_cache=False)  # packed: one long row of two sequences
        fused(input_ids=torch.randint(3, VOCAB, (4, decode.DECODE_POSITIONS)), use_cache=False)  # decode-shaped
    assert len(fused_layer_calls) == 3 * 2
    assert set(_decode_counts(fused).values()) == {1}


def test_a_training_step_after_rollouts_runs_fused_with_the_unfused_gradients(fused_layer_calls):
    base, fused = _pair("llama")
    _generate(fused)
    _generate(base)
    before = _decode_counts(fused)
    fused_layer_calls.clear()
    want, got = lm_step(base), lm_step(fused)
    assert len(fused_layer_calls) == 2 and _decode_counts(fused) == before  # fused, nothing handed on
    torch.testing.assert_close(got, want)
    for (name, a), (_, b) in zip(base.named_parameters(), fused.named_parameters()):
        torch.testing.assert_close(b.grad, a.grad, rtol=1e-4, atol=1e-6, msg=name)
    assert [n for n, _ in fused.named_parameters()] == [n for n, _ in base.named_parameters()]


def test_the_original_follows_what_the_fused_module_holds():
    """Parameters swapped in after fusing (``load_state_dict(assign=True)``, an adapter), ``.eval()`` / ``.train()``:
    the original runs on them at decode, without a per-call hand-back (it shares the fused module's dicts)."""
    base, fused = _pair("llama")
    attn = fused.model.layers[0].self_attn
    original = attn.__dict__["_original"]
    assert original._modules is attn._modules and original._parameters is attn._parameters
    state = {k: v * 1.5 for k, v in base.state_dict().items()}
    base.load_state_dict(state, assign=True)
    fused.load_state_dict(state, assign=True)
    for model in (base, fused):  # a child swapped for another module, as PEFT wraps a projection
        layer = model.model.layers[1].mlp
        layer.down_proj = nn.Sequential(layer.down_proj, nn.Identity())
    fused.eval()
    with torch.no_grad():
        fused(input_ids=torch.randint(3, VOCAB, (2, 1)), use_cache=False)  # (synced at the call: no per-call write)
    assert not original.training
    want, got = _generate(base), _generate(fused)  # (train() again inside)
    assert original.training
    assert set(_decode_counts(fused).values()) == {NEW}  # (the original ran: the eval call and NEW - 1 steps)
    assert torch.equal(got.sequences, want.sequences)
    assert all(torch.equal(g, w) for g, w in zip(got.logits, want.logits))


def test_restore_gives_the_originals_dicts_of_their_own():
    base, fused = _pair("llama")
    attn = fused.model.layers[0].self_attn
    original = attn.__dict__["_original"]
    _generate(fused)
    torchfuser.restore(fused)
    assert fused.model.layers[0].self_attn is original
    assert original._modules is not attn._modules and original._parameters is not attn._parameters
    assert not any(k.startswith(("_decode", "_torchfuser_decode")) for m in fused.modules() for k in m.__dict__)
    assert list(fused.state_dict()) == list(base.state_dict())
    assert torch.equal(_generate(fused).sequences, _generate(base).sequences)


def test_a_module_whose_dicts_are_its_own_keeps_the_fused_path():
    """A DataParallel replica (dicts of its own) or FSDP1's views (plain attributes): the original would not see
    them, so such a module runs fused."""
    _, fused = _pair("llama")
    norm = fused.model.norm
    x = torch.randn(2, 1, norm.weight.shape[0])
    with torch.no_grad():
        assert decode.original(norm, x) is not None
        replica = norm._replicate_for_data_parallel()
        assert decode.original(replica, x) is None
        norm.__dict__["weight"] = norm.weight.detach().clone()  # as FSDP1 sets its views
        assert decode.original(norm, x) is None


def test_hooks_on_a_fused_child_run_at_decode():
    """A hook put on a fused child after the layer's swap dict was made: the layer calls that child (its hooks run),
    which hands the call on to its original."""
    base, fused = _pair("llama")
    _generate(fused)
    seen = []
    fused.model.layers[0].mlp.register_forward_hook(lambda mod, args, out: seen.append(args[0].shape[1]))
    got, want = _generate(fused), _generate(base)
    assert seen == [10] + [1] * (NEW - 1)  # the prefill (fused), then each decode step
    assert torch.equal(got.sequences, want.sequences)
