"""The norm forms the norm patterns once left alone: Nemotron's ``LayerNorm1P`` (w + 1), OLMo-1's LayerNorm with no
weight nor bias (its eps a literal in its forward: solved by the probe), NanoChat's weightless RMS norm, and
``nn.LayerNorm(elementwise_affine=False)``. Each fused module against the original module (fp32 tight, bf16 by the
numerics rule against float64, every gradient) on the reference backend and MLIR's where importable; the layers
of the three families with their residual adds fused: one training step fused vs unfused, state_dict keys,
restore. Modules that look like norms but compute something else are left alone. (The kernels of every backend,
Triton's interpreted, on these forms: tests/backends/test_norm_forms_kernels.py.)"""
from __future__ import annotations

import copy

import pytest
import torch
from torch import nn
from transformers import AutoConfig, AutoModelForCausalLM
from transformers.models.nanochat.modeling_nanochat import NanoChatRMSNorm
from transformers.models.nemotron.modeling_nemotron import NemotronLayerNorm1P
from transformers.models.olmo.modeling_olmo import OlmoLayerNorm

import torchfuser
from torchfuser.modules.norms import FusedLayerNorm, FusedRMSNorm, LayerNormSpec, RMSNormSpec
from torchfuser.patterns.base import Skip
from torchfuser.patterns.norms import LayerNormPattern, RMSNormPattern
from tiny_lm import fused_layers

from numerics import ATOL, _NO_MLIR, assert_bf16_within_rule, assert_trains_like, assert_within_rule

H = 48
BACKENDS = ["reference", pytest.param("mlir", marks=pytest.mark.skipif(_NO_MLIR is not None, reason=_NO_MLIR or ""))]


def nemotron_norm():
    m = NemotronLayerNorm1P(H, eps=1e-5)
    g = torch.Generator().manual_seed(5)
    with torch.no_grad():  # (its init is w = 0, b = 0: random ones show a dropped offset, weight or bias)
        m.weight.copy_(0.2 * torch.randn(H, generator=g))
        m.bias.copy_(0.2 * torch.randn(H, generator=g))
    return m


FORMS = {
    "nemotron_1p": (nemotron_norm, LayerNormSpec(eps=1e-5, weight="weight", bias="bias", offset=1.0)),
    "olmo_weightless_ln": (lambda: OlmoLayerNorm(H), LayerNormSpec(eps=1e-5, weight=None, bias=None)),
    "nanochat_weightless_rms": (lambda: NanoChatRMSNorm(1e-6), RMSNormSpec(eps=1e-6, weight=None)),
    "layernorm_no_affine": (lambda: nn.LayerNorm(H, eps=1e-6, elementwise_affine=False),
                            LayerNormSpec(eps=1e-6, weight=None, bias=None)),
}


def _spec(module):
    found = [p.match(module) for p in (RMSNormPattern(), LayerNormPattern())]
    return next((f for f in found if isinstance(f, (RMSNormSpec, LayerNormSpec))), found)


def _fused(module, backend):
    spec = _spec(module)
    return (FusedRMSNorm if isinstance(spec, RMSNormSpec) else FusedLayerNorm)(module, spec, backend)


@pytest.mark.parametrize("form", list(FORMS))
def test_the_pattern_reads_the_form(form):
    make, want = FORMS[form]
    spec = _spec(make())
    fields = ("eps", "weight", "offset") + (("bias",) if isinstance(want, LayerNormSpec) else ())
    assert type(spec) is type(want) and all(getattr(spec, f) == getattr(want, f) for f in fields), spec


def _grads(module, x, dy):
    x = x.detach().requires_grad_()
    y = module(x)
    params = [p for p in module.parameters()]
    return (y.detach(), *torch.autograd.grad(y, [x, *params], dy))


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("form", list(FORMS))
def test_fused_module_matches_the_original_fp32(form, backend):
    orig = FORMS[form][0]()
    fused = _fused(orig, backend)
    g = torch.Generator().manual_seed(0)
    x = torch.randn(3, 7, H, generator=g) + 0.3
    dy = torch.randn(3, 7, H, generator=g)
    want, got = _grads(orig, x, dy), _grads(fused, x, dy)
    assert len(got) == len(want) == 2 + 2 * (form == "nemotron_1p")  # y, dx (and dw, db where it has them)
    for a, b in zip(got, want):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("form", list(FORMS))
def test_fused_module_bf16_within_the_rule(form, backend):
    orig = FORMS[form][0]()
    g = torch.Generator().manual_seed(1)
    x = torch.randn(4, 33, H, generator=g, dtype=torch.float64) + 0.3
    dy = torch.randn(4, 33, H, generator=g, dtype=torch.float64)
    ref64 = _grads(copy.deepcopy(orig).double(), x, dy)
    plain = copy.deepcopy(orig).to(torch.bfloat16)
    fused = _fused(copy.deepcopy(plain), backend)
    same = _grads(plain, x.bfloat16(), dy.bfloat16())
    got = _grads(fused, x.bfloat16(), dy.bfloat16())
    for name, a, b, r in zip(("y", "dx", "dw", "db"), got, same, ref64):
        assert a.dtype == b.dtype, name
        assert_within_rule(a, b, r, ATOL[torch.bfloat16] * max(1.0, r.abs().max().item()), f"{form} {name}")


def test_a_weightless_norm_has_no_parameters_and_follows_the_input_device_and_dtype():
    fused = _fused(NanoChatRMSNorm(1e-6), "reference")
    assert not list(fused.parameters()) and not list(fused.state_dict())
    for dt in (torch.float32, torch.bfloat16):
        assert fused(torch.randn(2, 3, 16, dtype=dt)).dtype == dt  # any width: its ones follow x
    fused = _fused(nn.LayerNorm(H, elementwise_affine=False), "reference")
    assert fused.weight is None and fused.bias is None and not list(fused.state_dict())  # read as the original's


class _Scaled(nn.Module):  # a weightless "norm" that scales its output: not a norm
    def __init__(self):
        super().__init__()
        self.variance_epsilon = 1e-6

    def forward(self, x):
        return 2 * x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.variance_epsilon)


class _CentredNoEps(nn.Module):  # mean-free, but a max-abs scale, no eps
    normalized_shape = (H,)

    def forward(self, x):
        x = x - x.mean(-1, keepdim=True)
        return x / x.abs().amax(-1, keepdim=True)


class _OffsetTwoLN(nn.LayerNorm):  # w + 2: neither of the offsets the kernels are handed
    def forward(self, x):
        return nn.functional.layer_norm(x, self.normalized_shape, self.weight + 2.0, self.bias, self.eps)


@pytest.mark.parametrize("make", [_Scaled, _CentredNoEps, lambda: _OffsetTwoLN(H), nn.GELU, nn.Dropout, nn.Identity])
def test_look_alikes_are_left_alone(make):
    found = [p.match(make()) for p in (RMSNormPattern(), LayerNormPattern())]
    assert not any(isinstance(f, (RMSNormSpec, LayerNormSpec)) for f in found), found
    if make is _Scaled:  # a norm-like module the report names, with why
        assert any(isinstance(f, Skip) for f in found), found


VOCAB = 96
_SMALL = dict(vocab_size=VOCAB, bos_token_id=1, eos_token_id=2, pad_token_id=0, hidden_size=32, num_hidden_layers=2,
              num_attention_heads=4, num_key_value_heads=2, intermediate_size=64)
FAMILIES = {
    "nemotron": ("nemotron", dict(_SMALL, head_dim=8), "layer_norm", 5),
    "olmo": ("olmo", dict(_SMALL), "layer_norm", 5),
    "nanochat": ("nanochat", dict(_SMALL), "rms_norm", 9),  # (its q_norm / k_norm too)
}


def make(name):
    model_type, extra, _, _ = FAMILIES[name]
    cfg = AutoConfig.for_model(model_type, **extra)
    cfg._attn_implementation = "sdpa"
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(cfg).float().train()
    with torch.no_grad():  # Nemotron's LayerNorm1P starts at w = 0, b = 0: random values show any slip
        for n, p in model.named_parameters():
            if "norm" in n:
                p.normal_(0.0, 0.2)
    return model


def step(model, dtype=None):
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(3, VOCAB, (2, 9), generator=g)
    torch.manual_seed(0)
    loss = model(input_ids=ids, attention_mask=torch.ones_like(ids), labels=ids).loss
    loss.backward()
    return loss.detach()


@pytest.mark.parametrize("name", list(FAMILIES))
def test_family_fused_whole_one_training_step(name):
    ref = make(name)
    fused = copy.deepcopy(ref)
    keys = list(ref.state_dict())
    torchfuser.optimize(fused, backend="reference")
    kind, norms = FAMILIES[name][2:]
    fused_norms = [m for m in fused.modules() if isinstance(m, FusedRMSNorm if kind == "rms_norm" else FusedLayerNorm)]
    assert len(fused_norms) == norms, str(torchfuser.report(fused))
    assert len(fused_layers(fused)) == 2, str(torchfuser.report(fused))
    assert_trains_like(ref, fused, step, keys, loss_rtol=1e-6)
    assert not fused_layers(fused) and not any(isinstance(m, (FusedRMSNorm, FusedLayerNorm)) for m in fused.modules())


@pytest.mark.parametrize("name", list(FAMILIES))
def test_family_bf16_within_the_rule(name):
    ref64 = make(name).double()
    plain = copy.deepcopy(ref64).to(torch.bfloat16)
    fused = copy.deepcopy(plain)
    torchfuser.optimize(fused, backend="reference")
    assert len(fused_layers(fused)) == 2
    assert_bf16_within_rule(fused, plain, ref64, step)


class _LiteralEps(nn.Module):  # OLMo-1's shape of code with another literal eps, and an RMS norm of it
    def __init__(self, rms: bool, eps: float):
        super().__init__()
        self.normalized_shape, self.rms, self._e = (H,), rms, eps  # (the eps under a name no pattern reads)

    def forward(self, x):
        if self.rms:
            return x * torch.rsqrt(x.float().pow(2).mean(-1, keepdim=True) + self._e).to(x.dtype)
        return nn.functional.layer_norm(x.float(), self.normalized_shape, None, None, self._e).to(x.dtype)


@pytest.mark.parametrize("rms", [True, False], ids=["rms", "layer"])
@pytest.mark.parametrize("eps", [3e-6, 1e-8, 0.25])
def test_a_literal_eps_is_solved(rms, eps):
    spec = _spec(_LiteralEps(rms, eps))
    assert isinstance(spec, RMSNormSpec if rms else LayerNormSpec) and spec.weight is None, spec
    assert spec.eps == pytest.approx(eps, rel=1e-3)
