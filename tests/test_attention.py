"""The attention pattern: what it fuses by structure, what it skips and why, dropout and fallbacks."""
from __future__ import annotations

import copy

import pytest
import torch
from torch import nn
from transformers import AttentionInterface, AutoConfig, AutoModelForCausalLM, LlamaConfig
from transformers.integrations.sdpa_attention import sdpa_attention_forward
from transformers.models.llama.modeling_llama import apply_rotary_pos_emb

import torchfuser
from torchfuser.modules import FusedAttention
from torchfuser.patterns import Skip
from torchfuser.patterns.attention import AttentionPattern

from test_architectures import batch, make, pair, rotary_inside

VOCAB = 128


def tiny(model_type: str, impl: str = "eager", **kw):
    cfg = AutoConfig.for_model(model_type, vocab_size=VOCAB, bos_token_id=1, eos_token_id=2, pad_token_id=0, **kw)
    cfg._attn_implementation = impl
    torch.manual_seed(0)
    return AutoModelForCausalLM.from_config(cfg)


def attention_entries(model):
    return [e for e in torchfuser.report(model).entries if e.pattern == "attention"]


def test_gemma2_softcapping_is_skipped_with_reason():
    model = make("gemma2")
    torchfuser.optimize(model, backend="reference")
    entries = attention_entries(model)
    assert len(entries) == 2 and not any(e.is_fused for e in entries)
    assert all("softcapping" in e.reason and "50.0" in e.reason for e in entries)


def test_gemma2_without_softcapping_fuses_and_matches():
    ref, fused = pair("gemma2", attn_logit_softcapping=None)
    assert all(e.is_fused for e in attention_entries(fused))
    ids, mask, labels = batch()
    a = ref(input_ids=ids, attention_mask=mask, labels=labels)
    b = fused(input_ids=ids, attention_mask=mask, labels=labels)
    torch.testing.assert_close(b.loss, a.loss, rtol=1e-5, atol=1e-6)


def test_config_output_attentions_is_skipped():
    model = make("llama", output_attentions=True)
    model.config._attn_implementation = "eager"
    torchfuser.optimize(model, backend="reference")
    assert all("output_attentions" in e.reason for e in attention_entries(model))


@pytest.mark.parametrize("hooked_before", [False, True])
def test_output_attentions_per_call_falls_back(hooked_before):
    ref = make("llama")
    ref.config._attn_implementation = "eager"
    fused = copy.deepcopy(ref)
    ids, mask, _ = batch()
    ref.eval(), fused.eval()
    with torch.no_grad():
        if hooked_before:  # transformers installs its capture hooks on first use
            fused(input_ids=ids, attention_mask=mask, output_attentions=True)
        torchfuser.optimize(fused, backend="reference")
        a = ref(input_ids=ids, attention_mask=mask, output_attentions=True)
        b = fused(input_ids=ids, attention_mask=mask, output_attentions=True)
    assert len(b.attentions) == len(a.attentions) == 2
    for x, y in zip(b.attentions, a.attentions):
        torch.testing.assert_close(x, y, rtol=1e-5, atol=1e-6)


def test_other_attention_implementation_is_skipped_and_falls_back_at_run_time():
    model = make("llama")
    model.config._attn_implementation_internal = "flash_attention_2"
    assert "flash_attention_2" in AttentionPattern().match(model.model.layers[0].self_attn).reason

    calls = []

    def counting_sdpa(*args, **kwargs):
        calls.append(1)
        return sdpa_attention_forward(*args, **kwargs)

    AttentionInterface.register("torchfuser_test_impl", counting_sdpa)
    ref, fused = pair("llama")  # fused under sdpa
    attn, original = fused.model.layers[0].self_attn, ref.model.layers[0].self_attn
    x = torch.randn(2, 6, 64)
    cos, sin = ref.model.rotary_emb(x, torch.arange(6)[None])
    kw = dict(position_embeddings=(cos, sin), attention_mask=None)
    with torch.no_grad():
        # switched after fusion: eager (no mask → no causal masking, as eager does) is still reproduced;
        # an implementation FusedAttention does not reproduce runs the original
        for impl in ("eager", "torchfuser_test_impl"):
            fused.config._attn_implementation_internal = ref.config._attn_implementation_internal = impl
            want = original(x, **kw)[0]
            torch.testing.assert_close(attn(x, **kw)[0], want, rtol=1e-5, atol=1e-6)
    assert calls == [1, 1]  # once by the unfused model, once by the fallback


class _ReversedValueHeads(nn.Module):
    """A fused [q | k | v] projection whose v heads are read in reverse order."""

    def __init__(self, config):
        super().__init__()
        self.config, self.layer_idx, self.is_causal = config, 0, True
        self.num_heads, self.head_dim = 2, 8
        self.qkv = nn.Linear(16, 48, bias=False)
        self.out = nn.Linear(16, 16, bias=False)

    def forward(self, hidden_states, attention_mask=None, **kwargs):
        shape = (*hidden_states.shape[:-1], -1, self.head_dim)
        q, k, v = (t.view(shape).transpose(1, 2) for t in self.qkv(hidden_states).chunk(3, dim=-1))
        out, w = sdpa_attention_forward(self, q, k, v.flip(1), attention_mask, scaling=self.head_dim**-0.5)
        return self.out(out.reshape(*hidden_states.shape[:-1], -1)), w


def test_value_where_no_layout_reads_it_is_named():
    """v's rows of a fused projection, traced by a one-token probe, fit no arrangement of q, k and v
    in blocks: skipped with the rows v comes from (head 0 reads the last 8 of v's 16)."""
    cfg = LlamaConfig(hidden_size=16, num_attention_heads=2, num_key_value_heads=2)
    cfg._attn_implementation = "sdpa"
    skip = AttentionPattern().match(_ReversedValueHeads(cfg))
    assert isinstance(skip, Skip)
    assert "fused projection 'qkv' holds v in its output rows 40-47, 32-39; no layout reads v from there" in skip.reason


def test_gpt2_cross_attention_is_skipped():
    model = make("gpt2", add_cross_attention=True)
    torchfuser.optimize(model, backend="reference")
    by_name = {e.name: e for e in attention_entries(model)}
    assert by_name["transformer.h.0.attn"].is_fused
    assert "cross-attention" in by_name["transformer.h.0.crossattention"].reason


@pytest.mark.parametrize("model_type,overrides", [
    ("gpt2", dict(attn_pdrop=0.3, resid_pdrop=0.2)),
    ("llama", dict(attention_dropout=0.3)),
    ("gpt_neox", dict(attention_dropout=0.3)),
    # Functional dropouts after the MLP's last projection (a float p attribute, no Dropout child):
    # fused without them, training lost its MLP dropout.
    ("seed_oss", dict(attention_dropout=0.1, residual_dropout=0.1)),
    ("starcoder2", dict(residual_dropout=0.2)),
])
def test_dropout_in_training_behaves_as_before(model_type, overrides):
    # Under sdpa the original draws its dropout masks in the same calls, in the same order, so
    # one seed gives identical results; in eval dropout is off in both.
    ref = make(model_type, **overrides)
    ref.config._attn_implementation = "sdpa"
    fused = copy.deepcopy(ref)
    torchfuser.optimize(fused, backend="reference")
    assert all(e.is_fused for e in attention_entries(fused))
    ids, mask, labels = batch(padded=False)
    losses = []
    for model in (ref, fused):
        model.train()
        torch.manual_seed(3)
        out = model(input_ids=ids, attention_mask=mask, labels=labels)
        out.loss.backward()
        losses.append(out.loss)
    torch.testing.assert_close(losses[1], losses[0], rtol=1e-5, atol=1e-6)
    for (n, a), b in zip(ref.named_parameters(), fused.parameters()):
        torch.testing.assert_close(b.grad, a.grad, rtol=1e-4, atol=1e-5, msg=n)
    torch.manual_seed(4)
    l1 = fused(input_ids=ids, attention_mask=mask, labels=labels).loss
    torch.manual_seed(5)
    l2 = fused(input_ids=ids, attention_mask=mask, labels=labels).loss
    assert l1 != l2  # dropout is really on in training


class _HandWritten(nn.Module):
    """Not a transformers class: standard parts under unusual names, GQA, q/k norms."""

    def __init__(self, config):
        super().__init__()
        self.config = config
        self.layer_idx = 0
        self.head_dim = config.hidden_size // config.num_attention_heads
        self.num_key_value_groups = config.num_attention_heads // config.num_key_value_heads
        self.scaling = self.head_dim**-0.5
        self.is_causal = True
        h, d = config.hidden_size, self.head_dim
        self.wv = nn.Linear(h, config.num_key_value_heads * d, bias=False)
        self.wq = nn.Linear(h, config.num_attention_heads * d, bias=True)
        self.wk = nn.Linear(h, config.num_key_value_heads * d, bias=False)
        self.proj = nn.Linear(config.num_attention_heads * d, h, bias=False)
        self.kn = nn.RMSNorm(d, eps=1e-6)
        self.qn = nn.RMSNorm(d, eps=1e-6)

    def forward(self, hidden_states, position_embeddings=None, attention_mask=None, **kwargs):
        shape = (*hidden_states.shape[:-1], -1, self.head_dim)
        q = self.qn(self.wq(hidden_states).view(shape)).transpose(1, 2)
        k = self.kn(self.wk(hidden_states).view(shape)).transpose(1, 2)
        v = self.wv(hidden_states).view(shape).transpose(1, 2)
        q, k = apply_rotary_pos_emb(q, k, *position_embeddings)
        out, w = sdpa_attention_forward(self, q, k, v, attention_mask, scaling=self.scaling)
        return self.proj(out.reshape(*hidden_states.shape[:-1], -1)), w


def test_unknown_module_from_standard_parts_is_fused_by_structure():
    cfg = LlamaConfig(hidden_size=64, num_attention_heads=4, num_key_value_heads=2)
    cfg._attn_implementation = "sdpa"
    torch.manual_seed(0)
    block = _HandWritten(cfg)
    spec = AttentionPattern().match(block)
    assert not isinstance(spec, Skip), spec
    assert spec.qkv == ("wq", "wk", "wv") and spec.out == "proj" and (spec.q_norm, spec.k_norm) == ("qn", "kn")
    fused = FusedAttention(block, spec, "reference")
    x = torch.randn(2, 7, 64)
    cos, sin = torch.randn(2, 7, 16), torch.randn(2, 7, 16)
    torch.testing.assert_close(fused(x, position_embeddings=(cos, sin))[0], block(x, position_embeddings=(cos, sin))[0],
                               rtol=1e-5, atol=1e-6)
    assert list(fused.state_dict()) == list(block.state_dict())


@pytest.mark.parametrize("tuning", [True, False])
def test_nope_layer_fuses_without_rotary_unless_it_scales_queries_by_position(tuning):
    """Llama 4's NoPE layers ignore the rotary embedding; with temperature tuning they scale the
    queries by position, but only past floor_scale tokens, which no short probe sees: skipped."""
    from transformers import Llama4TextConfig
    from transformers.models.llama4.modeling_llama4 import Llama4TextAttention

    cfg = Llama4TextConfig(hidden_size=64, intermediate_size=128, intermediate_size_mlp=128, num_attention_heads=4,
                           num_key_value_heads=2, head_dim=16, num_hidden_layers=1, no_rope_layers=[0],
                           attn_temperature_tuning=tuning, use_qk_norm=False)
    cfg._attn_implementation = "sdpa"
    attn = Llama4TextAttention(cfg, layer_idx=0)
    assert not attn.use_rope
    spec = AttentionPattern().match(attn)
    if tuning:
        assert isinstance(spec, Skip) and "temperature tuning" in spec.reason
    else:
        assert not isinstance(spec, Skip) and spec.rotary_dim == 0


def test_cohere_interleaved_rotary_matches_with_cache():
    """Cohere rotates adjacent channels with per-channel cos/sin: fused through rotate-half's order
    and back, so the loss, every gradient and the KV cache's keys are the unfused ones."""
    cfg = AutoConfig.for_model("cohere2", vocab_size=128, hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
                               num_key_value_heads=2, intermediate_size=128, pad_token_id=0)
    cfg._attn_implementation = "sdpa"
    torch.manual_seed(0)
    ref = AutoModelForCausalLM.from_config(cfg).float()
    fused = copy.deepcopy(ref)
    torchfuser.optimize(fused, backend="reference")  # the LM head too, with Cohere's logit scale
    specs = [m.spec for m in fused.modules() if isinstance(m, FusedAttention)]
    assert len(specs) == 2 and all(s.rotary_interleave == "pairs" for s in specs)
    ids, mask, labels = batch(padded=True)
    a = ref(input_ids=ids, attention_mask=mask, labels=labels)
    b = fused(input_ids=ids, attention_mask=mask, labels=labels)
    torch.testing.assert_close(b.loss, a.loss, rtol=1e-5, atol=1e-6)
    a.loss.backward(), b.loss.backward()
    for (n, p), q in zip(ref.named_parameters(), fused.parameters()):
        torch.testing.assert_close(q.grad, p.grad, rtol=1e-4, atol=1e-5, msg=n)
    ref.eval(), fused.eval()
    with torch.no_grad():
        ca = ref(input_ids=ids, attention_mask=mask, use_cache=True).past_key_values
        cb = fused(input_ids=ids, attention_mask=mask, use_cache=True).past_key_values
        for la, lb in zip(ca.layers, cb.layers):
            torch.testing.assert_close(lb.keys, la.keys, rtol=1e-5, atol=1e-6)


@pytest.mark.skipif(rotary_inside(make("gptj")), reason="this transformers builds gptj's rotary inside the attention")
def test_gptj_rotary_from_sin_first_pair_tables():
    """GPT-J passes (sin, cos), one entry per rotating pair, for adjacent channels of the first
    rotary_dim of each head: found by the probe and computed by the fused path (not the fallback)
    on the real tables at shifted positions; tables of another width run the original."""
    ref, fused = pair("gptj")
    specs = [m.spec for m in fused.modules() if isinstance(m, FusedAttention)]
    assert len(specs) == 2
    assert all((s.rotary_dim, s.rotary_interleave, s.rotary_pair_tables, s.rotary_sin_first) == (8, "half", True, True)
               for s in specs)
    attn, original = fused.transformer.h[0].attn, ref.transformer.h[0].attn
    fallbacks = []
    attn.__dict__["_original"].register_forward_pre_hook(lambda *_: fallbacks.append(1))
    x = torch.randn(2, 6, 64)
    pe = ref.transformer.rotary_emb(x, torch.arange(3, 9)[None])
    assert pe[0].shape[-1] == 4
    with torch.no_grad():
        torch.testing.assert_close(attn(x, position_embeddings=pe)[0], original(x, position_embeddings=pe)[0],
                                   rtol=1e-5, atol=1e-6)
        assert fallbacks == []
        with pytest.raises(RuntimeError):  # the original's own shape error
            attn(x, position_embeddings=(torch.randn(2, 6, 8), torch.randn(2, 6, 8)))
        assert fallbacks == [1]


@pytest.mark.skipif(rotary_inside(make("codegen")), reason="this transformers builds codegen's rotary inside the attention")
def test_codegen_qkv_in_blocks_of_q_v_k():
    """CodeGen's fused projection holds [q | v | k] per model-parallel shard: 4 blocks, here of 2
    heads each, found by the probe (the count from the head count, not the class) and computed by
    the fused path (not the fallback), its gradient as the original's."""
    ref, fused = pair("codegen", n_embd=128, n_head=8)
    specs = [m.spec for m in fused.modules() if isinstance(m, FusedAttention)]
    assert len(specs) == 2
    assert all((s.layout, s.num_heads, s.qkv_blocks, s.qkv_order) == ("concat", 8, 4, ("q", "v", "k")) for s in specs)
    attn, original = fused.transformer.h[0].attn, ref.transformer.h[0].attn
    fallbacks = []
    attn.__dict__["_original"].register_forward_pre_hook(lambda *_: fallbacks.append(1))
    x = torch.randn(2, 6, 128)
    pe = ref.transformer.rotary_emb(x, torch.arange(3, 9)[None])
    want, got = original(x, position_embeddings=pe)[0], attn(x, position_embeddings=pe)[0]
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)
    assert fallbacks == []
    g = torch.randn_like(want)
    (dw_want,) = torch.autograd.grad(want, original.qkv_proj.weight, g)
    (dw_got,) = torch.autograd.grad(got, attn.qkv_proj.weight, g)
    torch.testing.assert_close(dw_got, dw_want, rtol=1e-4, atol=1e-6)
