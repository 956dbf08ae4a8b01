"""The MoE kernels of the Triton backend (backends/triton/moe.py), run by Triton's interpreter on the CPU.

Router and experts, forward and every gradient, through ``torchfuser.functional`` with backend='triton'
against the reference backend in float64 (the oracle) and in the same dtype (the baseline), with the
numerics rule max|triton − ref64| ≤ 2·max|reference − ref64| + atol; the chosen experts equal the
reference's exactly (logits without ties). Every scoring with and without renorm, correction and scale;
every activation × halves, with and without biases, both weight layouts; an expert without tokens, all
tokens to one expert, top_k = E, one token, odd sizes (H 72, I 40, E 6), 512 experts. What the kernels
hand to the reference (expert groups, fp64) gives the reference's results. Last, a tiny Qwen3-MoE
optimised with backend='triton' trains as the unfused model does.
"""
from __future__ import annotations

import copy
import math

import pytest
import torch

import torchfuser
import torchfuser.functional as F
from numerics import ATOL, assert_within_rule
from test_triton_ops import DEVICE, interpreter  # noqa: F401  (module fixture: the interpreted backend)

pytest.importorskip("triton")

DTYPES = [torch.float32, torch.bfloat16, torch.float16]
ALPHA, LIMIT = 1.702, 1.0  # a limit the pre-activations cross often: both sides of each clamp are tested


def _gen(seed):
    return torch.Generator().manual_seed(seed)


def _logits(t, e, seed=0):
    """Per token a permutation of E values j·step within about ±4, exact in bf16 and fp16 and far enough
    apart that their sigmoids and softmaxes differ in fp32 too: no ties in any dtype."""
    g = _gen(seed)
    step = min(0.5, 2.0 ** -math.ceil(math.log2(e / 8)))
    return torch.stack([(torch.randperm(e, generator=g) - e // 2).double() * step for _ in range(t)])


def _within(got, same, ref, what):
    assert got.dtype == same.dtype, f"{what}: dtype {got.dtype} != {same.dtype}"
    assert got.is_contiguous(), f"{what}: not contiguous"
    atol = ATOL.get(same.dtype, 1e-5) * max(1.0, ref.abs().max().item())
    assert_within_rule(got.cpu(), same.cpu(), ref.cpu(), atol, what)


# ---------------------------------------------------------------- router

def _route(logits, dtype, backend, k, dw, **kw):
    l = logits.to(DEVICE, dtype).requires_grad_()
    corr = kw.pop("correction", None)
    corr = None if corr is None else corr.to(DEVICE, torch.float64 if dtype == torch.float64 else torch.float32)
    w, idx = F.moe_route(l, k, correction=corr, backend=backend, **kw)
    (dl,) = torch.autograd.grad(w, l, dw.to(DEVICE, w.dtype))
    return w, idx, dl


def _check_route(logits, k, dtype, what, **kw):
    dw = torch.randn(logits.shape[0], k, generator=_gen(7), dtype=torch.float64)
    ref = _route(logits, torch.float64, "reference", k, dw, **kw)
    same = _route(logits, dtype, "reference", k, dw, **kw)
    got = _route(logits, dtype, "triton", k, dw, **kw)
    assert torch.equal(got[1].cpu(), same[1].cpu()) and got[1].dtype == torch.int64, f"{what}: indices differ"
    assert torch.equal(got[1].cpu(), ref[1].cpu()), f"{what}: indices differ from the float64 reference's"
    for name, g, s, r in zip(("weights", "dlogits"), got[::2], same[::2], ref[::2]):
        _within(g, s, r, f"{what} {name}")


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("corr", [False, True], ids=["", "correction+scale"])
@pytest.mark.parametrize("renorm", [False, True], ids=["", "renorm"])
@pytest.mark.parametrize("scoring", ["softmax", "sigmoid", "softmax_topk"])
def test_route(scoring, renorm, corr, dtype):
    e = 6
    correction = torch.randn(e, generator=_gen(3), dtype=torch.float64) * 0.3 if corr else None
    _check_route(_logits(9, e), 2, dtype, f"{scoring} renorm={renorm} corr={corr}", scoring=scoring, renorm=renorm,
                 correction=correction, scale=2.5 if corr else 1.0)


@pytest.mark.parametrize("scoring", ["softmax", "sigmoid", "softmax_topk"])
@pytest.mark.parametrize("t, e, k", [(1, 6, 2), (5, 6, 6), (3, 512, 8), (70, 40, 3)],
                         ids=["one_token", "top_k=E", "E=512", "rows_past_a_program"])
def test_route_shapes(scoring, t, e, k):
    _check_route(_logits(t, e, seed=t), k, torch.float32, f"{scoring} T={t} E={e} k={k}", scoring=scoring, renorm=True)


def test_route_bf16_512_experts_with_correction():
    corr = torch.randn(512, generator=_gen(4), dtype=torch.float64) * 0.01
    _check_route(_logits(4, 512, seed=5), 8, torch.bfloat16, "sigmoid E=512", scoring="sigmoid", renorm=True,
                 correction=corr, scale=2.5)


def test_route_groups_choose_as_the_reference(interpreter):
    """n_group > 1: the choice is the reference's (delegated); the weights' backward is the kernel's."""
    logits, corr = _logits(7, 8, seed=2), torch.randn(8, generator=_gen(6), dtype=torch.float64) * 0.1
    kw = dict(scoring="sigmoid", renorm=True, correction=corr, n_group=4, topk_group=2, group_top=2, scale=2.5)
    _check_route(logits, 3, torch.float32, "groups", **kw)
    _check_route(logits, 3, torch.bfloat16, "groups bf16", **kw)


def test_route_fp64_is_the_reference():
    dw = torch.randn(9, 2, generator=_gen(8), dtype=torch.float64)
    for scoring in ("softmax", "softmax_topk"):
        got = _route(_logits(9, 6), torch.float64, "triton", 2, dw, scoring=scoring, renorm=True)
        want = _route(_logits(9, 6), torch.float64, "reference", 2, dw, scoring=scoring, renorm=True)
        assert all(torch.equal(a.cpu(), b.cpu()) for a, b in zip(got, want))


@pytest.mark.parametrize("scoring", ["softmax", "sigmoid", "softmax_topk"])
def test_route_nan_logits_give_nan_weights_as_the_model_does(scoring):
    """A NaN logit: torch.topk ranks it first, so the reference's (and the model's) weights of that token
    are NaN. The kernel's max would pass over it; its weights must come out NaN too, never finite from a
    NaN input. The other tokens are routed as the reference routes them."""
    logits = _logits(5, 6)
    logits[2, 4] = float("nan")
    l = logits.to(DEVICE, torch.float32)
    w, idx = F.moe_route(l, 2, scoring=scoring, renorm=True, backend="triton")
    wr, ir = F.moe_route(l, 2, scoring=scoring, renorm=True, backend="reference")
    assert w[2].isnan().all() and wr[2].isnan().any()
    keep = [0, 1, 3, 4]
    assert torch.equal(idx[keep].cpu(), ir[keep].cpu())
    torch.testing.assert_close(w[keep].cpu(), wr[keep].cpu(), rtol=1e-6, atol=1e-7)


def test_route_non_contiguous_logits_and_expanded_gradient():
    base = _logits(6, 12, seed=9)
    wide = torch.cat([base, base[:, :5] * 0 + 9.0], dim=1).float().to(DEVICE)
    for backend in ("triton", "reference"):
        l = wide.detach().clone().requires_grad_()
        w, idx = F.moe_route(l[:, :12], 3, scoring="softmax", renorm=True, backend=backend)
        w.sum().backward()  # dw expanded: stride 0
        if backend == "triton":
            got = (w, idx, l.grad)
        else:
            want = (w, idx, l.grad)
    assert torch.equal(got[1], want[1])
    torch.testing.assert_close(got[0], want[0], rtol=1e-6, atol=1e-7)
    torch.testing.assert_close(got[2], want[2], rtol=1e-5, atol=1e-6)


# ---------------------------------------------------------------- experts

def _experts_inputs(t, h, i, e, k, transposed, bias, seed=10, idx=None):
    g = _gen(seed)
    if idx is None:  # expert 0 gets no token
        idx = torch.stack([torch.randperm(e - 1, generator=g)[:k] + 1 for _ in range(t)])
    w = torch.rand(t, k, generator=g, dtype=torch.float64) + 0.1
    x = torch.randn(t, h, generator=g, dtype=torch.float64)
    gu = torch.randn(*((e, h, 2 * i) if transposed else (e, 2 * i, h)), generator=g, dtype=torch.float64) / h ** 0.5
    dn = torch.randn(*((e, i, h) if transposed else (e, h, i)), generator=g, dtype=torch.float64) / i ** 0.5
    gub = torch.randn(e, 2 * i, generator=g, dtype=torch.float64) * 0.5 if bias else None
    dnb = torch.randn(e, h, generator=g, dtype=torch.float64) if bias else None
    dy = torch.randn(t, h, generator=g, dtype=torch.float64)
    return idx, (x, w, gu, gub, dn, dnb), dy


def _experts(leaves, idx, dy, dtype, backend, out_dtype=None, **kw):
    wdt = torch.float64 if dtype == torch.float64 else torch.float32  # the router's weights: fp32
    ins = [None if a is None else a.detach().to(DEVICE, wdt if n == 1 else dtype).requires_grad_()
           for n, a in enumerate(leaves)]
    x, w, gu, gub, dn, dnb = ins
    y = F.moe_experts(x, w, idx.to(DEVICE), gu, dn, gate_up_bias=gub, down_bias=dnb, alpha=ALPHA, limit=LIMIT,
                      out_dtype=out_dtype if dtype != torch.float64 else None, backend=backend, **kw)
    present = [a for a in ins if a is not None]
    return [y] + list(torch.autograd.grad(y, present, dy.to(DEVICE, y.dtype)))


_NAMES = ["y", "dx", "dweights", "dgate_up", "dgate_up_bias", "ddown", "ddown_bias"]


def _check_experts(idx, leaves, dy, dtype, what, out_dtype=None, **kw):
    names = [n for n, a in zip(_NAMES, [dy, *leaves]) if a is not None]
    ref = _experts(leaves, idx, dy, torch.float64, "reference", **kw)
    same = _experts(leaves, idx, dy, dtype, "reference", out_dtype, **kw)
    got = _experts(leaves, idx, dy, dtype, "triton", out_dtype, **kw)
    assert len(got) == len(names)
    for name, g, s, r in zip(names, got, same, ref):
        _within(g, s, r, f"{what} {name}")


_ACTS = ["silu", "gelu_tanh", "clamped_swiglu"]
_HALVES = ["gate_up", "up_gate", "interleaved"]


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("bias", [False, True], ids=["", "biases"])
@pytest.mark.parametrize("halves", _HALVES)
@pytest.mark.parametrize("act", _ACTS)
def test_experts(act, halves, bias, dtype):
    transposed = (_ACTS.index(act) + _HALVES.index(halves) + bias) % 2 == 1  # both layouts for every option
    idx, leaves, dy = _experts_inputs(9, 72, 40, 6, 2, transposed, bias)
    _check_experts(idx, leaves, dy, dtype, f"{act} {halves} bias={bias} transposed={transposed}",
                   transposed=transposed, halves=halves, activation=act)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("edge", ["all_tokens_to_one_expert", "top_k=E", "one_token", "many_tokens"])
def test_experts_routing_edges(edge, dtype):
    t, e = {"one_token": 1, "many_tokens": 150}.get(edge, 9), 6
    k = {"all_tokens_to_one_expert": 1, "top_k=E": e, "one_token": 3}.get(edge, 2)
    g = _gen(11)
    if edge == "all_tokens_to_one_expert":
        idx = torch.full((t, 1), 3, dtype=torch.int64)
    else:
        idx = torch.stack([torch.randperm(e, generator=g)[:k] for _ in range(t)])
    idx, leaves, dy = _experts_inputs(t, 72, 40, e, k, edge == "top_k=E", True, idx=idx)
    _check_experts(idx, leaves, dy, dtype, edge, halves="interleaved", activation="clamped_swiglu",
                   transposed=edge == "top_k=E")


def test_experts_bf16_products_fp32_output():
    """As under autocast: bf16 products, the output (and dx) asked for in fp32 (out_dtype)."""
    idx, leaves, dy = _experts_inputs(9, 72, 40, 6, 2, False, False)
    _check_experts(idx, leaves, dy, torch.bfloat16, "out fp32", out_dtype=torch.float32, activation="silu")


def test_experts_backend_functions_match_the_reference(interpreter):
    """The saved tensors (h with the bias added, order, offs) and every output's dtype and layout are the
    reference backend's; bf16 h exactly (the bias add rounds as the reference's)."""
    from torchfuser.backends.reference import moe as R

    idx, (x, w, gu, gub, dn, dnb), dy = _experts_inputs(9, 72, 40, 6, 2, True, True)
    bf = lambda a: a.to(DEVICE, torch.bfloat16)  # noqa: E731
    args = (bf(x), w.float().to(DEVICE), idx.to(DEVICE), bf(gu), bf(gub), bf(dn), bf(dnb),
            True, "interleaved", "clamped_swiglu", ALPHA, LIMIT)
    got, want = interpreter.moe_experts_fwd(*args), R.moe_experts_fwd(*args)
    assert torch.equal(got[1], want[1]) and torch.equal(got[2], want[2]) and torch.equal(got[3], want[3])
    assert got[0].dtype == want[0].dtype and got[0].is_contiguous()
    rest = (args[7], *args[8:])
    g_got = interpreter.moe_experts_bwd(bf(dy), *args[:7], *want[1:], *rest)
    g_want = R.moe_experts_bwd(bf(dy), *args[:7], *want[1:], *rest)
    for a, b in zip(g_got, g_want):
        assert a.dtype == b.dtype and a.shape == b.shape and a.is_contiguous()


def test_experts_fp64_is_the_reference():
    idx, leaves, dy = _experts_inputs(5, 16, 8, 4, 2, False, True)
    kw = dict(halves="gate_up", activation="gelu_tanh")
    got = _experts(leaves, idx, dy, torch.float64, "triton", **kw)
    want = _experts(leaves, idx, dy, torch.float64, "reference", **kw)
    assert all(torch.equal(a, b) for a, b in zip(got, want))


def test_the_kernels_run_not_the_reference(interpreter, monkeypatch):
    """backend='triton' reaches these kernels: each launcher launches, no reference function is called."""
    mod = interpreter.moe
    launched = {}
    for name in ("_route_fwd", "_route_bwd", "_act_fwd", "_act_bwd", "_combine", "_gather_scale"):
        launcher = getattr(mod, name)
        monkeypatch.setattr(mod, name, lambda grid, *a, _l=launcher, _n=name, **kw: (
            launched.__setitem__(_n, launched.get(_n, 0) + 1), _l(grid, *a, **kw)))
    for fn in ("moe_route_fwd", "moe_route_bwd", "moe_experts_fwd", "moe_experts_bwd"):
        monkeypatch.setattr(mod.R, fn, lambda *a, _fn=fn: pytest.fail(f"the reference's {_fn} ran"))
    dw = torch.randn(9, 2, generator=_gen(12), dtype=torch.float64)
    _route(_logits(9, 6), torch.float32, "triton", 2, dw, scoring="softmax", renorm=True)
    idx, leaves, dy = _experts_inputs(9, 72, 40, 6, 2, False, True)
    _experts(leaves, idx, dy, torch.bfloat16, "triton", halves="gate_up", activation="silu")
    assert launched == {"_route_fwd": 1, "_route_bwd": 1, "_act_fwd": 1, "_act_bwd": 1, "_combine": 2,
                        "_gather_scale": 1}


# ---------------------------------------------------------------- a whole model

def test_tiny_qwen3_moe_optimized_with_triton_trains_as_unfused():
    from transformers import AutoModelForCausalLM

    from arch_sweep import tiny_config
    from torchfuser.modules.moe import FusedMoE

    cfg = tiny_config("qwen3_moe")
    cfg.norm_topk_prob, cfg.router_aux_loss_coef = True, 0.3
    torch.manual_seed(0)
    ref = AutoModelForCausalLM.from_config(cfg).float().train().to(DEVICE)
    fused = torchfuser.optimize(copy.deepcopy(ref), backend="triton")
    moe = [e for e in torchfuser.report(fused).entries if e.pattern == "moe"]
    assert moe and all(e.is_fused and e.backend.startswith("triton:") for e in moe), [e.backend for e in moe]
    assert any(isinstance(m, FusedMoE) for m in fused.modules())
    ids = torch.randint(3, 128, (2, 12), generator=_gen(1)).to(DEVICE)

    def step(model):
        out = model(input_ids=ids, labels=ids, output_router_logits=True, use_cache=False)
        out.loss.backward()
        return out.loss.detach(), out.aux_loss.detach()

    (loss, aux), (loss_ref, aux_ref) = step(fused), step(ref)
    close = lambda a, b, what: torch.testing.assert_close(  # noqa: E731
        a, b, rtol=1e-5, atol=1e-5 * (b.abs().max().item() + 1e-12), msg=what)
    close(loss, loss_ref, "loss")
    close(aux, aux_ref, "router aux loss")
    for (name, a), (_, b) in zip(ref.named_parameters(), fused.named_parameters()):
        assert (a.grad is None) == (b.grad is None), name
        if a.grad is not None:
            close(b.grad, a.grad, name)
    assert not torchfuser.report(fused).fallbacks  # every block took its fused path
