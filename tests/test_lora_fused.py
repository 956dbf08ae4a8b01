"""PEFT LoRA inside the fused blocks (torchfuser/modules/adapters/lora.py): with adapters added before or after
optimize the blocks stay fused and run q/k/v and gate/up, bases and adapters, as one node each; loss
and every adapter gradient are PEFT's unfused model's (fp32: rtol 1e-5; bf16: DESIGN.md's rule)."""
from __future__ import annotations

import copy

import pytest
import torch
from torch import nn
from transformers import LlamaConfig, LlamaForCausalLM, Qwen2Config, Qwen2ForCausalLM

import torchfuser
from torchfuser import demo
from torchfuser.modules import FusedAttention, FusedGatedMLP, fallbacks
from torchfuser.modules.adapters import lora, lora_node
from torchfuser.modules.base import FusedModule
from torchfuser.switches import SWITCHES
from numerics import assert_within_rule

peft = pytest.importorskip("peft")

ALL = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
_CFG = dict(hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
            vocab_size=128)
MODELS = {"llama": (LlamaConfig, LlamaForCausalLM, "sdpa"), "qwen2": (Qwen2Config, Qwen2ForCausalLM, "eager")}


def _base(kind="llama", dtype=torch.float32):
    cfg_cls, model_cls, impl = MODELS[kind]
    torch.manual_seed(0)
    return model_cls(cfg_cls(**_CFG, attn_implementation=impl)).to(dtype)


def _pair(kind="llama", order="before", dtype=torch.float32, **kw):
    """(PEFT's unfused model, the same adapters on a fused one), equal weights."""
    kw = dict(dict(r=8, lora_alpha=16, target_modules=ALL, lora_dropout=0.0, init_lora_weights=False), **kw)
    ref = peft.get_peft_model(_base(kind, dtype), peft.LoraConfig(**kw))
    if order == "before":
        fused = torchfuser.optimize(copy.deepcopy(ref), backend="reference")
    else:
        fused = peft.get_peft_model(torchfuser.optimize(_base(kind, dtype), backend="reference"), peft.LoraConfig(**kw))
        fused.load_state_dict(ref.state_dict())
    return ref, fused


class _Spy:
    """Counts calls of the fused LoRA node."""

    def __init__(self, monkeypatch):
        self.calls = 0
        real = lora._LoRALinear.apply

        def apply(*args):
            self.calls += 1
            return real(*args)
        monkeypatch.setattr(lora._LoRALinear, "apply", apply)


def _ids():
    return torch.randint(0, 128, (2, 12), generator=torch.Generator().manual_seed(1))


def _step(model, seed=3, **kw):
    torch.manual_seed(seed)  # the same dropout masks in both models
    out = model(input_ids=_ids(), labels=_ids(), **kw)
    out.loss.backward()
    return out.loss.detach(), {n: p.grad for n, p in model.named_parameters() if p.grad is not None}


def _same(ref, fused, rtol=1e-5, atol=1e-7, **kw):
    (la, ga), (lb, gb) = _step(ref, **kw), _step(fused, **kw)
    torch.testing.assert_close(lb, la, rtol=rtol, atol=atol)
    trained = ("lora_", "modules_to_save", "hada_")  # the adapters, a trained copy, LoHa's factors
    assert ga and all(any(t in n for t in trained) for n in ga)  # frozen base: no gradient for it
    assert list(gb) == list(ga)
    for n in ga:
        torch.testing.assert_close(gb[n], ga[n], rtol=rtol, atol=atol, msg=n)


@pytest.mark.parametrize("kind", ["llama", "qwen2"])
@pytest.mark.parametrize("order", ["before", "after"])
def test_fused_and_exact(kind, order, monkeypatch):
    ref, fused = _pair(kind, order)
    layer = fused.base_model.model.model.layers[0]
    assert isinstance(layer.self_attn, FusedAttention) and isinstance(layer.mlp, FusedGatedMLP)
    assert list(fused.state_dict()) == list(ref.state_dict())
    spy = _Spy(monkeypatch)
    _same(ref, fused)
    assert spy.calls == 8  # q/k/v, o, gate/up and down of each of the two layers, one node each
    assert not fallbacks.counts(fused)
    assert layer.self_attn.lora_summary == "LoRA r=8" and "with LoRA r=8" in repr(layer.mlp)
    torchfuser.restore(fused if order == "before" else fused.base_model.model)  # what optimize was given
    # the original blocks are back, holding the same LoRA layers
    layer = fused.base_model.model.model.layers[0]
    assert type(layer.self_attn).__name__.endswith("Attention") and not isinstance(layer.self_attn, FusedAttention)
    assert isinstance(layer.mlp.up_proj, peft.tuners.lora.Linear) and list(fused.state_dict()) == list(ref.state_dict())


@pytest.mark.parametrize("kind", ["llama", "qwen2"])
def test_dropout_draws_peft_masks(kind, monkeypatch):
    ref, fused = _pair(kind, lora_dropout=0.25)
    spy = _Spy(monkeypatch)
    _same(ref, fused)
    assert spy.calls == 8
    with pytest.raises(AssertionError):  # the masks matter: another seed gives another loss
        torch.testing.assert_close(_step(fused, seed=4)[0], _step(ref, seed=3)[0])


def test_rslora_scaling_and_partial_targets():
    _same(*_pair(r=4, lora_alpha=32, use_rslora=True, target_modules=["q_proj", "v_proj", "up_proj"]))


def test_several_adapters_one_or_two_active():
    ref, fused = _pair("qwen2")
    second = peft.LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "k_proj", "gate_proj"], init_lora_weights=False)
    for m in (ref, fused):
        torch.manual_seed(5)
        m.add_adapter("second", second)
        m.set_adapter("second")
    fused.load_state_dict(ref.state_dict())
    _same(ref, fused)
    assert fused.base_model.model.model.layers[0].self_attn.lora_summary == "LoRA r=4 (adapters second)"
    for m in (ref, fused):  # both active at once (a LoraModel feature): summed in PEFT's order
        m.zero_grad()
        m.base_model.set_adapter(["default", "second"])
    _same(ref, fused)


def test_disable_adapter_and_merge_and_unload(monkeypatch):
    ref, fused = _pair()
    spy = _Spy(monkeypatch)
    with ref.disable_adapter(), fused.disable_adapter(), torch.no_grad():
        torch.testing.assert_close(fused(input_ids=_ids()).logits, ref(input_ids=_ids()).logits, rtol=1e-5, atol=1e-6)
        assert fused.base_model.model.model.layers[0].self_attn.lora_summary is None
    assert spy.calls == 8
    merged, ref_merged = fused.merge_and_unload(), ref.merge_and_unload()
    assert isinstance(merged.model.layers[0].self_attn, FusedAttention)
    assert type(merged.model.layers[0].self_attn.q_proj) is nn.Linear
    with torch.no_grad():
        torch.testing.assert_close(merged(input_ids=_ids()).logits, ref_merged(input_ids=_ids()).logits,
                                   rtol=1e-5, atol=1e-5)


def test_merged_adapters_run_as_peft_layers_counted():
    ref, fused = _pair()
    for m in (ref, fused):
        m.base_model.merge_adapter()
    with torch.no_grad():
        torch.testing.assert_close(fused(input_ids=_ids()).logits, ref(input_ids=_ids()).logits, rtol=1e-5, atol=1e-5)
    notes = " ".join(fallbacks.notes(fused))
    assert "LoRA projections ran as PEFT's own layers" in notes and "merged" in notes


@pytest.mark.parametrize("order", ["before", "after"])
def test_modules_to_save(order):
    _same(*_pair(order=order, modules_to_save=["lm_head"]))


@pytest.mark.parametrize("targets", [["lm_head"], ["embed_tokens"]])
def test_adapters_on_embeddings_or_lm_head(targets):
    """Those modules are left to PEFT (the report says why); the blocks stay fused and exact."""
    ref, fused = _pair(target_modules=[*targets, "q_proj", "v_proj"])
    assert isinstance(fused.base_model.model.model.layers[0].self_attn, FusedAttention)
    _same(ref, fused)


def test_dora_before_optimize_is_skipped_with_the_reason():
    ref, fused = _pair(use_dora=True)
    rep = torchfuser.report(fused)
    skipped = [e for e in rep.entries if e.pattern in ("attention", "gated_mlp")]
    assert skipped and all(not e.is_fused and "DoRA" in e.reason for e in skipped)
    _same(ref, fused)


def test_dora_after_optimize_runs_as_peft_layers_counted():
    ref, fused = _pair(order="after", use_dora=True)
    _same(ref, fused)
    assert "LoraVariant" in " ".join(fallbacks.notes(fused)) or "Dora" in " ".join(fallbacks.notes(fused))


@pytest.mark.parametrize("reentrant", [True, False])
def test_gradient_checkpointing(reentrant):
    ref, fused = _pair("qwen2", lora_dropout=0.1)
    expected = _step(copy.deepcopy(ref))
    for m in (ref, fused):
        m.train()
        m.base_model.model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": reentrant})
        m.base_model.model.enable_input_require_grads()
    _same(ref, fused)
    fused.zero_grad()
    loss, grads = _step(fused)  # and equal to the model without checkpointing
    torch.testing.assert_close(loss, expected[0], rtol=1e-5, atol=1e-7)
    for n, g in expected[1].items():
        torch.testing.assert_close(grads[n], g, rtol=1e-5, atol=1e-7, msg=n)


def _rule(fused, same, ref64, atol):
    (lf, gf), (ls, gs), (l64, g64) = _step(fused), _step(same), _step(ref64)
    assert_within_rule(lf, ls, l64, atol, "loss")
    assert list(gf) == list(g64)
    for n in g64:
        assert_within_rule(gf[n], gs[n], g64[n], atol, n)


def _rule_bf16(fused, same, ref64, seed=3):
    """DESIGN.md's rule for a bf16 model's loss and every adapter gradient, with an atol of 2⁻⁷ of the
    gradient's largest value (about one bf16 ulp of it): whole-model errors are the bf16 roundings of
    activations and gradients (PEFT's own, around 1 % of the largest value here), which the node's hi/lo
    products (≈ 2⁻¹⁶, held tightly by the node tests below) do not change; a term lost or mis-scaled does."""
    (lf, gf), (ls, gs), (l64, g64) = _step(fused, seed), _step(same, seed), _step(ref64, seed)
    assert_within_rule(lf, ls, l64, 1e-3, "loss")
    assert list(gf) == list(g64)
    for n in g64:
        assert_within_rule(gf[n], gs[n], g64[n], 2 ** -7 * g64[n].abs().max().item(), n)


_BF16_CASES = {
    "llama-dropout": dict(kind="llama", lora_dropout=0.1),
    "qwen2-dropout": dict(kind="qwen2", lora_dropout=0.1),
    "rslora-r64": dict(kind="llama", r=64, lora_alpha=16, use_rslora=True),
    "zero-B": dict(kind="qwen2", init_lora_weights=True),  # PEFT's init: dA = 0, dB ≠ 0
}


@pytest.mark.parametrize("case", list(_BF16_CASES))
def test_bf16_base_without_autocast(case, monkeypatch):
    """Frozen bf16 base, fp32 adapters (PEFT keeps them fp32), no autocast: the node's hi/lo bf16 GEMMs;
    against the same PEFT model in float64 (base, adapters, activations)."""
    kw = dict(_BF16_CASES[case])
    ref, fused = _pair(kw.pop("kind"), dtype=torch.bfloat16, **kw)
    assert ref.base_model.model.model.layers[0].self_attn.q_proj.lora_A.default.weight.dtype == torch.float32
    ref64 = copy.deepcopy(ref).double()
    spy = _Spy(monkeypatch)
    _rule_bf16(fused, ref, ref64)
    assert spy.calls == 8


def test_bf16_base_rule_catches_a_wrong_scaling(monkeypatch):
    """The whole-model check above has teeth: the adapters' scaling applied twice in dB fails it."""
    ref, fused = _pair("llama", dtype=torch.bfloat16)
    ref64 = copy.deepcopy(ref).double()
    real = lora_node._add_split_terms
    def doubled(y2, plan, hs, bb):
        h3, b3 = real(y2, plan, hs, bb)
        return [t * s for t, s in zip(h3, plan.scaling)], b3

    monkeypatch.setattr(lora_node, "_add_split_terms", doubled)
    with pytest.raises(AssertionError, match="lora_B"):
        _rule_bf16(fused, ref, ref64)


@pytest.mark.parametrize("kind", ["llama", "qwen2"])
def test_fp32_under_bf16_autocast(kind, monkeypatch):
    ref, fused = _pair(kind, lora_dropout=0.1)
    ref64 = copy.deepcopy(ref).double()
    spy = _Spy(monkeypatch)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        (lf, gf), (ls, gs) = _step(fused), _step(ref)
    l64, g64 = _step(ref64)
    assert spy.calls == 8
    assert_within_rule(lf, ls, l64, 1e-3, "loss")
    for n in g64:
        assert_within_rule(gf[n], gs[n], g64[n], 1e-3, n)


def _layers(bias, lora_dtype=torch.float64):
    """q (LoRA, two adapters, one with dropout), k (plain), v (LoRA) on one input, float64."""
    torch.manual_seed(0)
    q, k, v = (nn.Linear(6, n, bias=bias, dtype=torch.float64) for n in (8, 4, 4))
    cfg = dict(r=2, lora_alpha=3, target_modules=["q", "v"], init_lora_weights=False)
    holder = nn.Module()
    holder.q, holder.k, holder.v = q, k, v
    model = peft.get_peft_model(holder, peft.LoraConfig(**cfg), autocast_adapter_dtype=False)
    model.add_adapter("drop", peft.LoraConfig(**dict(cfg, lora_dropout=0.3, target_modules=["q"])))
    model.base_model.set_adapter(["default", "drop"])
    for p in model.parameters():
        p.requires_grad_(True)  # also the base weights: every gradient the node can give
    return [model.base_model.model.q, model.base_model.model.k, model.base_model.model.v]


@pytest.mark.parametrize("bias", [False, True])
def test_node_gradcheck(bias):
    linears = _layers(bias)
    x = torch.randn(3, 6, dtype=torch.float64, requires_grad=True)
    params = [p for m in linears for p in m.parameters()]

    def fused(x, *_):
        torch.manual_seed(7)
        return lora.joint(x, linears, None)

    def peft_way(x, *_):
        torch.manual_seed(7)
        return torch.cat([m(x) for m in linears], -1)

    linears[0].train()
    torch.testing.assert_close(fused(x), peft_way(x), rtol=1e-12, atol=1e-12)
    assert torch.autograd.gradcheck(fused, (x, *params))


def test_other_peft_layers_leave_the_block_with_the_reason():
    """A tuner layer other than plain LoRA (LoHa here; LoRA over bitsandbytes bases: tests/test_qlora_fused.py)."""
    cfg = peft.LoHaConfig(r=4, target_modules=["q_proj", "gate_proj"], init_weights=False)
    ref = peft.get_peft_model(_base(), cfg)
    fused = torchfuser.optimize(copy.deepcopy(ref), backend="reference")
    blocks = [e for e in torchfuser.report(fused).entries if e.pattern in ("attention", "gated_mlp")]
    assert blocks and all(not e.is_fused and "another PEFT method" in e.reason for e in blocks)
    _same(ref, fused)


def test_generate_with_kv_cache():
    ref, fused = _pair("qwen2")
    ref.eval(), fused.eval()
    ids = _ids()[:1, :5]
    kw = dict(max_new_tokens=6, do_sample=False, pad_token_id=0)
    assert torch.equal(fused.generate(input_ids=ids, **kw), ref.generate(input_ids=ids, **kw))


def test_lora_on_conv1d_projections_runs_as_peft_layers():
    """GPT-2's Conv1D projections are single ones (c_attn holds q, k and v): called as PEFT's layers."""
    from transformers import GPT2Config, GPT2LMHeadModel
    torch.manual_seed(0)
    base = GPT2LMHeadModel(GPT2Config(n_embd=64, n_layer=2, n_head=4, vocab_size=128, attn_pdrop=0.0, resid_pdrop=0.0,
                                      embd_pdrop=0.0, attn_implementation="eager"))
    cfg = peft.LoraConfig(r=4, target_modules=["c_attn", "c_fc"], fan_in_fan_out=True, init_lora_weights=False)
    ref = peft.get_peft_model(base, cfg)
    fused = torchfuser.optimize(copy.deepcopy(ref), backend="reference")
    counts = torchfuser.report(fused).counts()
    assert counts["attention"]["fused"] == 2 and counts["mlp"]["fused"] == 2
    _same(ref, fused)


def test_mixed_batch_adapter_names_run_as_peft_layers():
    """PEFT passes ``adapter_names`` through forward pre-hooks on its layers: hooked layers run as themselves."""
    ref, fused = _pair()
    for m in (ref, fused):
        torch.manual_seed(5)
        m.add_adapter("second", peft.LoraConfig(r=4, target_modules=ALL, init_lora_weights=False))
        m.eval()
    fused.load_state_dict(ref.state_dict())
    names = ["default", "second"]
    with torch.no_grad():
        torch.testing.assert_close(fused(input_ids=_ids(), adapter_names=names).logits,
                                   ref(input_ids=_ids(), adapter_names=names).logits, rtol=1e-5, atol=1e-6)
    assert "hooks on a LoRA layer" in " ".join(fallbacks.notes(fused))


@pytest.mark.parametrize("order", ["before", "after"])
def test_lora_on_tied_embeddings(order):
    """LoRA on embed_tokens of a tied model: PEFT's embedding layer, the fused head on the tied base weight."""
    def base():
        torch.manual_seed(0)
        return LlamaForCausalLM(LlamaConfig(**_CFG, tie_word_embeddings=True, attn_implementation="sdpa"))
    cfg = dict(r=4, target_modules=["embed_tokens", "q_proj", "k_proj"], init_lora_weights=False)
    ref = peft.get_peft_model(base(), peft.LoraConfig(**cfg))
    if order == "before":
        fused = torchfuser.optimize(copy.deepcopy(ref), backend="reference")
    else:
        fused = peft.get_peft_model(torchfuser.optimize(base(), backend="reference"), peft.LoraConfig(**cfg))
        fused.load_state_dict(ref.state_dict())
    assert torchfuser.report(fused).counts()["lm_head_loss"]["fused"] == 1
    _same(ref, fused)


@pytest.mark.parametrize("order", ["before", "after"])
def test_the_report_says_which_blocks_carry_adapters_and_restore_sees_through_peft(order):
    _, fused = _pair(order=order)
    notes = [n for n in torchfuser.report(fused).notes if n.startswith("adapters: ")]
    assert sorted(notes) == ["adapters: base_model.model.model.layers.*.mlp (2 modules): fused with LoRA r=8",
                             "adapters: base_model.model.model.layers.*.self_attn (2 modules): fused with LoRA r=8"] \
        if order == "before" else sorted(notes) == ["adapters: model.layers.*.mlp (2 modules): fused with LoRA r=8",
                                                    "adapters: model.layers.*.self_attn (2 modules): fused with LoRA r=8"]
    with fused.disable_adapter():
        assert not [n for n in torchfuser.report(fused).notes if n.startswith("adapters: ")]
    torchfuser.restore(fused)  # the PeftModel: restores the model optimize was given inside it
    assert not any(isinstance(m, FusedModule) for m in fused.modules())


def test_bf16_base_keeps_each_projection_input_once_in_bf16():
    """PEFT's adapters keep an fp32 copy of every adapted projection's input for the backward (fp32
    adapters on a bf16 base); the fused node keeps the bf16 input once, the output and down projections'
    included (before they ran as PEFT's layers: 183,680 bytes here, then 102,784; PEFT 364,100). It also
    keeps the adapters' bf16 hi/lo splits for the backward (181,888 here, where the adapters are as wide as
    the activations; ≈ 4 MB a layer of llama8b's 1 GiB)."""
    ref, fused = _pair("llama", dtype=torch.bfloat16)
    saved = {}
    for name, model in (("peft", ref), ("fused", fused)):
        with demo._SavedBytes() as counted:
            model(input_ids=_ids(), labels=_ids()).loss
        saved[name] = counted.total
    assert saved["fused"] < 0.55 * saved["peft"], saved


# The node on its own, bf16 base and fp32 adapters (PEFT's default), no autocast: its hi/lo bf16
# GEMMs (modules/adapters/lora.py's docstring) against PEFT's layers, both against float64. x and dy are exact
# bf16 here, so PEFT's fp32 adapter gradients are fp32-accurate: the node's are held to the split's own
# bound, 2⁻¹⁵ of each gradient's largest value (measured ≈ 2⁻¹⁸), which products of bf16-rounded adapters
# (no lo parts: ≈ 2⁻⁹) fail. y and dx are bf16 and held to the rule proper.
_NODE_CASES = {
    "qkv-r8": dict(tokens=37, d=64, outs=(40, 24, 24), r=8),
    "one-token-r64": dict(tokens=1, d=48, outs=(17,), r=64),
    "odd-outs-scaling": dict(tokens=130, d=96, outs=(23, 9), r=8, lora_alpha=3),
    "rslora-bias": dict(tokens=33, d=64, outs=(40, 24), r=64, lora_alpha=16, use_rslora=True, bias=True),
    "dropout": dict(tokens=37, d=64, outs=(40, 24, 24), r=8, lora_dropout=0.25),
    "zero-B": dict(tokens=37, d=64, outs=(40, 24, 24), r=8, init_lora_weights=True),
    "two-adapters-one-active": dict(tokens=37, d=64, outs=(40, 24, 24), r=8, second=False),
    "two-adapters-both-active": dict(tokens=37, d=64, outs=(40, 24, 24), r=8, lora_dropout=0.25, second=True),
}


def _node(tokens, d, outs, r, bias=False, second=None, **kw):
    """(PEFT model, its projections p0, p1, ... on one input, x, dy): bf16 bases, PEFT's fp32 adapters."""
    torch.manual_seed(0)
    holder = nn.Module()
    names = [f"p{i}" for i in range(len(outs))]
    for n, o in zip(names, outs):
        setattr(holder, n, nn.Linear(d, o, bias=bias, dtype=torch.bfloat16))
    kw = dict(dict(lora_alpha=2 * r, init_lora_weights=False), **kw)
    model = peft.get_peft_model(holder, peft.LoraConfig(r=r, target_modules=names, **kw))
    if second is not None:  # a second adapter (rank 4, dropout, on the first and last projections only)
        model.add_adapter("second", peft.LoraConfig(r=4, lora_alpha=6, lora_dropout=0.1, init_lora_weights=False,
                                                    target_modules=[names[0], names[-1]]))
        model.base_model.set_adapter(["default", "second"] if second else "second")
    gen = torch.Generator().manual_seed(1)
    x = torch.randn(tokens, d, generator=gen).bfloat16()
    dy = torch.randn(tokens, sum(outs), generator=gen).bfloat16()
    return model, x, dy


def _node_run(model, x, dy, fused):
    """(y, dx, {adapter parameter: gradient}) of the projections on x, backward from dy."""
    linears = [m for n, m in model.base_model.model.named_children()]
    model.zero_grad()
    x = x.detach().clone().requires_grad_(True)
    torch.manual_seed(7)  # the same dropout masks every way
    y = lora.joint(x, linears, None) if fused else torch.cat([m(x) for m in linears], -1)
    assert y is not None
    y.backward(dy)
    return y.detach(), x.grad, {n: p.grad for n, p in model.named_parameters() if p.grad is not None}


def _node_check(model, x, dy):
    ref64 = copy.deepcopy(model).double()
    y64, dx64, g64 = _node_run(ref64, x.double(), dy.double(), False)
    ys, dxs, gs = _node_run(model, x, dy, False)
    yf, dxf, gf = _node_run(model, x, dy, True)
    assert yf.dtype == dxf.dtype == torch.bfloat16
    assert_within_rule(yf, ys, y64, 1e-6, "y")
    assert_within_rule(dxf, dxs, dx64, 1e-6, "dx")
    assert list(gf) == list(g64) and all("lora_" in n for n in gf)
    for n in g64:
        assert gf[n].dtype == torch.float32
        assert_within_rule(gf[n], gs[n], g64[n], 2 ** -15 * g64[n].abs().max().item(), n)
    return gf


@pytest.mark.parametrize("case", list(_NODE_CASES))
def test_bf16_node_hilo_products_within_their_bound(case, monkeypatch):
    model, x, dy = _node(**_NODE_CASES[case])
    assert model.base_model.model.p0.lora_A["default"].weight.dtype == torch.float32
    spy = _Spy(monkeypatch)
    grads = _node_check(model, x, dy)
    assert spy.calls == 1  # the fused call; the float64 reference and PEFT's layers run as PEFT's
    if case == "zero-B":
        assert all(g.abs().max() == 0 for n, g in grads.items() if "lora_A" in n)


def test_bf16_node_bound_fails_without_the_lo_parts(monkeypatch):
    """The node check has teeth: bf16-rounded adapter operands alone (lo parts zero) fail it."""
    model, x, dy = _node(**_NODE_CASES["qkv-r8"])
    real = lora_node._hilo
    monkeypatch.setattr(lora_node, "_hilo", lambda t, parts, dim, dtype, backend, scale=1.0: real(
        (t * scale).to(dtype).float(), parts, dim, dtype, backend))
    with pytest.raises(AssertionError, match="lora_"):
        _node_check(model, x, dy)


def test_bf16_node_peft_dtypes_switch(monkeypatch):
    """The switch ``lora_split_bf16`` off: PEFT's fp32 products literally: y bit for bit, the adapters' gradients to
    fp32 rounding; dx within the rule (one bf16 rounding of the projections' sum, not one per projection)."""
    model, x, dy = _node(**_NODE_CASES["two-adapters-both-active"])
    monkeypatch.setattr(SWITCHES, "lora_split_bf16", False)
    (ys, dxs, gs), (yf, dxf, gf) = _node_run(model, x, dy, False), _node_run(model, x, dy, True)
    torch.testing.assert_close(yf, ys, rtol=0, atol=0)
    assert_within_rule(dxf, dxs, _node_run(copy.deepcopy(model).double(), x.double(), dy.double(), False)[1], 1e-6)
    for n in gs:
        torch.testing.assert_close(gf[n], gs[n], rtol=1e-5, atol=1e-6, msg=n)


def test_bf16_node_makes_no_fp32_tensor_of_the_output_size(monkeypatch):
    """Outside its GEMMs (cuBLAS reading bf16 on CUDA; fp32 copies of the operands on the CPU, which has
    no fp32-output bf16 GEMM) the node makes no fp32 tensor of y's (or dy's) size, and every GEMM of the
    adapters reads bf16 operands."""
    from torch.utils._python_dispatch import TorchDispatchMode
    model, x, dy = _node(tokens=64, d=32, outs=(96, 80), r=4)
    linears = [model.base_model.model.p0, model.base_model.model.p1]
    big, gemms, inside = [], [], [False]

    class Record(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            out = func(*args, **(kwargs or {}))
            for t in (out if isinstance(out, (tuple, list)) else [out]):
                if (isinstance(t, torch.Tensor) and not inside[0] and t.dtype == torch.float32
                        and t.numel() >= 64 * 80):
                    big.append((func, tuple(t.shape)))
            return out

    def spy(real):
        def gemm(*args):
            gemms.append(tuple(t.dtype for t in args))
            inside[0] = True
            try:
                return real(*args)
            finally:
                inside[0] = False
        return gemm
    monkeypatch.setattr(lora_node, "_mm_fp32", spy(lora_node._mm_fp32))
    monkeypatch.setattr(lora_node, "_addmm_bf16_", spy(lora_node._addmm_bf16_))
    monkeypatch.setattr(lora, "plain_eager", lambda *_: True)  # the recording mode is no tensor subclass
    xr = x.detach().clone().requires_grad_(True)
    with Record():
        y = lora.joint(xr, linears, None)
        y.backward(dy)
    assert not big, big
    assert len(gemms) == 1 + 2 + 2 * 2 + 2  # fwd: h, y per projection; bwd: dB, dh per projection, dA, dx
    assert all(d == torch.bfloat16 for dtypes in gemms for d in dtypes), gemms
