"""Mixture-of-experts blocks: transformers 5's stacked experts fused (router top-k, grouped expert GEMMs,
shared expert), exact against the model's own code forward and backward, the router's auxiliary loss
included; per-expert modules and unknown layouts listed as skipped with the reason; look-alikes not listed."""
from __future__ import annotations

import copy

import pytest
import torch
from torch import nn
from transformers import AutoConfig, AutoModelForCausalLM

import torchfuser
from torchfuser import functional as F
from torchfuser.modules import FusedGatedMLP
from torchfuser.modules.base import FusedModule
from torchfuser.modules.moe import FusedMoE
from torchfuser.patterns.moe import MoEPattern

from arch_sweep import tiny_config
from numerics import ATOL, assert_within_rule

_DEEPSEEK = dict(hidden_size=64, intermediate_size=128, moe_intermediate_size=32, num_hidden_layers=2,
                 num_attention_heads=4, num_key_value_heads=4, vocab_size=128, n_routed_experts=4, num_experts_per_tok=2,
                 n_group=1, topk_group=1, first_k_dense_replace=0, kv_lora_rank=16, q_lora_rank=16, qk_rope_head_dim=8,
                 qk_nope_head_dim=8, v_head_dim=16)
# (model type, config overrides): what each exercises is in the comment.
CASES = {
    "mixtral": ("mixtral", {}),  # softmax, renormalised; router jitter attribute
    "qwen3_moe": ("qwen3_moe", {"norm_topk_prob": True}),
    "olmoe": ("olmoe", {}),  # softmax, not renormalised
    "qwen2_moe": ("qwen2_moe", {}),  # shared expert with a sigmoid gate
    "deepseek_v3": ("deepseek_v3", _DEEPSEEK),  # sigmoid, score correction, scaling, fp32 router, shared expert
    "deepseek_v3_groups": ("deepseek_v3", {**_DEEPSEEK, "n_routed_experts": 8, "n_group": 4, "topk_group": 2}),
    "gpt_oss": ("gpt_oss", {}),  # router bias, softmax of the top-k logits, clamped SwiGLU, biases, transposed
    "granitemoe": ("granitemoe", {}),  # softmax of the top-k logits; its block reshapes by input_size
    "ernie4_5_moe": ("ernie4_5_moe", {"moe_layer_start_index": 0}),  # correction in a child of the router
    "minimax_m2": ("minimax_m2", {}),  # the block's own correction, passed to its router
}


def _config(case: str, **more):
    model_type, overrides = CASES[case]
    cfg = AutoConfig.for_model(model_type, **overrides) if model_type == "deepseek_v3" else tiny_config(model_type)
    for k, v in {**(overrides if model_type != "deepseek_v3" else {}), **more}.items():
        setattr(cfg, k, v)
    cfg.router_aux_loss_coef = 0.3
    return cfg


def _model(case: str, **more):
    torch.manual_seed(0)
    return AutoModelForCausalLM.from_config(_config(case, **more)).float().train()


def _moe_blocks(model):
    return [n for n, m in model.named_modules() if MoEPattern().match(m) is not None]


def _ids():
    return torch.randint(3, 128, (2, 12), generator=torch.Generator().manual_seed(1))


def _step(model, ids):
    out = model(input_ids=ids, labels=ids, output_router_logits=True, use_cache=False)
    out.loss.backward()
    return out.loss.detach(), (out.aux_loss.detach() if getattr(out, "aux_loss", None) is not None else None)


def _close(a, b, what):
    torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5 * (b.abs().max().item() + 1e-12), msg=what)


@pytest.mark.parametrize("case", list(CASES))
def test_every_moe_layer_fused_and_exact_with_aux_loss(case):
    ref = _model(case)
    fused = copy.deepcopy(ref)
    keys, params = list(fused.state_dict()), [id(p) for p in fused.parameters()]
    blocks = _moe_blocks(ref)
    torchfuser.optimize(fused, backend="reference")
    rep = torchfuser.report(fused)
    moe = {e.name: e for e in rep.entries if e.pattern == "moe"}
    assert blocks and sorted(moe) == sorted(blocks) and all(e.is_fused for e in moe.values()), moe
    assert all("experts, top-" in e.backend for e in moe.values())
    assert list(fused.state_dict()) == keys and [id(p) for p in fused.parameters()] == params
    try:
        loss_ref, aux_ref = _step(ref, _ids())
    except AttributeError as e:  # transformers 5.17's GraniteMoE records no router logits: its aux_loss is 0, an int
        pytest.skip(f"the unfused {case} model fails with output_router_logits=True in this transformers: {e}")
    loss, aux = _step(fused, _ids())
    _close(loss, loss_ref, "loss")
    if aux_ref is not None:  # DeepSeek-V3 computes no auxiliary loss
        assert aux is not None and aux_ref > 0
        _close(aux, aux_ref, "router aux loss")
    for (name, a), (_, b) in zip(ref.named_parameters(), fused.named_parameters()):
        assert (a.grad is None) == (b.grad is None), name
        if a.grad is not None:
            _close(b.grad, a.grad, name)
    assert not any(n in torchfuser.report(fused).fallbacks for n in moe)  # the fused path ran
    torchfuser.restore(fused)
    assert not any(isinstance(m, FusedModule) for m in fused.modules())
    assert [id(p) for p in fused.parameters()] == params and list(fused.state_dict()) == keys


def test_fused_block_answers_the_originals_attribute_reads():
    model = torchfuser.optimize(_model("mixtral"), backend="reference")
    block = model.model.layers[0].mlp
    assert isinstance(block, FusedMoE)
    assert block.top_k == 2 and block.jitter_noise == 0 and block.experts.num_experts == 4
    assert block.gate.weight.shape == (4, 64) and block.experts.gate_up_proj.shape == (4, 256, 64)


def _block(case: str, **more):
    """The first MoE block of a tiny model of ``case``, and the model (for its config)."""
    model = _model(case, **more)
    return model.get_submodule(_moe_blocks(model)[0]), model


def _fused_block(block):
    return torchfuser.optimize(nn.Sequential(copy.deepcopy(block)), backend="reference")[0]


def _fwd_bwd(block, x, dy):
    x = x.detach().clone().requires_grad_()
    out = block(x)
    y = out[0] if isinstance(out, tuple) else out
    y.backward(dy)
    return y.detach(), x.grad, {n.removeprefix("_orig_mod."): p.grad for n, p in block.named_parameters()}


def _same_fwd_bwd(fused, block, x, dy):
    """Output, input gradient and every parameter's gradient of ``fused`` equal ``block``'s."""
    (y, dx, grads), (y_ref, dx_ref, grads_ref) = _fwd_bwd(fused, x, dy), _fwd_bwd(block, x, dy)
    _close(y, y_ref, "output")
    _close(dx, dx_ref, "dx")
    for n, g in grads_ref.items():
        _close(grads[n], g, n)
    return grads


def _positive_input(h=64, n=24):
    return torch.rand(2, n // 2, h, generator=torch.Generator().manual_seed(2)) + 0.1


@pytest.mark.parametrize("edge", ["expert_without_tokens", "all_tokens_to_one_expert", "top_k_all_experts"])
def test_routing_edge_cases_exact(edge):
    block, _ = _block("mixtral", num_experts_per_tok={"all_tokens_to_one_expert": 1, "top_k_all_experts": 4}.get(edge, 2))
    with torch.no_grad():  # positive inputs: a row of negative router weights is never chosen, a positive one always
        if edge == "expert_without_tokens":
            block.gate.weight[0] = -block.gate.weight[0].abs() - 1
        elif edge == "all_tokens_to_one_expert":
            block.gate.weight[2] = block.gate.weight[2].abs() + 1
    fused = _fused_block(block)
    x = _positive_input()
    logits = nn.functional.linear(x.reshape(-1, 64), block.gate.weight)
    _, chosen = F.moe_route(logits, block.gate.top_k, renorm=True)
    counts = torch.bincount(chosen.reshape(-1), minlength=4)
    assert {"expert_without_tokens": counts[0] == 0, "all_tokens_to_one_expert": counts[2] == 24,
            "top_k_all_experts": (counts == 24).all()}[edge]
    dy = torch.randn(2, 12, 64, generator=torch.Generator().manual_seed(3))
    grads = _same_fwd_bwd(fused, block, x, dy)
    if edge == "expert_without_tokens":
        assert (grads["experts.gate_up_proj"][0] == 0).all() and (grads["experts.down_proj"][0] == 0).all()


@pytest.mark.parametrize("case", ["mixtral", "qwen3_moe", "gpt_oss", "deepseek_v3"])
def test_bf16_within_the_numerics_rule(case):
    block, model = _block(case)
    ref_model = copy.deepcopy(model).double()
    ref_model.set_experts_implementation("eager")  # transformers' grouped-GEMM experts take no fp64
    ref64 = ref_model.get_submodule(_moe_blocks(model)[0])
    torch_bf16, fused = copy.deepcopy(block).bfloat16(), _fused_block(block).bfloat16()
    x = torch.randn(2, 12, 64, generator=torch.Generator().manual_seed(4), dtype=torch.float64)
    dy = torch.randn(2, 12, 64, generator=torch.Generator().manual_seed(5), dtype=torch.float64)
    y64, dx64, g64 = _fwd_bwd(ref64, x, dy)
    yt, dxt, gt = _fwd_bwd(torch_bf16, x.bfloat16(), dy.bfloat16())
    yf, dxf, gf = _fwd_bwd(fused, x.bfloat16(), dy.bfloat16())
    atol = ATOL[torch.bfloat16]
    assert_within_rule(yf, yt, y64, atol, "output")
    assert_within_rule(dxf, dxt, dx64, atol, "dx")
    for n, g in g64.items():
        assert_within_rule(gf[n], gt[n], g, atol * (g.abs().max().item() + 1), n)


def test_under_autocast_no_weight_copy_nor_gathered_input_is_saved():
    block, _ = _block("qwen3_moe", moe_intermediate_size=24)  # 2I ≠ H: the saved h is not the input's shape
    fused = _fused_block(block)
    x = torch.randn(2, 12, 64, generator=torch.Generator().manual_seed(11), requires_grad=True)
    saved = []
    with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(t) or t, lambda t: t):
        with torch.autocast("cpu", torch.bfloat16):
            y = fused(x)
    slots = x.shape[0] * x.shape[1] * block.gate.top_k
    experts = fused.experts
    assert not [t for t in saved if t.dtype == torch.bfloat16 and t.dim() == 3]  # no bf16 copy of the expert weights
    assert not [t for t in saved if t.shape == (slots, 64)]  # no gathered (per-slot) copy of the input
    assert any(t is experts.gate_up_proj for t in saved) and any(t.shape == (slots, 48) for t in saved)  # h
    assert y.dtype == x.dtype
    y.backward(torch.ones_like(y))
    assert experts.gate_up_proj.grad.dtype == torch.float32
    got = {n: p.grad for n, p in fused.named_parameters()}
    for n, g in _fwd_bwd(block, x, torch.ones_like(y))[2].items():  # bf16 products against fp32 ones
        torch.testing.assert_close(got[n], g, rtol=0, atol=5e-2 * g.abs().max().item())


def test_fused_block_under_torch_compile_fullgraph():
    block, _ = _block("gpt_oss")  # the most of the spec: biases, interleaved halves, clamp, a tuple returned
    fused = _fused_block(block)
    compiled = torch.compile(fused, fullgraph=True, backend="aot_eager")
    x = torch.randn(2, 12, 64, generator=torch.Generator().manual_seed(6))
    dy = torch.randn(2, 12, 64, generator=torch.Generator().manual_seed(7))
    _same_fwd_bwd(compiled, block, x, dy)


def test_gpt_oss_clamp_engaged_exact():
    block, _ = _block("gpt_oss")
    with torch.no_grad():
        block.experts.gate_up_proj.mul_(400)  # pre-activations well past the SwiGLU limit (7)
    fused = _fused_block(block)
    x = torch.randn(2, 12, 64, generator=torch.Generator().manual_seed(8))
    h = x.reshape(-1, 64) @ block.experts.gate_up_proj[0]
    assert (h.abs() > block.experts.limit).float().mean() > 0.2
    dy = torch.randn(2, 12, 64, generator=torch.Generator().manual_seed(9))
    _same_fwd_bwd(fused, block, x, dy)


def test_calls_the_fused_path_cannot_take_run_the_original_and_are_counted():
    block, _ = _block("mixtral")
    model = torchfuser.optimize(nn.Sequential(copy.deepcopy(block)), backend="reference")
    fused = model[0]
    x = torch.randn(2, 12, 64)
    handle = fused.experts.register_forward_hook(lambda m, a, out: None)
    torch.testing.assert_close(fused(x), block(x))
    handle.remove()
    fused.jitter_noise = 0.1  # Mixtral's router jitter: training only, and not in the fused path
    fused.train()
    fused(x.clone())
    counted = fused.__dict__["_torchfuser_fallbacks"]
    assert any("hooks" in why for why in counted) and any("jitter" in why for why in counted), counted
    notes = " ".join(torchfuser.report(model).notes)
    assert "left the fused path" in notes


def _naive(x, w, idx, gu, gub, dn, dnb, transposed, halves, act, alpha, limit):
    """The experts' formula token by token, expert by expert (the oracle, in x's dtype)."""
    from torchfuser.backends.reference.moe import activation
    y = torch.zeros_like(x)
    for t in range(x.shape[0]):
        for j in range(idx.shape[1]):
            e = idx[t, j]
            h = x[t] @ (gu[e] if transposed else gu[e].t()) + (0 if gub is None else gub[e])
            o = activation(h[None], halves, act, alpha, limit)[0] @ (dn[e] if transposed else dn[e].t())
            y[t] = y[t] + w[t, j].to(x.dtype) * (o + (0 if dnb is None else dnb[e]))
    return y


@pytest.mark.parametrize("dtype, h, transposed, bias", [
    (torch.float32, 16, False, False), (torch.bfloat16, 16, True, True), (torch.float16, 16, False, True),
    (torch.float32, 13, True, False),  # widths no grouped GEMM takes: the loop over experts
])
def test_moe_experts_op_against_float64(dtype, h, transposed, bias):
    gen = torch.Generator().manual_seed(10)
    t, i, e, k = 9, 8, 5, 2
    idx = torch.stack([torch.randperm(e - 1, generator=gen)[:k] + 1 for _ in range(t)])  # expert 0 gets none
    w = torch.rand(t, k, generator=gen, dtype=torch.float64)
    x = torch.randn(t, 2 * h, generator=gen, dtype=torch.float64)[:, ::2]  # not contiguous
    gu = torch.randn(*((e, h, 2 * i) if transposed else (e, 2 * i, h)), generator=gen, dtype=torch.float64) / h ** 0.5
    dn = torch.randn(*((e, i, h) if transposed else (e, h, i)), generator=gen, dtype=torch.float64) / i ** 0.5
    gub = torch.randn(e, 2 * i, generator=gen, dtype=torch.float64) if bias else None
    dnb = torch.randn(e, h, generator=gen, dtype=torch.float64) if bias else None
    args = (transposed, "interleaved" if bias else "gate_up", "clamped_swiglu" if bias else "silu", 1.702, 1.0)
    dy = torch.randn(t, h, generator=gen, dtype=torch.float64)
    leaves = [x, w, gu, gub, dn, dnb]

    def run(fn, dt):
        ins = [None if a is None else a.detach().to(dt if a is not w else torch.float32 if dt != torch.float64 else dt)
               .requires_grad_() for a in leaves]
        y = fn(*ins)
        y.backward(dy.to(y.dtype))
        return [y.detach()] + [a.grad for a in ins if a is not None]

    fused = run(lambda x, w, gu, gub, dn, dnb: F.moe_experts(x, w, idx, gu, dn, gate_up_bias=gub, down_bias=dnb,
                                                             transposed=transposed, halves=args[1], activation=args[2],
                                                             alpha=1.702, limit=1.0, backend="reference"), dtype)
    ref64 = run(lambda *a: _naive(a[0], a[1], idx, *a[2:], *args), torch.float64)
    same = run(lambda *a: _naive(a[0], a[1], idx, *a[2:], *args), dtype)
    for name, f, s, r in zip(["y", "dx", "dw", "dgate_up", "dgate_up_bias", "ddown", "ddown_bias"], fused, same, ref64):
        assert_within_rule(f, s, r, ATOL[dtype] * (r.abs().max().item() + 1), name)


@pytest.mark.parametrize("order", ["optimize_first", "peft_first"])
def test_peft_adapters_on_the_experts_run_as_the_models_own_code(order):
    peft = pytest.importorskip("peft")
    config = peft.LoraConfig(r=4, target_modules=[], init_lora_weights=False,
                             target_parameters=["mlp.experts.gate_up_proj", "mlp.experts.down_proj"])
    base = _model("qwen3_moe")
    torch.manual_seed(1)
    ref = peft.get_peft_model(copy.deepcopy(base), copy.deepcopy(config))
    if order == "optimize_first":
        model = peft.get_peft_model(torchfuser.optimize(copy.deepcopy(base), backend="reference"), copy.deepcopy(config))
    else:
        model = torchfuser.optimize(peft.get_peft_model(copy.deepcopy(base), copy.deepcopy(config)), backend="reference")
    model.load_state_dict(ref.state_dict())
    ids = _ids()
    _close(model(input_ids=ids, labels=ids).loss, ref(input_ids=ids, labels=ids).loss, "loss")
    rep = torchfuser.report(model)
    moe = [e for e in rep.entries if e.pattern == "moe"]
    if order == "optimize_first":  # fused, and every call handed to the original forward (counted)
        assert all(e.is_fused for e in moe) and all("replaced after fusing" in next(iter(rep.fallbacks[e.name]))
                                                    for e in moe)
    else:
        assert moe and all(not e.is_fused and "PEFT adapters on its experts' weights" in e.reason for e in moe)


def test_meta_device_shapes_propagate():
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(_config("qwen2_moe"))
    torchfuser.optimize(model)
    ids = _ids().to("meta")
    out = model(input_ids=ids, labels=ids)  # no aux loss: this test is about the fused blocks' shapes
    out.loss.backward()
    assert out.loss.device.type == "meta" and model.model.layers[0].mlp.experts.gate_up_proj.grad is not None


def test_report_names_the_backend_that_runs():
    from torchfuser.walker import _fused_label
    fused = _fused_block(_block("olmoe")[0])
    assert _fused_label(fused, "mlir").startswith("reference (no FusedMoE kernels in mlir yet): 4 experts, top-2")
    assert _fused_label(fused, "triton").startswith("triton: 4 experts, top-2")


@pytest.mark.parametrize("model_type, block", [("jetmoe", "JetMoeMoE")])
def test_unknown_stacked_layouts_are_listed_as_skipped(model_type, block):
    torch.manual_seed(0)
    ref = AutoModelForCausalLM.from_config(tiny_config(model_type)).float()
    model = torchfuser.optimize(copy.deepcopy(ref), backend="reference")
    moe = [e for e in torchfuser.report(model).entries if e.pattern == "moe" and e.original == block]
    assert moe and not any(e.is_fused for e in moe)
    assert all(e.reason.startswith("mixture-of-experts block (4 experts") and "model's own code" in e.reason for e in moe)
    ids = _ids()
    torch.testing.assert_close(model(input_ids=ids).logits, ref(input_ids=ids).logits, rtol=1e-5, atol=1e-5)


class Expert(nn.Module):
    def __init__(self, h=16, i=24):
        super().__init__()
        self.w1, self.w3, self.w2 = nn.Linear(h, i, bias=False), nn.Linear(h, i, bias=False), nn.Linear(i, h, bias=False)
        self.act_fn = nn.SiLU()

    def forward(self, x):
        return self.w2(self.act_fn(self.w1(x)) * self.w3(x))


class PerExpertMoE(nn.Module):
    """Mixtral's block before transformers 5: a Linear router and a ModuleList of expert MLPs."""

    def __init__(self, h=16, n=4):
        super().__init__()
        self.gate = nn.Linear(h, n, bias=False)
        self.experts = nn.ModuleList([Expert(h) for _ in range(n)])

    def forward(self, x):
        weights, chosen = self.gate(x).softmax(-1).topk(2, dim=-1)
        out = torch.zeros_like(x)
        for k in range(2):
            for e, expert in enumerate(self.experts):
                rows = chosen[..., k] == e
                out[rows] += weights[..., k][rows, None] * expert(x[rows])
        return out


def test_per_expert_mlps_are_fused_one_by_one_and_exact():
    torch.manual_seed(0)
    ref = nn.Sequential(PerExpertMoE()).double()
    model = torchfuser.optimize(copy.deepcopy(ref), backend="reference")
    rep = torchfuser.report(model)
    assert [e.pattern for e in rep.skipped] == ["moe"] and "4 modules in 'experts'" in rep.skipped[0].reason
    assert all(isinstance(m, FusedGatedMLP) for m in model[0].experts) and len(rep.fused) == 4
    x = torch.randn(3, 5, 16, dtype=torch.float64)
    torch.testing.assert_close(model(x), ref(x))


class TwoLayers(nn.Module):  # a stack of two blocks and a projection: not a MoE block
    def __init__(self):
        super().__init__()
        self.proj = nn.Linear(16, 2)
        self.layers = nn.ModuleList([nn.Sequential(PerExpertMoE()), nn.Sequential(PerExpertMoE())])


class Convs(nn.Module):  # Mamba's mixer: a conv's 3-D weight is not a stack of experts
    def __init__(self):
        super().__init__()
        self.conv1d = nn.Conv1d(8, 8, 4, groups=8)
        self.dt_proj = nn.Linear(16, 8)


@pytest.mark.parametrize("cls", [TwoLayers, Convs, Expert])
def test_look_alikes_are_not_candidates(cls):
    assert MoEPattern().match(cls()) is None
