"""LayerNorm-based families with their residual adds fused (patterns/residual_norm.py): sequential
pre-norm layers (GPT-2, StarCoder2, NeoX without parallel residual), parallel attention + MLP residuals
with two norms (GPT-NeoX) or one (GPT-J, Phi, Cohere). One training step fused vs unfused: loss and
every gradient (fp32 tight; bf16 by the numerics rule against float64), restore, state_dict keys; what
stays unfused says why (BLOOM, active dropout; OPT's post-norm form: test_post_norm_layers.py). OPT's pre-norm layer (its MLP inline) fuses. Falcon's layers take required arguments and return a tuple:
fused, passing them through."""
from __future__ import annotations

import copy
import inspect

import pytest
import torch
from transformers import AutoConfig, AutoModelForCausalLM

import torchfuser
from torchfuser.modules import fallbacks
from tiny_lm import fused_layers as layers

from numerics import assert_bf16_within_rule, assert_trains_like

VOCAB = 96
_COMMON = dict(vocab_size=VOCAB, bos_token_id=1, eos_token_id=2, pad_token_id=0)
_SMALL = dict(hidden_size=32, num_hidden_layers=2, num_attention_heads=4, intermediate_size=64)
_FALCON = dict(hidden_size=32, num_hidden_layers=2, num_attention_heads=4, ffn_hidden_size=64)
_OPT = dict(hidden_size=32, num_hidden_layers=2, num_attention_heads=4, ffn_dim=64, word_embed_proj_dim=32)
_GPT = dict(n_embd=32, n_layer=2, n_head=4, attn_pdrop=0.0, resid_pdrop=0.0, embd_pdrop=0.0)
# name → (model_type, config overrides, attention implementation, the layers' form: sequential, parallel or shared)
FAMILIES = {
    "gpt2": ("gpt2", dict(_GPT), "eager", "sequential"),
    "gpt2-sdpa-tanh": ("gpt2", dict(_GPT, activation_function="gelu_new"), "sdpa", "sequential"),
    "gptj": ("gptj", dict(_GPT, rotary_dim=4, n_positions=64), "eager", "shared"),
    "neox": ("gpt_neox", dict(_SMALL, rotary_pct=0.25, hidden_dropout=0.0, attention_dropout=0.0), "sdpa", "parallel"),
    "neox-sequential": ("gpt_neox", dict(_SMALL, rotary_pct=0.25, hidden_dropout=0.0, attention_dropout=0.0,
                                         use_parallel_residual=False), "sdpa", "sequential"),
    "phi": ("phi", dict(_SMALL, partial_rotary_factor=0.5, resid_pdrop=0.0, embd_pdrop=0.0, attention_dropout=0.0),
            "sdpa", "shared"),
    "starcoder2": ("starcoder2", dict(_SMALL, num_key_value_heads=2, residual_dropout=0.0, embedding_dropout=0.0,
                                      use_bias=True), "sdpa", "sequential"),
    "cohere": ("cohere", dict(_SMALL, num_key_value_heads=2), "sdpa", "shared"),
    "stablelm": ("stablelm", dict(_SMALL, num_key_value_heads=2), "sdpa", "sequential"),
    # Falcon's layer requires attention_mask (5.25) / alibi (5.17) and returns (hidden states, attention weights)
    # OPT's layer holds its MLP inline: fc1 → activation → fc2 are its own children
    "opt": ("opt", dict(_OPT, dropout=0.0), "sdpa", "sequential"),
    "opt-gelu": ("opt", dict(_OPT, dropout=0.0, activation_function="gelu"), "eager", "sequential"),
    "falcon": ("falcon", dict(_FALCON), "sdpa", "shared"),
    "falcon-alibi": ("falcon", dict(_FALCON, alibi=True), "eager", "shared"),
    "falcon-new": ("falcon", dict(_FALCON, new_decoder_architecture=True, num_kv_heads=2), "sdpa", "parallel"),
    "falcon-sequential": ("falcon", dict(_FALCON, parallel_attn=False), "sdpa", "sequential"),
}


def make(name: str, **overrides):
    model_type, extra, impl, _ = FAMILIES[name]
    cfg = AutoConfig.for_model(model_type, **{**_COMMON, **extra, **overrides})
    cfg._attn_implementation = impl
    torch.manual_seed(0)
    return AutoModelForCausalLM.from_config(cfg).float().train()


def batch():
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(3, VOCAB, (2, 9), generator=g)
    return ids, torch.ones_like(ids)


def step(model, dtype=None):
    ids, mask = batch()
    torch.manual_seed(0)
    loss = model(input_ids=ids, attention_mask=mask, labels=ids).loss
    loss.backward()
    return loss.detach()


@pytest.mark.parametrize("name", list(FAMILIES))
def test_one_training_step_fused_matches_unfused(name):
    ref = make(name)
    fused = copy.deepcopy(ref)
    keys = list(ref.state_dict())
    torchfuser.optimize(fused, backend="reference")
    fused_layers = layers(fused)
    if any("returns a tuple" in e.reason for e in torchfuser.report(fused).skipped):
        pytest.skip("this transformers' layer returns a tuple (GPT-J in 5.17): left unfused, with that reason")
    assert len(fused_layers) == 2, str(torchfuser.report(fused))
    spec = fused_layers[0].forward.spec
    form = FAMILIES[name][3]
    assert spec.parallel == (form != "sequential") and (spec.norm_mid == spec.norm_in) == (form == "shared"), spec
    assert_trains_like(ref, fused, step, keys, loss_rtol=1e-6)
    assert not layers(fused) and list(fused.state_dict()) == keys


@pytest.mark.parametrize("name", ["gpt2", "neox", "opt", "falcon"])
def test_bf16_within_the_rule(name):
    """bf16 weights and activations: the fused model's loss and every gradient no further from the float64
    model's than twice the unfused bf16 model's error (+ a small atol)."""
    ref64 = make(name).double()
    plain = copy.deepcopy(ref64).to(torch.bfloat16)
    fused = copy.deepcopy(plain)
    torchfuser.optimize(fused, backend="reference")
    assert len(layers(fused)) == 2
    assert_bf16_within_rule(fused, plain, ref64, step)


def test_active_dropout_between_the_blocks_is_fused_with_the_same_masks():
    """GPT-NeoX's post_attention_dropout / post_mlp_dropout on: applied by the fused forward where the original
    applies them (``patterns._residual_dropout``), from the same draws: the loss and every gradient match."""
    ref = make("neox", hidden_dropout=0.1)
    fused = copy.deepcopy(ref)
    torchfuser.optimize(fused, backend="reference")
    assert len(layers(fused)) == 2
    assert {(m.forward.spec.attention_dropout, m.forward.spec.mlp_dropout) for m in layers(fused)} == {
        ("post_attention_dropout", "post_mlp_dropout")}
    assert_trains_like(ref, fused, step, list(ref.state_dict()))


def test_dropout_turned_on_after_fusing_runs_fused_with_the_same_masks():
    """Fused with the dropouts at 0, then turned on: the fused forward applies them as the original does (the
    same random stream), no fallback."""
    ref = make("phi")
    fused = copy.deepcopy(ref)
    torchfuser.optimize(fused, backend="reference")
    for m in (ref, fused):
        for layer in m.model.layers:
            layer.resid_dropout.p = 0.3
    assert_trains_like(ref, fused, step, list(ref.state_dict()))  # the same masks, no fallback


def test_gpt2_cross_attention_inputs_run_the_original_forward():
    """GPT-2's block raises when given encoder states without cross-attention layers: an argument the
    fused forward does not take (``at_default``) runs the original, which raises as it did."""
    model = make("gpt2")
    torchfuser.optimize(model, backend="reference")
    block = model.transformer.h[0]
    assert "encoder_hidden_states" in block.forward.spec.at_default
    x = torch.randn(1, 3, 32)
    with pytest.raises(ValueError, match="cross-attention"):
        block(x, encoder_hidden_states=torch.randn(1, 3, 32))


@pytest.mark.parametrize("model_type, overrides, reason", [
    ("bloom", dict(hidden_size=32, n_layer=2, n_head=4, apply_residual_connection_post_layernorm=True),
     "the residual is the norm's output"),
])
def test_what_stays_unfused_says_why(model_type, overrides, reason):
    cfg = AutoConfig.for_model(model_type, **{**_COMMON, **overrides})
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(cfg).float()
    torchfuser.optimize(model, backend="reference")
    skipped = [e for e in torchfuser.report(model).skipped if e.pattern == "residual_norm"]
    assert len(skipped) == 2 and all(reason in e.reason for e in skipped), skipped


def test_a_norm_excluded_by_filter_fn_leaves_its_layer_unfused_with_the_reason():
    """The layer's fused forward runs its norms' kernels: with GPT-2's ln_1 excluded, the block is skipped,
    named through its own norm (not Llama's child names)."""
    model = make("gpt2")
    torchfuser.optimize(model, backend="reference", filter_fn=lambda m, fqn: not fqn.endswith("h.0.ln_1"))
    entries = {e.name: e for e in torchfuser.report(model).entries if e.pattern == "residual_norm"}
    assert entries["transformer.h.0"].reason.startswith("excluded by filter_fn, through its ln_1")
    assert entries["transformer.h.1"].is_fused


def test_falcon_config_dropout_read_by_the_layer():
    """Falcon's layer reads its dropouts from its config (``dropout_add(…, self.config.hidden_dropout)``). The
    parallel layer drops the sum of both blocks once (``sum_dropout``), the sequential one each block's output:
    placed by the probe, applied by the fused forward from the same draws (no fallback)."""
    ref = make("falcon", hidden_dropout=0.1)
    fused = copy.deepcopy(ref)
    torchfuser.optimize(fused, backend="reference")
    assert {m.forward.spec.sum_dropout for m in layers(fused)} == {"config.hidden_dropout"}, torchfuser.report(fused)
    assert len(layers(fused)) == 2
    assert_trains_like(ref, fused, step, list(ref.state_dict()))
    ref = make("falcon-sequential")
    fused = copy.deepcopy(ref)
    torchfuser.optimize(fused, backend="reference")
    assert len(layers(fused)) == 2
    ref.config.hidden_dropout = fused.config.hidden_dropout = 0.3  # the layers share the model's config
    assert {m.forward.spec.mlp_dropout for m in layers(fused)} == {"config.hidden_dropout"}
    assert_trains_like(ref, fused, step, list(ref.state_dict()))


def test_a_required_argument_left_out_raises_as_the_original():
    """The fused forward passes Falcon's required arguments on; without one it runs the original forward,
    which raises the TypeError it always did (never a default made up)."""
    model = make("falcon")
    torchfuser.optimize(model, backend="reference")
    layer = layers(model)[0]
    required = [n for n, _, d in layer.forward.spec.arguments if d is inspect.Parameter.empty]
    assert required, layer.forward.spec
    seen = []
    handle = layer.register_forward_pre_hook(lambda m, a, kw: seen.append((a, kw)), with_kwargs=True)
    ids, mask = batch()
    with torch.no_grad():
        model(input_ids=ids, attention_mask=mask, use_cache=False)
    handle.remove()
    (x, *rest), kwargs = seen[0]
    kwargs = {**kwargs, **dict(zip(layer.forward.spec.positional, rest))}
    with pytest.raises(TypeError, match=required[0]):
        layer(x, **{k: v for k, v in kwargs.items() if k != required[0]})
    with torch.no_grad():
        out, want = layer(x, **kwargs), type(layer).forward(layer, x, **kwargs)
    assert isinstance(out, tuple) and len(out) == 2
    assert fallbacks.counts(model) == {"transformer.h.0": {"a required argument is missing": 1}}  # the raising call
    torch.testing.assert_close(out[0], want[0], rtol=1e-6, atol=1e-6)


def test_falcon_attention_fused_in_both_transformers():
    """transformers 5.17's Falcon attention takes ``alibi`` (None with alibi=False): fused there too, and a call
    given an alibi tensor runs the original (counted), never the fused attention without its bias."""
    model = make("falcon")
    torchfuser.optimize(model, backend="reference")
    fused = [e for e in torchfuser.report(model).fused if e.pattern == "attention"]
    assert len(fused) == 2, str(torchfuser.report(model))
    attention = model.transformer.h[0].self_attention
    if "alibi" in attention.spec.positional:
        x, mask = torch.randn(1, 3, 32), torch.zeros(1, 1, 3, 3)
        attention(x, alibi=torch.zeros(4, 1, 3), attention_mask=mask, position_embeddings=(torch.ones(1, 3, 8),) * 2)
        assert "position bias (alibi)" in str(fallbacks.counts(model))


def _on_device_matches_unfused(name: str, device: str):
    ref = make(name).to(device)
    fused = copy.deepcopy(ref)
    torchfuser.optimize(fused)  # the defaults: Triton kernels (and whatever execution mode it picks) on CUDA
    assert len(layers(fused)) == 2, str(torchfuser.report(fused))
    ids, mask = (t.to(device) for t in batch())
    losses = []
    for m in (ref, fused):
        for _ in range(2):  # twice: a second call may replay what the first captured
            m.zero_grad(set_to_none=True)
            loss = m(input_ids=ids, attention_mask=mask, labels=ids, use_cache=False).loss
            loss.backward()
        losses.append(loss.detach())
    torch.testing.assert_close(losses[1], losses[0], rtol=1e-4, atol=1e-4)
    for (n, a), (_, b) in zip(ref.named_parameters(), fused.named_parameters()):
        torch.testing.assert_close(b.grad, a.grad, rtol=1e-3, atol=1e-4, msg=n)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("name", ["falcon", "falcon-new", "opt"])
def test_on_cuda_with_the_defaults(name):
    """Falcon's tuple-returning layers and OPT's inline-MLP layers with optimize's defaults on the GPU."""
    _on_device_matches_unfused(name, "cuda")
