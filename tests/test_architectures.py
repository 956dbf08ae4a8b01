"""Every architecture in the registry, tiny random configs (no downloads), CPU fp32, backend="reference":
fused vs unfused loss and every gradient, state_dict, restore, report, padding, eval, KV cache,
generate and the Trainer's num_items_in_batch."""
from __future__ import annotations

import copy
import inspect

import pytest
import torch
from transformers import AutoConfig, AutoModelForCausalLM

import torchfuser

VOCAB = 128
_COMMON = dict(vocab_size=VOCAB, bos_token_id=1, eos_token_id=2, pad_token_id=0)
_LLAMA_LIKE = dict(hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, intermediate_size=128)
_GPTJ_LIKE = dict(n_embd=64, n_layer=2, n_head=4, rotary_dim=8, n_positions=64, attn_pdrop=0.0, resid_pdrop=0.0,
                  embd_pdrop=0.0)

# model_type → (config overrides, attention implementation, patterns fused per model, skips expected)
ARCHS = {
    "llama": (dict(_LLAMA_LIKE), "sdpa"),
    "mistral": (dict(_LLAMA_LIKE, sliding_window=6), "sdpa"),  # window < sequence: the mask carries it
    "qwen2": (dict(_LLAMA_LIKE), "eager"),
    "qwen3": (dict(_LLAMA_LIKE, head_dim=16), "sdpa"),
    "gemma": (dict(_LLAMA_LIKE, head_dim=16), "eager"),
    "gemma2": (dict(_LLAMA_LIKE, head_dim=16, sliding_window=6), "eager"),  # HF refuses sdpa for Gemma-2
    "phi3": (dict(_LLAMA_LIKE, partial_rotary_factor=0.5), "sdpa"),
    "smollm3": (dict(_LLAMA_LIKE, no_rope_layers=[1, 0]), "sdpa"),  # the second layer has no rotary (NoPE)
    "glm4": (dict(_LLAMA_LIKE, partial_rotary_factor=0.5), "sdpa"),  # adjacent channels rotate together, half the head
    "olmo2": (dict(_LLAMA_LIKE), "sdpa"),  # norms after attention and MLP, q/k norms over all heads
    "gemma3_text": (dict(_LLAMA_LIKE, head_dim=16, sliding_window=6), "sdpa"),
    "exaone4": (dict(_LLAMA_LIKE), "sdpa"),
    "seed_oss": (dict(_LLAMA_LIKE, attention_dropout=0.0, residual_dropout=0.0), "sdpa"),  # dropouts: test_attention
    "stablelm": (dict(_LLAMA_LIKE), "sdpa"),  # partial rotary, LayerNorm
    "starcoder2": (dict(_LLAMA_LIKE, residual_dropout=0.0, embedding_dropout=0.0), "sdpa"),
    "opt": (dict(hidden_size=64, num_hidden_layers=2, num_attention_heads=4, ffn_dim=128, word_embed_proj_dim=64,
                 dropout=0.0), "sdpa"),
    "gpt2": (dict(n_embd=64, n_layer=2, n_head=4, attn_pdrop=0.0, resid_pdrop=0.0, embd_pdrop=0.0), "eager"),
    "gpt_neox": (dict(hidden_size=64, num_hidden_layers=2, num_attention_heads=4, intermediate_size=128,
                      rotary_pct=0.5, hidden_dropout=0.0, attention_dropout=0.0), "sdpa"),
    # Adjacent-pair rotary on half of each head, from (sin, cos) tables of one entry per pair.
    "gptj": (dict(_GPTJ_LIKE), "eager"),
    # GPT-J's rotary; its fused qkv projection holds 4 blocks of [q | v | k], one per model-parallel shard.
    # Eager: transformers 5.17 refuses sdpa for CodeGen.
    "codegen": (dict(_GPTJ_LIKE), "eager"),
}
# What each fuses besides attention (2 layers) and lm_head_loss (1).
EXPECTED = {
    "llama": {"rms_norm": 5, "gated_mlp": 2, "residual_norm": 2},
    "mistral": {"rms_norm": 5, "gated_mlp": 2, "residual_norm": 2},
    "qwen2": {"rms_norm": 5, "gated_mlp": 2, "residual_norm": 2},
    "qwen3": {"rms_norm": 9, "gated_mlp": 2, "residual_norm": 2},  # + q_norm and k_norm per layer
    "gemma": {"rms_norm": 5, "gated_mlp": 2, "residual_norm": 2},
    "gemma2": {"rms_norm": 9, "gated_mlp": 2, "residual_norm": 2},  # four norms per layer + final (a sandwich)
    "phi3": {"rms_norm": 5, "gated_mlp": 2, "residual_norm": 2},  # fused while its resid dropouts are off
    "smollm3": {"rms_norm": 5, "gated_mlp": 2, "residual_norm": 2},
    "glm4": {"rms_norm": 9, "gated_mlp": 2, "residual_norm": 2},  # + post-attention and post-MLP norms (a sandwich)
    "olmo2": {"rms_norm": 9, "gated_mlp": 2, "residual_norm": 2},  # + q/k norms; post-block norms (rms_norm_add)
    "gemma3_text": {"rms_norm": 13, "gated_mlp": 2, "residual_norm": 2},  # four norms a layer (a sandwich), q/k norms, final
    "exaone4": {"rms_norm": 9, "gated_mlp": 2, "residual_norm": 2},
    "seed_oss": {"rms_norm": 5, "gated_mlp": 2, "residual_norm": 2},
    "stablelm": {"layer_norm": 5, "gated_mlp": 2, "residual_norm": 2},
    "starcoder2": {"layer_norm": 5, "mlp": 2, "residual_norm": 2},
    "opt": {"layer_norm": 5, "residual_norm": 2},  # its MLP inline (fc1, fc2 children of the layer): adds in the norms
    "gpt2": {"layer_norm": 5, "mlp": 2, "residual_norm": 2},
    "gpt_neox": {"layer_norm": 5, "mlp": 2, "residual_norm": 2},  # parallel residual
    "gptj": {"layer_norm": 3, "mlp": 2, "residual_norm": 2},  # attention and MLP in parallel after one norm
    "codegen": {"layer_norm": 3, "mlp": 2, "residual_norm": 2},
}
# Gemma-2's attention softcaps its logits: skipped, with the reason.
SKIPPED_ATTENTION = {"gemma2": "softcapping"}


def make(model_type: str, **overrides) -> torch.nn.Module:
    extra, impl = ARCHS[model_type]
    cfg = AutoConfig.for_model(model_type, **{**_COMMON, **extra, **overrides})
    cfg._attn_implementation = impl
    torch.manual_seed(0)
    return AutoModelForCausalLM.from_config(cfg).float()


def batch(padded: bool = True):
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(3, VOCAB, (2, 10), generator=g)
    mask = torch.ones_like(ids)
    labels = ids.clone()
    if padded:  # left padding in the second row, as generation and many collators do
        mask[1, :3] = 0
        labels[1, :3] = -100
    return ids, mask, labels


def pair(model_type: str, **overrides):
    ref = make(model_type, **overrides)
    fused = copy.deepcopy(ref)
    torchfuser.optimize(fused, backend="reference")
    return ref, fused


def assert_grads_match(ref, fused):
    for (name, p_ref), (name_f, p_fused) in zip(ref.named_parameters(), fused.named_parameters()):
        assert name == name_f
        assert (p_ref.grad is None) == (p_fused.grad is None), name
        if p_ref.grad is not None:
            torch.testing.assert_close(p_fused.grad, p_ref.grad, rtol=1e-4, atol=1e-5, msg=name)


@pytest.fixture(scope="module", params=list(ARCHS))
def arch(request):
    return request.param


def test_loss_and_every_gradient_match(arch):
    ref, fused = pair(arch)
    ref.train(), fused.train()
    ids, mask, labels = batch(padded=True)
    out_ref = ref(input_ids=ids, attention_mask=mask, labels=labels)
    out_fused = fused(input_ids=ids, attention_mask=mask, labels=labels)
    assert "logits" not in out_fused  # the fused loss never materialises the logits
    torch.testing.assert_close(out_fused.loss, out_ref.loss, rtol=1e-5, atol=1e-6)
    out_ref.loss.backward()
    out_fused.loss.backward()
    assert_grads_match(ref, fused)


def rotary_inside(model) -> bool:
    """Whether the model's attention builds its rotary tables itself from position_ids, as GPT-J's and
    CodeGen's do in transformers 5.17 (the GPU machine's); later versions pass them in."""
    params = [inspect.signature(m.forward).parameters for m in model.modules() if type(m).__name__.endswith("Attention")]
    return any("position_ids" in p and "position_embeddings" not in p for p in params)


def test_report_lists_fused_and_skipped(arch):
    ref, fused = pair(arch)
    rep = torchfuser.report(fused)
    counts = rep.counts()
    want = dict(EXPECTED[arch], lm_head_loss=1)
    tuple_layers = [e for e in rep.skipped if e.pattern == "residual_norm" and "returns a tuple" in e.reason]
    if tuple_layers:  # a layer returning a tuple other than (hidden states, attention weights)
        want["residual_norm"] = 0
    for pattern, n in want.items():
        assert counts[pattern]["fused"] == n, (pattern, str(rep))
    skipped = SKIPPED_ATTENTION.get(arch) or ("computes its rotary embedding itself" if rotary_inside(ref) else None)
    if skipped:
        assert counts["attention"] == {"fused": 0, "skipped": 2}
        assert all(skipped in e.reason for e in rep.skipped if e.pattern == "attention")
    else:
        assert counts["attention"] == {"fused": 2, "skipped": 0}
    assert [e for e in rep.skipped if e.pattern != "attention" and e not in tuple_layers] == []
    assert rep.entries[0].name == "" and rep.entries[0].fused == "FusedLMHeadLoss"


def test_state_dict_identical_and_loads_strict_into_unfused(arch):
    ref, fused = pair(arch)
    sd_ref, sd_fused = ref.state_dict(), fused.state_dict()
    assert list(sd_fused) == list(sd_ref)
    for k in sd_ref:
        assert torch.equal(sd_fused[k], sd_ref[k]), k
    plain = make(arch)
    for p in plain.parameters():
        torch.nn.init.zeros_(p)
    plain.load_state_dict(sd_fused, strict=True)
    ids, mask, _ = batch()
    ref.eval(), plain.eval()
    with torch.no_grad():
        assert torch.equal(plain(input_ids=ids, attention_mask=mask).logits, ref(input_ids=ids, attention_mask=mask).logits)


def test_restore_gives_back_original_modules(arch):
    model = make(arch)
    before = dict(model.named_modules())
    params = {n: p for n, p in model.named_parameters()}
    forward = model.forward
    torchfuser.optimize(model, backend="reference")
    assert "forward" in model.__dict__
    torchfuser.restore(model)
    after = dict(model.named_modules())
    assert list(after) == list(before) and all(after[n] is before[n] for n in before)
    assert all(p is params[n] for n, p in model.named_parameters())
    assert "forward" not in model.__dict__ and model.forward == forward
    assert not any(type(m).__name__.startswith("Fused") for m in model.modules())


def test_optimize_is_idempotent(arch):
    _, fused = pair(arch)
    n = len(torchfuser.report(fused).fused)
    lm_forward = fused.__dict__["forward"]
    layer_forwards = [m.__dict__.get("forward") for m in fused.modules()]
    torchfuser.optimize(fused, backend="reference")
    assert fused.__dict__["forward"] is lm_forward
    assert [m.__dict__.get("forward") for m in fused.modules()] == layer_forwards
    # The LM head and the decoder layers' residual adds are fused forwards, not modules.
    layers = torchfuser.report(fused).counts().get("residual_norm", {}).get("fused", 0)
    assert sum(type(m).__name__.startswith("Fused") for m in fused.modules()) == n - 1 - layers


def test_eval_and_no_labels_unchanged(arch):
    ref, fused = pair(arch)
    ids, mask, labels = batch()
    ref.eval(), fused.eval()
    with torch.no_grad():
        out_ref = ref(input_ids=ids, attention_mask=mask, labels=labels)
        out_fused = fused(input_ids=ids, attention_mask=mask, labels=labels)  # eval: HF's own loss path
    torch.testing.assert_close(out_fused.logits, out_ref.logits, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(out_fused.loss, out_ref.loss, rtol=1e-5, atol=1e-6)
    ref.train(), fused.train()
    with torch.no_grad():  # training mode without labels: the original forward, logits as before
        a = ref(input_ids=ids, attention_mask=mask).logits
        b = fused(input_ids=ids, attention_mask=mask).logits
    torch.testing.assert_close(b, a, rtol=1e-5, atol=1e-5)


def test_kv_cache_and_generate_match(arch):
    ref, fused = pair(arch)
    ref.eval(), fused.eval()
    ids, mask, _ = batch()
    with torch.no_grad():
        # prefill then one cached step, against the same sequence in one go
        full_ids = torch.cat([ids, ids[:, :1]], dim=1)
        full_mask = torch.cat([mask, mask[:, :1]], dim=1)
        whole = ref(input_ids=full_ids, attention_mask=full_mask).logits[:, -1]
        pre = fused(input_ids=ids, attention_mask=mask, use_cache=True)
        cache = getattr(pre, "cache", None) or getattr(pre, "past_key_values", None)
        assert cache is not None
        kw = {"cache" if hasattr(pre, "cache") else "past_key_values": cache}
        step = fused(input_ids=ids[:, :1], attention_mask=full_mask, use_cache=True, **kw).logits[:, -1]
        torch.testing.assert_close(step, whole, rtol=1e-4, atol=1e-5)
        gen = dict(attention_mask=mask, max_new_tokens=4, do_sample=False, pad_token_id=0)
        assert torch.equal(fused.generate(ids, **gen), ref.generate(ids, **gen))


def test_num_items_in_batch_gives_hf_loss(arch):
    ref, fused = pair(arch)
    ref.train(), fused.train()
    ids, mask, labels = batch()
    n = torch.tensor(23)  # as the Trainer passes under gradient accumulation
    out_ref = ref(input_ids=ids, attention_mask=mask, labels=labels, num_items_in_batch=n)
    out_fused = fused(input_ids=ids, attention_mask=mask, labels=labels, num_items_in_batch=n)
    torch.testing.assert_close(out_fused.loss, out_ref.loss, rtol=1e-5, atol=1e-6)
    out_ref.loss.backward()
    out_fused.loss.backward()
    assert_grads_match(ref, fused)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="the Triton backend needs a CUDA device here")
def test_triton_backend_on_cuda_matches(arch):
    """Every architecture on the GPU with the default backend (Triton): loss and every gradient in
    fp32 as the unfused model's, padding mask included."""
    ref = make(arch).cuda().train()
    fused = torchfuser.optimize(copy.deepcopy(ref))
    assert {e.backend for e in torchfuser.report(fused).fused} == {"triton"}
    ids, mask, labels = (t.cuda() for t in batch(padded=True))
    a = ref(input_ids=ids, attention_mask=mask, labels=labels)
    b = fused(input_ids=ids, attention_mask=mask, labels=labels)
    torch.testing.assert_close(b.loss, a.loss, rtol=1e-4, atol=1e-5)
    a.loss.backward()
    b.loss.backward()
    for (name, p), q in zip(ref.named_parameters(), fused.parameters()):
        torch.testing.assert_close(q.grad, p.grad, rtol=2e-3, atol=2e-5, msg=name)
