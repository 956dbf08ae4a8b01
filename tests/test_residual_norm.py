"""Residual adds fused into a pre-norm layer's RMSNorms: the ops' gradients, what the pattern's probe
accepts and rejects, and the installed forward (arguments, fallbacks, restore, copies, pickling).
Whole models of every family: tests/test_architectures.py."""
from __future__ import annotations

import copy
import io

import pytest
import torch
from torch import nn

import torchfuser
from torchfuser import ops
from torchfuser.modules.residual_norm import ResidualNormForward
from torchfuser.patterns.residual_norm import ResidualNormPattern

from numerics import ATOL, assert_within_rule

H = 24


# -- the ops ------------------------------------------------------------------------------------

def _block(x, w1, w2, attn, mlp, fused: bool, backend: str, eps=1e-5):
    """x → norm_in → attn → + x → norm_mid → mlp → + s, as the fused layer or as plain PyTorch."""
    if fused:
        y, x = ops.rms_norm_opening_residual(x, w1, eps, 0.0, backend)
        s, y = ops.add_rms_norm(x, attn(y), w2, eps, 0.0, backend)
    else:
        def norm(t, w):
            tf = t.float() if t.dtype != torch.float64 else t
            return (tf * torch.rsqrt(tf.pow(2).mean(-1, keepdim=True) + eps) * w).to(t.dtype)
        s = x + attn(norm(x, w1))
        y = norm(s, w2)
    return s + mlp(y)


def _grads(dtype, fused, backend, low=torch.bfloat16):
    """Loss and the gradients of x and both norm weights; the branches' outputs are in ``low``
    precision when dtype is fp32 (an fp32 residual stream with bf16 projections, as under autocast)."""
    g = torch.Generator().manual_seed(0)
    dev = "cuda" if backend == "triton" else "cpu"
    x = torch.randn(3, 7, H, generator=g).to(dev, dtype).requires_grad_()
    w1, w2 = (torch.rand(H, generator=g).add(0.5).to(dev, dtype).requires_grad_() for _ in range(2))
    a, m = (torch.randn(H, H, generator=g).div(H**0.5).to(dev, dtype) for _ in range(2))
    branch = low if dtype == torch.float32 else dtype
    attn = lambda t: torch.tanh(t.to(branch) @ a.to(branch))
    mlp = lambda t: torch.sin(t.to(branch) @ m.to(branch))
    out = _block(x, w1, w2, attn, mlp, fused, backend)
    weights = torch.randn(out.shape, generator=g).to(dev, out.dtype)
    (out * weights).sum().backward()
    return tuple(t.cpu() for t in (out, x.grad, w1.grad, w2.grad))


# The Triton kernels on the CPU (interpreted): tests/backends/test_residual_norm_kernels.py.
_BACKENDS = ["reference"] + (["triton"] if torch.cuda.is_available() else [])


@pytest.mark.parametrize("backend", _BACKENDS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_fused_block_forward_and_every_gradient(backend, dtype):
    ref64 = _grads(torch.float64, False, "reference")
    plain = _grads(dtype, False, backend)  # plain PyTorch on the backend's device
    fused = _grads(dtype, True, backend)
    for what, f, p, r in zip(("out", "dx", "dw_in", "dw_mid"), fused, plain, ref64):
        assert_within_rule(f, p, r, ATOL[dtype], what)


@pytest.mark.parametrize("unused", ["normed", "sum"])
def test_add_rms_norm_with_one_output_unused(unused):
    g = torch.Generator().manual_seed(3)
    x, r = (torch.randn(5, H, generator=g, dtype=torch.float64, requires_grad=True) for _ in range(2))
    w = torch.rand(H, generator=g, dtype=torch.float64).add(0.5).requires_grad_()
    s, y = torchfuser.functional.add_rms_norm(x, r, w, backend="reference")
    (y if unused == "sum" else s).pow(2).sum().backward()
    s_ref = x.detach() + r.detach()
    s_ref.requires_grad_()
    y_ref = torchfuser.functional.rms_norm(s_ref, w.detach(), backend="reference")
    (y_ref if unused == "sum" else s_ref).pow(2).sum().backward()
    torch.testing.assert_close(x.grad, s_ref.grad)
    torch.testing.assert_close(r.grad, s_ref.grad)
    assert (w.grad is None) == (unused == "normed")


def test_add_rms_norm_rejects_mismatched_shapes():
    with pytest.raises(ValueError, match="same shape"):
        torchfuser.functional.add_rms_norm(torch.randn(2, H), torch.randn(3, H), torch.ones(H))


# -- the pattern's probe ------------------------------------------------------------------------

class RMSNorm(nn.Module):
    """Llama's norm in the input's own precision (LlamaRMSNorm computes in fp32 even for fp64)."""

    def __init__(self, eps=1e-6):
        super().__init__()
        self.weight, self.variance_epsilon = nn.Parameter(torch.empty(H).uniform_(0.5, 1.5)), eps

    def forward(self, x):
        return self.weight * x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.variance_epsilon)


class _Attention(nn.Module):
    """Records the keywords it is called with."""

    def __init__(self):
        super().__init__()
        self.proj = nn.Linear(H, H)
        self.calls = []

    def forward(self, hidden_states, **kwargs):
        self.calls.append(kwargs)
        return self.proj(hidden_states), None


class Layer(nn.Module):
    """Llama's pre-norm layer."""

    def __init__(self):
        super().__init__()
        self.self_attn = _Attention()
        self.mlp = nn.Sequential(nn.Linear(H, 2 * H), nn.SiLU(), nn.Linear(2 * H, H))
        self.input_layernorm, self.post_attention_layernorm = RMSNorm(), RMSNorm()

    def forward(self, hidden_states, attention_mask=None, position_embeddings=None, **kwargs):
        residual = hidden_states
        h, _ = self.self_attn(hidden_states=self.input_layernorm(hidden_states), attention_mask=attention_mask,
                              position_embeddings=position_embeddings, **kwargs)
        h = residual + h
        return h + self.mlp(self.post_attention_layernorm(h))


class ScaledResidual(Layer):  # Granite's residual_multiplier
    def forward(self, hidden_states, **kwargs):
        h, _ = self.self_attn(hidden_states=self.input_layernorm(hidden_states), **kwargs)
        h = hidden_states + 0.5 * h
        return h + self.mlp(self.post_attention_layernorm(h))


class FunctionalDropout(Layer):  # a dropout between the blocks, configured at 0 today
    def __init__(self):
        super().__init__()
        self.resid_pdrop = 0.0

    def forward(self, hidden_states, **kwargs):
        h, _ = self.self_attn(hidden_states=self.input_layernorm(hidden_states), **kwargs)
        h = hidden_states + nn.functional.dropout(h, self.resid_pdrop, self.training)
        return h + self.mlp(self.post_attention_layernorm(h))


class DropsTheSum(FunctionalDropout):  # a dropout on the layer's output: no place the fused forward applies one at
    def forward(self, hidden_states, **kwargs):
        h, _ = self.self_attn(hidden_states=self.input_layernorm(hidden_states), **kwargs)
        h = hidden_states + h
        return nn.functional.dropout(h + self.mlp(self.post_attention_layernorm(h)), self.resid_pdrop, self.training)


class OwnArguments(Layer):  # passes the attention a value the caller did not give
    def forward(self, hidden_states, **kwargs):
        h, _ = self.self_attn(hidden_states=self.input_layernorm(hidden_states), output_attentions=False, **kwargs)
        h = hidden_states + h
        return h + self.mlp(self.post_attention_layernorm(h))


class Renamed(Layer):  # passes its argument on under another name, takes no **kwargs
    def forward(self, hidden_states, past_key_value=None):
        h, _ = self.self_attn(hidden_states=self.input_layernorm(hidden_states), past_key_values=past_key_value)
        h = hidden_states + h
        return h + self.mlp(self.post_attention_layernorm(h))


class MLPWithKeywords(Layer):  # the MLP gets the layer's keywords too
    def forward(self, hidden_states, **kwargs):
        h, _ = self.self_attn(hidden_states=self.input_layernorm(hidden_states), **kwargs)
        h = hidden_states + h
        return h + self.mlp(self.post_attention_layernorm(h), **kwargs)


class WithDropoutChild(Layer):  # Phi-3's resid_attn_dropout, p = 0
    def __init__(self):
        super().__init__()
        self.resid_attn_dropout = nn.Dropout(0.0)

    def forward(self, hidden_states, **kwargs):
        h, _ = self.self_attn(hidden_states=self.input_layernorm(hidden_states), **kwargs)
        h = hidden_states + self.resid_attn_dropout(h)
        return h + self.mlp(self.post_attention_layernorm(h))


class SqueezedInput(Layer):  # MiniMax-M3-VL's vision layers: the attention takes (tokens, hidden) rows
    def forward(self, hidden_states, **kwargs):
        h, _ = self.self_attn(hidden_states=self.input_layernorm(hidden_states).squeeze(0), **kwargs)
        h = hidden_states + h
        return h + self.mlp(self.post_attention_layernorm(h))


@pytest.mark.parametrize("cls, why", [
    (ScaledResidual, "is not the pre-norm x + attention"), (OwnArguments, "arguments of its own making"),
    (MLPWithKeywords, "more than their input"), (SqueezedInput, "reshapes the norm's output before the attention"),
])
def test_probe_rejects(cls, why):
    torch.manual_seed(0)
    result = ResidualNormPattern().match(cls())
    assert why in result.reason


def test_probe_finds_the_dropouts_between_the_blocks():
    """Placed where the fused forward applies them (``attention_dropout``), or kept off (``dropouts``)."""
    spec = ResidualNormPattern().match(WithDropoutChild())
    assert (spec.attention_dropout, spec.mlp_dropout, spec.dropouts) == ("resid_attn_dropout", None, ())
    spec = ResidualNormPattern().match(FunctionalDropout())
    assert (spec.attention_dropout, spec.float_dropouts) == ("resid_pdrop", ())
    spec = ResidualNormPattern().match(DropsTheSum())
    assert (spec.attention_dropout, spec.mlp_dropout, spec.float_dropouts) == (None, None, ("resid_pdrop",))
    assert ResidualNormPattern().match(Layer()).dropouts == ()


@pytest.mark.parametrize("cls, name", [(WithDropoutChild, "resid_attn_dropout"), (FunctionalDropout, "resid_pdrop")])
def test_a_placed_dropout_that_is_on_runs_fused_with_the_same_masks(cls, name, monkeypatch):
    ref, fused = _fused_pair(cls)
    x = torch.randn(2, 5, H, dtype=torch.float64)
    ran = []
    real = torchfuser.ops.add_rms_norm
    monkeypatch.setattr(torchfuser.ops, "add_rms_norm", lambda *a: ran.append(1) or real(*a))
    for model in (ref, fused):
        layer = model.layers[0]
        if isinstance(getattr(layer, name), nn.Module):
            getattr(layer, name).p = 0.5
        else:
            setattr(layer, name, 0.5)
    outs = []
    for model in (ref, fused):
        torch.manual_seed(7)
        outs.append(model(x))
    torch.testing.assert_close(outs[1], outs[0])  # the same dropout masks
    assert len(ran) == 2  # both layers fused
    torch.manual_seed(8)
    assert not torch.equal(fused(x), outs[1])  # the dropout is on: another seed, other masks


@pytest.mark.parametrize("cls, name", [(DropsTheSum, "resid_pdrop")])
def test_a_dropout_that_is_on_runs_the_original_forward(cls, name, monkeypatch):
    ref, fused = _fused_pair(cls)
    x = torch.randn(2, 5, H, dtype=torch.float64)
    ran = []
    real = torchfuser.ops.add_rms_norm
    monkeypatch.setattr(torchfuser.ops, "add_rms_norm", lambda *a: ran.append(1) or real(*a))
    torch.testing.assert_close(fused(x), ref(x))  # p = 0: fused
    assert ran
    for model in (ref, fused):
        layer = model.layers[0]
        if isinstance(getattr(layer, name), nn.Module):
            getattr(layer, name).p = 0.5
        else:
            setattr(layer, name, 0.5)
    ran.clear()
    outs = []
    for model in (ref, fused):
        torch.manual_seed(7)
        outs.append(model(x))
    torch.testing.assert_close(outs[1], outs[0])  # the same dropout masks: the original forward ran
    assert len(ran) == 1  # only the second layer, whose dropout is still off
    fused.eval(), ref.eval()
    torch.testing.assert_close(fused(x), ref(x))  # eval: dropouts off, fused again


def test_probe_reads_how_arguments_are_passed():
    spec = ResidualNormPattern().match(Renamed())
    assert spec.arguments == (("past_key_value", "past_key_values", None),) and not spec.passes_extra
    spec = ResidualNormPattern().match(Layer())
    assert spec.first == "hidden_states" and spec.attention_input == "hidden_states" and spec.passes_extra
    passed = [a[:2] for a in spec.arguments]
    assert passed == [("attention_mask", "attention_mask"), ("position_embeddings", "position_embeddings")]


# -- the installed forward ----------------------------------------------------------------------

class Stack(nn.Module):
    def __init__(self, cls=Layer):
        super().__init__()
        torch.manual_seed(0)
        self.layers = nn.ModuleList([cls(), cls()])

    def forward(self, x, **kwargs):
        for layer in self.layers:
            x = layer(x, **kwargs)
        return x


def _fused_pair(cls=Layer):
    ref = Stack(cls).double()
    fused = copy.deepcopy(ref)
    torchfuser.optimize(fused, backend="reference")
    assert all(isinstance(layer.__dict__.get("forward"), ResidualNormForward) for layer in fused.layers)
    return ref, fused


@pytest.mark.parametrize("cls, kwargs", [
    (Layer, dict(attention_mask="mask", extra=3)), (Renamed, dict(past_key_value="cache")),
])
def test_forward_gradients_and_arguments_as_the_original(cls, kwargs):
    ref, fused = _fused_pair(cls)
    x = torch.randn(2, 5, H, dtype=torch.float64)
    xs = [x.clone().requires_grad_() for _ in range(2)]
    outs = [m(t, **kwargs) for m, t in zip((ref, fused), xs)]
    torch.testing.assert_close(outs[1], outs[0])
    for out in outs:
        out.pow(2).sum().backward()
    torch.testing.assert_close(xs[1].grad, xs[0].grad)
    for p, q in zip(ref.parameters(), fused.parameters()):
        torch.testing.assert_close(q.grad, p.grad)
    for a, b in zip(ref.layers, fused.layers):
        assert b.self_attn.calls == a.self_attn.calls  # every keyword, same names and values


def test_calls_it_cannot_follow_run_the_original_forward():
    ref, fused = _fused_pair(Renamed)
    x = torch.randn(2, 5, H, dtype=torch.float64)
    with pytest.raises(TypeError, match="unexpected keyword"):  # as the original: no **kwargs
        fused(x, extra=1)
    torch.testing.assert_close(fused.layers[0](x, "cache"), ref.layers[0](x, "cache"))  # positional
    assert fused.layers[0].self_attn.calls[-1] == {"past_key_values": "cache"}


def test_restore_copy_replica_and_pickle():
    ref, fused = _fused_pair()
    x = torch.randn(2, 5, H, dtype=torch.float64)
    twin = copy.deepcopy(fused)
    assert all(layer.forward.layer is layer for layer in twin.layers)
    replica = fused.layers[0]._replicate_for_data_parallel()
    assert replica.forward.layer is replica
    buffer = io.BytesIO()
    torch.save(fused, buffer)
    loaded = torch.load(io.BytesIO(buffer.getvalue()), weights_only=False)
    for model in (twin, loaded):
        torch.testing.assert_close(model(x), ref(x))
    torchfuser.restore(fused)
    assert all("forward" not in layer.__dict__ for layer in fused.layers)
    torch.testing.assert_close(fused(x), ref(x))


def test_torch_compile_traces_the_original_forward(monkeypatch):
    """Under torch.compile Inductor fuses the adds itself: the layer's own forward is traced."""
    ref, fused = _fused_pair()
    x = torch.randn(2, 5, H, dtype=torch.float64)
    want = fused(x)

    def fail(self, kwargs):
        raise AssertionError("the fused forward ran under torch.compile")

    monkeypatch.setattr(ResidualNormForward, "_attention_kwargs", fail)
    torch._dynamo.reset()
    torch.testing.assert_close(torch.compile(fused, backend="eager", fullgraph=True)(x), want)


def test_hooks_on_the_norms_run_the_original_forward():
    ref, fused = _fused_pair()
    seen = []
    fused.layers[0].input_layernorm.register_forward_hook(lambda m, args, out: seen.append(out.shape))
    x = torch.randn(2, 5, H, dtype=torch.float64)
    torch.testing.assert_close(fused(x), ref(x))
    assert seen == [x.shape]  # the fused path would call the norm's kernel, not the module
