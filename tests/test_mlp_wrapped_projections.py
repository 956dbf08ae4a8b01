"""Gemma 4's vision MLP fused by structure: its gate, up and down projections are ``Gemma4ClippableLinear``, a Linear
inside a module that clamps its input and output to bounds from the checkpoint (``use_clipped_linears``; the plain
Linear inside where off). They count as *wrapped projections* (``patterns/_attention_projections.py``), as in the
attention pattern, and the fused gated MLP calls them as they are: the clamps run as the model's own code, whatever
bounds the checkpoint holds. Output, input gradient and every parameter's gradient exact against the unfused module
in fp32, with bounds that clip (and a check that they do), and against float64 within the numerics rule; the sweep's
Gemma 4 row gains the vision tower's gated MLPs, exact."""
from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

from numerics import assert_within_rule, needs_mlir
from torchfuser.modules import fallbacks
from torchfuser.modules.mlp import FusedGatedMLP
from torchfuser.patterns.base import Skip
from torchfuser.patterns.mlp import GatedMLPPattern, MLPPattern

gemma4 = pytest.importorskip("transformers.models.gemma4.modeling_gemma4")
B, S, H, I = 2, 5, 16, 40
_BOUNDS = {"gate_proj": (1.2, 2.0), "up_proj": (0.9, 1.5), "down_proj": (0.3, 0.02)}  # input, output half-widths


def _mlp(clipped: bool = True, act: str = "gelu_pytorch_tanh"):
    from transformers.models.gemma4.configuration_gemma4 import Gemma4VisionConfig

    cfg = Gemma4VisionConfig(hidden_size=H, intermediate_size=I, num_hidden_layers=1, num_attention_heads=2,
                             head_dim=8, use_clipped_linears=clipped, hidden_activation=act)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        mlp = gemma4.Gemma4VisionMLP(cfg)
    if clipped:
        for name, (i, o) in _BOUNDS.items():
            proj = getattr(mlp, name)
            proj.input_min.fill_(-i)
            proj.input_max.fill_(0.8 * i)
            proj.output_min.fill_(-o)
            proj.output_max.fill_(0.7 * o)
    return mlp


def _inputs(seed=3):
    gen = torch.Generator().manual_seed(seed)
    return 2 * torch.randn(B, S, H, generator=gen), torch.randn(B, S, H, generator=gen)


def _run(module, x, g):
    x = x.detach().clone().requires_grad_(True)
    out = module(x)
    return out, torch.autograd.grad((out * g).sum(), [x, *module.parameters()])


@pytest.mark.parametrize("clipped", [True, False])
def test_recognised_with_wrapped_projections(clipped):
    mlp = _mlp(clipped)
    spec = GatedMLPPattern().match(mlp)
    assert not isinstance(spec, Skip), spec.reason
    assert (spec.gate, spec.up, spec.down, spec.activation) == ("gate_proj", "up_proj", "down_proj", "gelu_tanh")
    assert MLPPattern().match(mlp) is None  # three projections: not a plain MLP


@pytest.mark.parametrize("backend", ["reference", pytest.param("mlir", marks=needs_mlir)])
@pytest.mark.parametrize("clipped", [True, False])
def test_fp32_output_and_every_gradient_exact(clipped, backend):
    mlp = _mlp(clipped)
    fused = FusedGatedMLP(copy.deepcopy(mlp), GatedMLPPattern().match(mlp), backend)
    x, g = _inputs()
    want, want_g = _run(mlp, x, g)
    got, got_g = _run(fused, x, g)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)
    names = ["input", *(n for n, _ in mlp.named_parameters())]
    assert len(got_g) == len(want_g) == len(names) == 4
    for n, a, b in zip(names, got_g, want_g):
        assert b.abs().max() > 0, n
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-6, msg=n)
    assert not fallbacks.counts(fused)
    assert list(fused.state_dict()) == list(mlp.state_dict())  # the bounds buffers too
    ref, ref_g = _run(copy.deepcopy(mlp).double(), x.double(), g.double())
    assert_within_rule(got, want, ref, 1e-6, "output")
    for n, a, b, r in zip(names, got_g, want_g, ref_g):
        assert_within_rule(a, b, r, 1e-6 * r.abs().max().item(), n)


def test_the_bounds_clip_and_are_respected():
    """Every projection's input and output bounds clip on these inputs; the fused output stays within down_proj's
    output bounds and differs from the fused output with the bounds opened (±inf)."""
    mlp = _mlp(True)
    seen = {}
    for name in _BOUNDS:
        getattr(mlp, name).register_forward_hook(lambda m, a, out, name=name: seen.__setitem__(name, a[0]))
    x, g = _inputs()
    mlp(x)
    for name, inp in seen.items():
        proj = getattr(mlp, name)
        assert ((inp < proj.input_min) | (inp > proj.input_max)).any(), name
        lin = proj.linear(inp.clamp(proj.input_min, proj.input_max))
        assert ((lin < proj.output_min) | (lin > proj.output_max)).any(), name
        proj._forward_hooks.clear()
    fused = FusedGatedMLP(copy.deepcopy(mlp), GatedMLPPattern().match(mlp), "reference")
    got, _ = _run(fused, x, g)
    assert got.min() >= -_BOUNDS["down_proj"][1] and got.max() <= 0.7 * _BOUNDS["down_proj"][1]
    opened = copy.deepcopy(fused)
    for name in _BOUNDS:
        for b, v in (("input_min", -1), ("output_min", -1), ("input_max", 1), ("output_max", 1)):
            getattr(opened, name).get_buffer(b).fill_(v * float("inf"))
    assert (opened(x) - got).abs().max() > 1e-2


class _Shuffles(nn.Module):
    """A parameter-free wrapper of one Linear whose output rows mix input rows: not a projection."""

    def __init__(self, n_in, n_out):
        super().__init__()
        self.linear = nn.Linear(n_in, n_out, bias=False)

    def forward(self, x):
        return self.linear(x.flip(-2))


def test_a_wrapper_that_mixes_rows_is_not_a_projection():
    mlp = _mlp(False)
    mlp.up_proj = _Shuffles(H, I)
    assert GatedMLPPattern().match(mlp) is None


def test_the_sweep_fuses_gemma4_s_vision_mlps_exactly():
    import vlm_sweep

    if "gemma4" not in vlm_sweep.model_types():
        pytest.skip("no gemma4 in this transformers")
    r = vlm_sweep.run_one("gemma4")
    assert r.kind == "fused", (r.kind, r.detail)
    assert r.towers.get("vision", {}).get("gated_mlp") == 2, r.towers


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_cuda_triton_exact(dtype):
    """On the GPU (the Triton gated kernel, bounds that clip): fp32 as the unfused module; bf16 within the numerics
    rule against float64."""
    mlp = _mlp(True).cuda()
    fused = FusedGatedMLP(copy.deepcopy(mlp), GatedMLPPattern().match(mlp), "triton")
    x, g = (t.cuda() for t in _inputs())
    ref, ref_g = _run(copy.deepcopy(mlp).double(), x.double(), g.double())
    low = copy.deepcopy(mlp).to(dtype)
    fused = fused.to(dtype)
    want, want_g = _run(low, x.to(dtype), g.to(dtype))
    got, got_g = _run(fused, x.to(dtype), g.to(dtype))
    atol = 1e-6 if dtype == torch.float32 else 1e-3
    assert_within_rule(got.double(), want.double(), ref, atol, "output")
    for n, a, b, r in zip(["input", *(n for n, _ in mlp.named_parameters())], got_g, want_g, ref_g):
        assert_within_rule(a.double(), b.double(), r, atol * max(r.abs().max().item(), 1.0), n)
    assert not fallbacks.counts(fused)
