"""The compiler's causal-mask rewrite: SDPA with a mask computed from constants that is exactly
causal runs with is_causal=True; every other mask is kept. Forward and every gradient against the
same function in float64."""
from __future__ import annotations

from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

import torchfuser
from torchfuser.compiler.causal_mask import is_causal
from test_compiler import check_parity


@pytest.fixture(autouse=True)
def _fresh_dynamo():
    torch._dynamo.reset()
    yield


def _qkv(s=12):
    return [torch.randn(2, 3, s, 8, requires_grad=True) for _ in range(3)]


def causal_bool(q, k, v):
    i = torch.arange(q.shape[-2], device=q.device)
    return F.scaled_dot_product_attention(q, k, v, attn_mask=i[None, :] <= i[:, None])


def causal_additive(q, k, v):
    i = torch.arange(q.shape[-2], device=q.device)
    mask = torch.zeros(q.shape[-2], q.shape[-2], dtype=q.dtype).masked_fill(i[None, :] > i[:, None], float("-inf"))
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask)


def sliding_window(q, k, v):
    i = torch.arange(q.shape[-2], device=q.device)
    return F.scaled_dot_product_attention(q, k, v, attn_mask=(i[None, :] <= i[:, None]) & (i[:, None] - i[None, :] < 4))


def given_mask(q, k, v, mask):
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask)


# The rewrite runs before Inductor (the default graph backend on GPUs), here on the CPU.
OPTIONS = {"backend": "inductor", "kernels": "reference"}


def _compile(fn):
    return torch.compile(fn, backend="torchfuser", options=OPTIONS)


def _lines(kind):
    record = torchfuser.compiler.last_record()
    return [line for line in getattr(record, kind) if line.startswith("causal mask")]


@pytest.mark.parametrize("fn", [causal_bool, causal_additive], ids=["bool", "additive"])
def test_constant_causal_mask_becomes_is_causal(fn):
    check_parity(_compile(fn), fn, _qkv())
    assert _lines("rewrites") == ["causal mask: 1 scaled_dot_product_attention call(s) take is_causal=True instead "
                                  "of a mask computed from constants that is exactly causal"]
    assert "is_causal = True" in torchfuser.compiler.last_record().graphs["dynamo"]


def test_other_masks_are_kept():
    check_parity(_compile(sliding_window), sliding_window, _qkv())
    assert _lines("rewrites") == [] and _lines("skipped") == ["causal mask: 1 attention mask(s) kept: its value is not the causal mask"]
    torch._dynamo.reset()
    q, k, v = _qkv()
    mask = torch.ones(12, 12, dtype=torch.bool).tril()  # causal, but an input: its values may change
    check_parity(_compile(given_mask), given_mask, [q, k, v, mask])
    assert _lines("skipped") == ["causal mask: 1 attention mask(s) kept: it depends on the graph's inputs"]


def test_is_causal_reads_masks_exactly():
    tril = torch.ones(5, 5, dtype=torch.bool).tril()
    assert is_causal(tril[None, None].expand(2, 1, 5, 5), 5, 5)
    assert is_causal(torch.zeros(5, 5).masked_fill(~tril, torch.finfo(torch.float32).min), 5, 5)
    assert not is_causal(tril, 5, 6) and not is_causal(tril.T, 5, 5) and not is_causal(tril.float(), 5, 5)
    window = tril & ~torch.ones(5, 5, dtype=torch.bool).tril(-3)
    assert not is_causal(window, 5, 5)


def _tiny_llama_and_float64_twin():
    from transformers import LlamaConfig, LlamaForCausalLM

    cfg = LlamaConfig(vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                      num_key_value_heads=2, attn_implementation="sdpa")
    torch.manual_seed(0)
    model = LlamaForCausalLM(cfg)
    model64 = LlamaForCausalLM(cfg).double()
    model64.load_state_dict(model.state_dict())
    return model, model64, torch.randint(0, 128, (2, 16))


def _check_loss_and_grads(loss, model, model64, ids):
    loss64 = model64(input_ids=ids, labels=ids, use_cache=False).loss
    loss64.backward()
    torch.testing.assert_close(loss.double(), loss64.double(), atol=1e-5, rtol=1e-5)
    p64 = dict(model64.named_parameters())
    for name, p in model.named_parameters():
        torch.testing.assert_close(p.grad.double(), p64[name].grad, atol=1e-5, rtol=1e-4, msg=name)


def test_tiny_llama_mask_from_transformers_is_rewritten():
    """transformers materialises its causal mask under torch.compile; the rewrite recognises it."""
    model, model64, ids = _tiny_llama_and_float64_twin()
    loss = torch.compile(model, backend="torchfuser", options=OPTIONS)(input_ids=ids, labels=ids, use_cache=False).loss
    loss.backward()
    assert _lines("rewrites") == ["causal mask: 2 scaled_dot_product_attention call(s) take is_causal=True instead "
                                  "of a mask computed from constants that is exactly causal"]
    _check_loss_and_grads(loss, model, model64, ids)
    # With a padding mask the mask depends on an input: kept.
    torch._dynamo.reset()
    mask = torch.ones_like(ids)
    mask[0, :3] = 0
    torch.compile(model, backend="torchfuser", options=OPTIONS)(input_ids=ids, attention_mask=mask, labels=ids)
    assert _lines("rewrites") == [] and _lines("skipped") == ["causal mask: 2 attention mask(s) kept: it depends on the graph's inputs"]


def test_optimized_model_through_the_torchfuser_backend():
    """optimize() and backend="torchfuser" together: fused modules, and the causal rewrite, in one graph."""
    model, model64, ids = _tiny_llama_and_float64_twin()
    torchfuser.optimize(model, backend="reference")
    compiled = torch.compile(model, backend="torchfuser", options=OPTIONS, fullgraph=True)
    loss = compiled(input_ids=ids, labels=ids, use_cache=False).loss
    loss.backward()
    assert len(_lines("rewrites")) == 1
    _check_loss_and_grads(loss, model, model64, ids)


@pytest.fixture
def no_compile_caches():
    """A cache hit skips the pre-grad passes (their effect is in the cached code): compile afresh."""
    from torch._functorch import config as functorch_config
    from torch._inductor import config

    with config.patch(fx_graph_cache=False), functorch_config.patch(enable_autograd_cache=False):
        yield


_REWROTE_TWO = ["causal mask: 2 scaled_dot_product_attention call(s) take is_causal=True instead of a mask "
                "computed from constants that is exactly causal",
                "grouped k/v: 2 scaled_dot_product_attention call(s) take enable_gqa=True instead of keys and values "
                "repeated per query head"]


def test_optimized_model_under_plain_torch_compile(no_compile_caches, monkeypatch):
    """torch.compile(optimize(model)) with Inductor: optimize's pre-grad pass gives the fused attention
    its causal kernels; a padding mask is kept. The report notes the pass once it has run, not before."""
    from torchfuser.compiler import inductor_pass

    monkeypatch.setattr(inductor_pass, "RECENT", [])  # as in a fresh process: nothing compiled yet
    model, model64, ids = _tiny_llama_and_float64_twin()
    torchfuser.optimize(model, backend="reference")
    assert inductor_pass.installed()
    assert not any("Inductor" in n for n in torchfuser.report(model).notes), "the note before any compile"
    loss = torch.compile(model, fullgraph=True)(input_ids=ids, labels=ids, use_cache=False).loss
    loss.backward()
    assert len(inductor_pass.RECENT) == 1 and inductor_pass.RECENT[-1].rewrites == _REWROTE_TWO
    assert sum(n.startswith("torch.compile with Inductor") for n in torchfuser.report(model).notes) == 1
    _check_loss_and_grads(loss, model, model64, ids)
    torch._dynamo.reset()
    mask = torch.ones_like(ids)
    mask[0, :3] = 0
    torch.compile(model, fullgraph=True)(input_ids=ids, attention_mask=mask, labels=ids, use_cache=False)
    assert inductor_pass.RECENT[-1].rewrites == []
    assert inductor_pass.RECENT[-1].skipped == ["causal mask: 2 attention mask(s) kept: it depends on the graph's inputs"]


def test_inductor_pass_leaves_other_attention_and_keeps_the_users_pass(no_compile_caches):
    from torch._inductor import config

    from torchfuser.compiler import inductor_pass

    seen = []

    def users_pass(graph):
        seen.append(graph)

    with config.patch(pre_grad_custom_pass=users_pass):
        inductor_pass.install()
        inductor_pass.install()  # once only
        assert isinstance(config.pre_grad_custom_pass, inductor_pass.CausalMaskPass)
        assert config.pre_grad_custom_pass.previous is users_pass
        before = len(inductor_pass.RECENT)
        check_parity(torch.compile(causal_bool), causal_bool, _qkv())
        assert seen, "the user's pass did not run"
        assert len(inductor_pass.RECENT) == before, "an attention call outside FusedAttention was touched"
        inductor_pass.uninstall()
        assert config.pre_grad_custom_pass is users_pass


def test_inductor_cache_key_follows_the_ops_fake_impls(monkeypatch):
    """Inductor bakes the fake impls' output strides into the code it caches: a change to the ops
    layer must change the pass's uuid, or a stale cached graph fails its stride checks."""
    from torchfuser.compiler import inductor_pass

    rope = Path(torchfuser.ops.__file__).parent / "rope.py"
    assert rope in inductor_pass._sources()
    before = inductor_pass.CausalMaskPass().uuid()
    real = Path.read_bytes
    monkeypatch.setattr(Path, "read_bytes", lambda p: real(p) + (b"# changed" if p == rope else b""))
    assert inductor_pass.CausalMaskPass().uuid() != before
