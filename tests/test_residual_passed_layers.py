"""Pre-norm layers whose attention or MLP is passed the residual and adds it itself (BLOOM: both blocks end
in dropout_add(output, residual); MPT: its MLP does): ``ResidualNormSpec.residual_passed``. The blocks keep
their adds; the fused layer hands them the norms' opening residuals, so that each sum's two gradients meet
inside a norm's backward kernel (and MPT's attention add goes into norm_2's kernel). One training step fused
vs unfused: loss and every gradient (fp32 tight, bf16 by the numerics rule against float64); BLOOM's
``apply_residual_connection_post_layernorm`` (the norm's output is the residual) left alone with the reason;
the blocks' own dropouts in training on the same random stream as the original's; and a CUDA run."""
from __future__ import annotations

import copy

import pytest
import torch
from transformers import AutoConfig, AutoModelForCausalLM

import torchfuser
from tiny_lm import fused_layers as layers

from numerics import assert_bf16_within_rule, assert_cuda_steps_like, assert_trains_like

VOCAB = 96
_CONFIGS = {
    "bloom": dict(vocab_size=VOCAB, hidden_size=32, n_layer=2, n_head=4, hidden_dropout=0.0, attention_dropout=0.0),
    "mpt": dict(vocab_size=VOCAB, d_model=32, n_layers=2, n_heads=4, expansion_ratio=2, max_seq_len=32),
}
_NORMS = {"bloom": ("input_layernorm", "post_attention_layernorm"), "mpt": ("norm_1", "norm_2")}
_PASSED = {"bloom": ("attention", "mlp"), "mpt": ("mlp",)}


def make(kind: str = "bloom", **overrides):
    cfg = AutoConfig.for_model(kind, **{**_CONFIGS[kind], **overrides})
    torch.manual_seed(0)
    return AutoModelForCausalLM.from_config(cfg).float().train()


def step(model, device="cpu"):
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(0, VOCAB, (2, 9), generator=g).to(device)
    mask = torch.ones_like(ids)
    mask[1, -2:] = 0
    torch.manual_seed(0)  # the same random stream for both models' dropouts
    loss = model(input_ids=ids, attention_mask=mask, labels=ids.masked_fill(mask == 0, -100)).loss
    loss.backward()
    return loss.detach()


def _reasons(model) -> list[str]:
    return [e.reason for e in torchfuser.report(model).skipped if e.pattern == "residual_norm"]


@pytest.mark.parametrize("kind", ["bloom", "mpt"])
def test_training_step_fused_matches_unfused(kind):
    ref = make(kind)
    fused = copy.deepcopy(ref)
    keys = list(ref.state_dict())
    torchfuser.optimize(fused, backend="reference")
    found = layers(fused)
    assert len(found) == 2, str(torchfuser.report(fused))
    spec = found[0].forward.spec
    assert spec.residual_passed == _PASSED[kind] and not spec.parallel and not spec.post_norm
    assert (spec.norm_in, spec.norm_mid) == _NORMS[kind]
    assert_trains_like(ref, fused, step, keys, loss_rtol=1e-6)
    assert not layers(fused) and list(fused.state_dict()) == keys


def test_residual_from_the_norm_output_is_left_alone_with_the_reason():
    ref = make(apply_residual_connection_post_layernorm=True)
    fused = copy.deepcopy(ref)
    torchfuser.optimize(fused, backend="reference")
    assert not layers(fused)
    reasons = _reasons(fused)
    assert reasons and all("the residual is the norm's output" in r for r in reasons), reasons
    torch.testing.assert_close(step(fused), step(ref), rtol=1e-6, atol=1e-6)


def test_bf16_within_the_rule():
    ref64 = make().double()
    plain = copy.deepcopy(ref64).to(torch.bfloat16)
    fused = copy.deepcopy(plain)
    torchfuser.optimize(fused, backend="reference")
    assert len(layers(fused)) == 2
    assert_bf16_within_rule(fused, plain, ref64, step)


def test_blocks_dropout_in_training_draws_as_the_original():
    """BLOOM's hidden_dropout lives in its attention and MLP (dropout_add): the fused layer calls them in the
    original's order, so from one seed the masks are the original's: the loss and every gradient match."""
    ref = make(hidden_dropout=0.3)
    fused = copy.deepcopy(ref)
    keys = list(ref.state_dict())
    torchfuser.optimize(fused, backend="reference")
    assert len(layers(fused)) == 2, str(torchfuser.report(fused))
    assert_trains_like(ref, fused, step, keys, loss_rtol=1e-6)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("kind", ["bloom", "mpt"])
def test_on_cuda_with_the_defaults(kind):
    ref = make(kind).cuda()
    fused = copy.deepcopy(ref)
    torchfuser.optimize(fused)
    assert len(layers(fused)) == 2, str(torchfuser.report(fused))
    assert_cuda_steps_like(ref, fused, step)


@pytest.mark.parametrize("kind", ["mpt", "bloom"])
def test_the_mlp_residual_add_runs_inside_fc_out_under_autocast(kind):
    """MPT's bias-free MLP adds its residual inside fc_out's GEMM under autocast (``projections.residual_linear``):
    the sum and every gradient within the numerics rule of the float64 MLP, against autocast's own; BLOOM's
    fc_out has a bias: the plain add, as autocast computes it."""
    from torchfuser.modules.mlp import FusedMLP
    from numerics import assert_within_rule

    ref = make(kind)
    torchfuser.optimize(ref, backend="reference")
    mlp = next(m for m in ref.modules() if isinstance(m, FusedMLP))
    assert mlp.spec.residual is not None
    torch.manual_seed(3)
    x, r = torch.randn(2, 5, 32), torch.randn(2, 5, 32)

    def run(m, dtype, autocast):
        xi, ri = (t.detach().to(dtype).clone().requires_grad_() for t in (x, r))
        m.zero_grad(set_to_none=True)
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
            out = m(xi, ri)
        out.float().square().sum().backward()
        return out, [out.detach(), xi.grad, ri.grad, *(p.grad for p in m.parameters())]

    out, got = run(mlp, torch.float32, True)
    assert ("_ResidualLinear" in type(out.grad_fn).__name__) == (kind == "mpt"), out.grad_fn
    torchfuser.restore(ref)
    plain = next(m for m in ref.modules() if type(m).__name__.endswith("MLP"))
    _, base = run(plain, torch.float32, True)
    _, want = run(copy.deepcopy(plain).double(), torch.float64, False)
    for i, (g, b, w) in enumerate(zip(got, base, want)):
        assert_within_rule(g, b, w, 1e-2 * max(1.0, w.abs().max().item()), f"output/gradient {i}")
