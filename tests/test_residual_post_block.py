"""Post-block-norm layers (OLMo-2, OLMo-3, EXAONE 4, FlexOlmo: h = x + norm(attention(x)), then h + norm(mlp(h))):
fused, each norm and the add after it one kernel (``ops.rms_norm_add``), exact against the unfused model in fp32 for
the loss and every gradient, bf16 within the numerics rule; forms the fused forward does not build are left alone with
the reason."""
from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

import torchfuser
from torchfuser import ops
from torchfuser.modules import _post_block
from torchfuser.modules.residual_norm import ResidualNormSpec
from torchfuser.patterns.base import Skip
from torchfuser.patterns.residual_norm import ResidualNormPattern

from numerics import assert_bf16_within_rule, assert_trains_like, needs_mlir
from tiny_lm import assert_generates_like, fused_layers, lm_step as step, tiny_model
from test_residual_norm import H, Layer

TYPES = ["olmo2", "olmo3", "exaone4", "flex_olmo"]


class _PostBlock(Layer):
    def forward(self, hidden_states, attention_mask=None, **kwargs):
        a, _ = self.self_attn(hidden_states=hidden_states, attention_mask=attention_mask, **kwargs)
        s = hidden_states + self.input_layernorm(a)
        return s + self.post_attention_layernorm(self.mlp(s))


class _NormBeforeTheMLPOnly(Layer):  # neither form: no reason of the post-block kind
    def forward(self, hidden_states, attention_mask=None, **kwargs):
        a, _ = self.self_attn(hidden_states=hidden_states, attention_mask=attention_mask, **kwargs)
        s = hidden_states + self.input_layernorm(a)
        return s + self.mlp(self.post_attention_layernorm(s))


class _PostBlockLayerNorms(_PostBlock):
    def __init__(self):
        super().__init__()
        self.input_layernorm, self.post_attention_layernorm = nn.LayerNorm(H), nn.LayerNorm(H)


class _PostBlockDropout(_PostBlock):
    def __init__(self):
        super().__init__()
        self.drop = nn.Dropout(0.1)

    def forward(self, hidden_states, attention_mask=None, **kwargs):
        a, _ = self.self_attn(hidden_states=hidden_states, attention_mask=attention_mask, **kwargs)
        s = hidden_states + self.drop(self.input_layernorm(a))
        return s + self.post_attention_layernorm(self.mlp(s))


class _PostBlockScaled(_PostBlock):  # Granite-style multiplier at its default 1.0: read at each call
    def __init__(self):
        super().__init__()
        self.residual_multiplier = 1.0

    def forward(self, hidden_states, attention_mask=None, **kwargs):
        a, _ = self.self_attn(hidden_states=hidden_states, attention_mask=attention_mask, **kwargs)
        s = hidden_states + self.input_layernorm(a) * self.residual_multiplier
        return s + self.post_attention_layernorm(self.mlp(s)) * self.residual_multiplier


def test_a_post_block_layer_is_fused_by_structure():
    found = ResidualNormPattern().match(_PostBlock())
    assert isinstance(found, ResidualNormSpec) and found.post_block and not found.post_norm, found
    assert (found.norm_in, found.norm_mid) == ("input_layernorm", "post_attention_layernorm")


def test_another_form_gets_no_post_block_spec():
    found = ResidualNormPattern().match(_NormBeforeTheMLPOnly())
    assert not (isinstance(found, ResidualNormSpec) and found.post_block), found
    assert not (isinstance(found, Skip) and "post-block" in found.reason), found


@pytest.mark.parametrize("cls, words", [(_PostBlockLayerNorms, "LayerNorms"), (_PostBlockDropout, "dropout"),
                                        (_PostBlockScaled, "residual scale")])
def test_forms_it_does_not_build_are_left_alone_with_the_reason(cls, words):
    found = ResidualNormPattern().match(cls())
    assert isinstance(found, Skip) and "post-block" in found.reason and words in found.reason, found


def _fused(model_type, backend="reference"):
    ref = tiny_model(model_type)
    fused = copy.deepcopy(ref)
    torchfuser.optimize(fused, backend=backend)
    layers = fused_layers(fused)
    assert len(layers) == 2 and all(m.forward.spec.post_block for m in layers), str(torchfuser.report(fused))
    return ref, fused


@pytest.mark.parametrize("model_type", TYPES)
def test_fp32_exact_every_gradient(model_type, monkeypatch):
    ref, fused = _fused(model_type)
    assert not [e for e in torchfuser.report(fused).skipped if e.pattern == "residual_norm"]
    calls = []
    real = ops.rms_norm_add
    monkeypatch.setattr(_post_block.ops, "rms_norm_add", lambda *a, **k: calls.append(1) or real(*a, **k))
    assert_trains_like(ref, fused, step, list(ref.state_dict()))  # (restores it at the end)
    assert len(calls) == 4  # two layers, two norm-then-add kernels each: the fused path ran
    assert not fused_layers(fused)


@needs_mlir
def test_default_cpu_backend_exact():
    ref, fused = _fused("olmo2", backend="auto")
    assert_trains_like(ref, fused, step, list(ref.state_dict()))


@pytest.mark.parametrize("model_type", ["olmo2", "exaone4"])  # the two norm dtype rules (x's; Llama's promotion)
def test_bf16_within_the_rule(model_type):
    ref64 = tiny_model(model_type).double()
    plain = copy.deepcopy(ref64).to(torch.bfloat16)
    fused = copy.deepcopy(plain)
    torchfuser.optimize(fused, backend="reference")
    assert len(fused_layers(fused)) == 2
    assert_bf16_within_rule(fused, plain, ref64, step)


@pytest.mark.parametrize("model_type", ["olmo2", "exaone4"])
def test_cpu_autocast_as_unfused(model_type):
    """bf16 autocast over fp32 parameters: a block's bf16 output normed (bf16 by OLMo-2's rule, fp32 by EXAONE 4's)
    and added to the fp32 residual stream with the unfused layer's roundings: the loss and every gradient bit for bit
    those of the same model with only this pattern left out (its norms, attention and MLP fused alike)."""
    ref, fused = _fused(model_type)
    other = copy.deepcopy(ref)
    torchfuser.optimize(other, backend="reference", exclude=("residual_norm",))
    assert not fused_layers(other)
    with torch.autocast("cpu", torch.bfloat16):
        losses = [step(m) for m in (other, fused)]
    assert torch.equal(losses[1], losses[0])
    for (n, a), (_, b) in zip(other.named_parameters(), fused.named_parameters()):
        assert torch.equal(b.grad, a.grad), n


def test_decodes_like_unfused_and_restores():
    ref, fused = _fused("olmo2")
    assert_generates_like(ref, fused)
    torchfuser.restore(fused)
    assert not fused_layers(fused)
    assert all(type(m) is type(n) for m, n in zip(ref.modules(), fused.modules()))


def test_hooked_norm_falls_back_with_the_reason():
    from torchfuser.modules import fallbacks

    ref, fused = _fused("olmo2")
    layer = fused_layers(fused)[0]
    layer.post_feedforward_layernorm.register_forward_hook(lambda *a: None)
    torch.testing.assert_close(step(fused), step(ref), rtol=1e-6, atol=1e-6)
    reasons = [why for c in fallbacks.counts(fused).values() for why in c]
    assert reasons and all("hooks" in why for why in reasons), reasons


@pytest.mark.filterwarnings("ignore:`gradient_checkpointing_enable` is deprecated:FutureWarning")
def test_gradient_checkpointing_exact():
    """transformers' gradient checkpointing: the fused computation checkpointed by the layer's forward, exact."""
    ref, fused = _fused("olmo2")
    for m in (ref, fused):
        m.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    assert_trains_like(ref, fused, step, list(ref.state_dict()))


def test_a_hybrid_model_s_attention_layer():
    """OLMo-hybrid: its linear-attention layer pre-norm (fused before), its attention layer post-block (fused now)."""
    ref = tiny_model("olmo_hybrid")
    fused = copy.deepcopy(ref)
    torchfuser.optimize(fused, backend="reference")
    kinds = sorted(m.forward.spec.post_block for m in fused_layers(fused))
    assert kinds == [False, True], str(torchfuser.report(fused))
    assert_trains_like(ref, fused, step, list(ref.state_dict()))


class _PostBlockOutputScale(_PostBlock):  # Gemma 4's ``out *= layer_scalar``, on a post-block layer
    def __init__(self):
        super().__init__()
        self.layer_scalar = nn.Buffer(torch.full((1,), 0.75))

    def forward(self, hidden_states, attention_mask=None, **kwargs):
        return _PostBlock.forward(self, hidden_states, attention_mask, **kwargs) * self.layer_scalar


@pytest.mark.parametrize("cls", [_PostBlock, _PostBlockOutputScale])
def test_a_toy_layer_exact_in_float64(cls):
    """The fused forward in float64 (reference backend) against the original: the output, the input's and every
    parameter's gradient; an output-scale buffer changed after optimize is followed."""
    torch.manual_seed(0)
    ref = cls().double()
    model = nn.ModuleDict(dict(layer=copy.deepcopy(ref)))
    torchfuser.optimize(model, backend="reference")
    assert model.layer.forward.spec.post_block
    if cls is _PostBlockOutputScale:
        assert model.layer.forward.spec.output_scale == "layer_scalar"
        for m in (ref, model.layer):
            m.layer_scalar.fill_(-1.5)
    x = torch.randn(2, 5, H, dtype=torch.float64, requires_grad=True)
    x2 = x.detach().clone().requires_grad_()
    g = torch.randn(2, 5, H, dtype=torch.float64)
    out, out2 = ref(x), model.layer(x2)
    torch.testing.assert_close(out2, out)
    (out * g).sum().backward()
    (out2 * g).sum().backward()
    torch.testing.assert_close(x2.grad, x.grad)
    for (n, a), (_, b) in zip(ref.named_parameters(), model.layer.named_parameters()):
        torch.testing.assert_close(b.grad, a.grad, msg=n)
    from torchfuser.modules import fallbacks

    assert not fallbacks.counts(model)  # the fused path ran
