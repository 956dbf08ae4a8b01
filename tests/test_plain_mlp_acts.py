"""Plain (ungated) MLPs beyond GELU: ReLU (CTRL's feed-forward) and squared ReLU (Nemotron, Persimmon,
Arcee, NanoChat) through ``functional.activation``; and MLPs that take the residual and add it themselves
(BLOOM, MPT). The op against float64 (reference backend; MLIR and Triton: tests/backends), then one training
step of tiny models fused vs unfused: loss and every gradient; the CUDA test runs optimize's defaults."""
from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as TF
from transformers import AutoConfig, AutoModelForCausalLM

import torchfuser
import torchfuser.functional as F
from torchfuser.modules.mlp import FusedMLP

from numerics import ATOL, assert_cuda_steps_like, assert_trains_like, assert_within_rule

VOCAB = 96
_COMMON = dict(vocab_size=VOCAB, bos_token_id=1, eos_token_id=2, pad_token_id=0)
_SMALL = dict(hidden_size=32, num_hidden_layers=2, num_attention_heads=4, intermediate_size=48)
# name → (model_type, config, the MLP's activation, its residual argument)
MODELS = {
    "nemotron": ("nemotron", dict(_SMALL, num_key_value_heads=2, head_dim=8), "relu2", None),
    "persimmon": ("persimmon", dict(_SMALL, hidden_dropout=0.0, attention_dropout=0.0), "relu2", None),
    "arcee": ("arcee", dict(_SMALL, num_key_value_heads=2), "relu2", None),
    "ctrl": ("ctrl", dict(n_embd=32, n_layer=2, n_head=4, dff=48, resid_pdrop=0.0, embd_pdrop=0.0), "relu", None),
    "bloom": ("bloom", dict(hidden_size=32, n_layer=2, n_head=4, hidden_dropout=0.0, attention_dropout=0.0), "gelu",
              "residual"),
    "mpt": ("mpt", dict(d_model=32, n_layers=2, n_heads=4, expansion_ratio=2, max_seq_len=32), "gelu", "residual"),
}


def make(name: str):
    model_type, extra, _, _ = MODELS[name]
    cfg = AutoConfig.for_model(model_type, **{**_COMMON, **extra})
    cfg._attn_implementation = "eager"
    torch.manual_seed(0)
    return AutoModelForCausalLM.from_config(cfg).float().train()


def step(model, device="cpu"):
    ids = torch.randint(3, VOCAB, (2, 9), generator=torch.Generator().manual_seed(1)).to(device)
    torch.manual_seed(0)
    loss = model(input_ids=ids, labels=ids).loss
    loss.backward()
    return loss.detach()


def mlps(model):
    return [m for m in model.modules() if isinstance(m, FusedMLP)]


@pytest.mark.parametrize("kind", ["relu", "relu2"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("shape", [(1, 64), (123, 123), (2, 3, 96)])
def test_activation_against_float64(kind, dtype, shape):
    x = torch.randn(shape, generator=torch.Generator().manual_seed(0)) * 3
    plain = (lambda t: TF.relu(t)) if kind == "relu" else (lambda t: TF.relu(t) ** 2)
    outs = []
    for fn, dt in ((plain, torch.float64), (plain, dtype), (lambda t: F.activation(t, kind, backend="reference"), dtype)):
        leaf = x.to(dt).requires_grad_()
        y = fn(leaf)
        (dx,) = torch.autograd.grad(y, leaf, torch.randn(y.shape, generator=torch.Generator().manual_seed(1)).to(dt))
        outs.append((y, dx))
    (r, dr), (s, ds), (g, dg) = outs
    assert g.dtype == dg.dtype == dtype
    assert_within_rule(g, s, r, ATOL[dtype] * max(1.0, r.abs().max().item()), f"{kind} output")
    assert_within_rule(dg, ds, dr, ATOL[dtype] * max(1.0, dr.abs().max().item()), f"{kind} gradient")


def test_activation_non_contiguous_and_bad_kind():
    x = (torch.randn(16, 24) * 3).t()  # a transposed view
    torch.testing.assert_close(F.activation(x, "relu2", backend="reference"), TF.relu(x) ** 2)
    with pytest.raises(ValueError, match="kind must be"):
        F.activation(x, "gelu", backend="reference")


@pytest.mark.parametrize("name", list(MODELS))
def test_training_step_fused_matches_unfused(name):
    ref = make(name)
    fused = copy.deepcopy(ref)
    keys = list(ref.state_dict())
    torchfuser.optimize(fused, backend="reference")
    found = mlps(fused)
    assert len(found) == 2, str(torchfuser.report(fused))
    _, _, activation, residual = MODELS[name]
    assert (found[0].spec.activation, found[0].spec.residual) == (activation, residual), found[0].spec
    assert_trains_like(ref, fused, step, keys, loss_rtol=1e-5)
    assert not mlps(fused) and list(fused.state_dict()) == keys


def test_residual_mlp_needs_its_residual():
    model = make("bloom")
    torchfuser.optimize(model, backend="reference")
    mlp = model.transformer.h[0].mlp
    x, r = torch.randn(1, 3, 32), torch.randn(1, 3, 32)
    with torch.no_grad():
        torch.testing.assert_close(mlp(x, r), mlp(x, residual=r))
        torch.testing.assert_close(mlp(x, r) - r, mlp(x, torch.zeros_like(r)), rtol=1e-5, atol=1e-6)
        with pytest.raises(TypeError, match="'residual'"):
            mlp(x)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("name", ["nemotron", "ctrl", "bloom", "mpt"])
def test_on_cuda_with_the_defaults(name):
    """optimize's defaults on the GPU: the Triton activation kernels, ALiBi attention in SDPA's mask."""
    ref = make(name).cuda()
    fused = copy.deepcopy(ref)
    torchfuser.optimize(fused)
    assert len(mlps(fused)) == 2, str(torchfuser.report(fused))
    assert_cuda_steps_like(ref, fused, step)
