"""Trust at the edges: what a plain model tolerates, its fused form must too, or not be fused.

Gated norms are left alone; fused modules answer the attribute reads their originals answered;
fused op outputs take in-place updates; empty inputs give what PyTorch gives; the meta device runs.
The same op cases on the compiled backends: tests/backends/test_edge_kernels.py.
"""
from __future__ import annotations

import contextlib
import copy
import inspect
import io

import pytest
import torch
from torch import nn

import torchfuser
from edge_cases import CASES, PassThrough, assert_same, outputs_and_grads, shapes
from torchfuser.modules.base import FusedModule


def _cases(empty: bool):
    return [pytest.param(name, shape, id=f"{name}-{label}") for name in CASES
            for label, shape in shapes(name, empty).items()]


# ------------------------------------------------------------------ ops: in place, empty, meta

@pytest.mark.parametrize("name,shape", _cases(empty=False))
@pytest.mark.parametrize("traced", [False, True], ids=["eager", "custom_op"])
def test_output_takes_inplace_update(name, shape, traced):
    """XLM does ``tensor *= mask`` on its norm's output: the fused op's output must allow it (no view
    of a custom Function), with the gradients of the unfused computation. ``custom_op``: under a
    function mode, the call goes through the registered custom op rather than the eager Function."""
    make, fused, plain, n_grad = CASES[name]
    inputs = make(shape)
    want = outputs_and_grads(plain, inputs, n_grad, inplace=name)
    with PassThrough() if traced else contextlib.nullcontext():
        got = outputs_and_grads(lambda *a: fused(*a, "reference"), inputs, n_grad, inplace=name)
    assert_same(got[0] + got[1], want[0] + want[1])


@pytest.mark.parametrize("name,shape", _cases(empty=True))
@pytest.mark.parametrize("backend", [None, "reference"])
def test_empty_input_gives_what_pytorch_gives(name, shape, backend):
    make, fused, plain, n_grad = CASES[name]
    inputs = make(shape)
    got = outputs_and_grads(lambda *a: fused(*a, backend), inputs, n_grad)
    want = outputs_and_grads(plain, inputs, n_grad)
    assert_same(got[0] + got[1], want[0] + want[1])


@pytest.mark.parametrize("name,shape", _cases(empty=False))
@pytest.mark.parametrize("backend", [None, "mlir", "triton"])
def test_op_runs_on_meta(name, shape, backend):
    """Shape propagation: outputs and gradients on the meta device with the shapes and dtypes of the
    unfused computation's, whichever backend was asked for (none has values to compute on)."""
    make, fused, plain, n_grad = CASES[name]
    inputs = make(shape)
    got = outputs_and_grads(lambda *a: fused(*a, backend), inputs, n_grad, device="meta")
    want = outputs_and_grads(plain, inputs, n_grad, device="meta")
    for g, w in zip(got[0] + got[1], want[0] + want[1], strict=True):
        assert (g.device.type, g.shape, g.dtype) == ("meta", w.shape, w.dtype)


# ------------------------------------------------------------------ gated norms

class GatedRMSNorm(nn.Module):
    """Mamba2's MambaRMSNormGated in short: x·silu(gate) normalised. Without a gate it is a plain
    RMSNorm, so the probe alone (which calls it with x only) would take it for one."""

    def __init__(self, hidden):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(hidden))
        self.variance_epsilon = 1e-6

    def forward(self, hidden_states, gate=None):
        if gate is not None:
            hidden_states = hidden_states * nn.functional.silu(gate)
        variance = hidden_states.pow(2).mean(-1, keepdim=True)
        return self.weight * hidden_states * torch.rsqrt(variance + self.variance_epsilon)


class ConditionedNorm(GatedRMSNorm):
    def forward(self, hidden_states, scale):  # a required further input
        return super().forward(hidden_states) * scale


class NormWithUnusedArg(GatedRMSNorm):
    def forward(self, hidden_states, unused=None):  # a further argument it never reads: still plain
        return super().forward(hidden_states)


class Gated(nn.Module):
    def __init__(self, norm):
        super().__init__()
        self.proj, self.norm = nn.Linear(8, 16), norm

    def forward(self, x):
        h, gate = self.proj(x).chunk(2, dim=-1)
        return self.norm(h, gate)


@pytest.mark.parametrize("norm,missing", [(GatedRMSNorm, "gate"), (ConditionedNorm, "scale")])
def test_norm_taking_more_than_x_is_skipped(norm, missing):
    model = Gated(norm(8))
    x = torch.randn(3, 8)
    want = model(x)
    torchfuser.optimize(model, backend="reference")
    assert type(model.norm) is norm
    (entry,) = torchfuser.report(model).skipped
    assert entry.name == "norm" and f"takes more than x ({missing})" in entry.reason
    torch.testing.assert_close(model(x), want)


def test_norm_with_an_unused_argument_is_fused():
    model = nn.Sequential(nn.Linear(8, 8), NormWithUnusedArg(8))
    torchfuser.optimize(model, backend="reference")
    assert isinstance(model[1], FusedModule)


def _gated_norm_class(module):
    """The gated RMSNorm class a transformers modeling module defines, found by shape rather than by name
    (transformers renames these: ``MambaRMSNormGated`` became ``Mamba2RMSNormGated`` in 5.25): an
    ``nn.Module`` whose name says norm and whose ``forward`` takes a ``gate``."""
    for obj in vars(module).values():
        if (isinstance(obj, type) and issubclass(obj, nn.Module) and obj.__module__ == module.__name__
                and "norm" in obj.__name__.lower() and "gate" in inspect.signature(obj.forward).parameters):
            return obj
    pytest.skip(f"{module.__name__} defines no gated norm (a norm whose forward takes a gate) in this transformers")


def test_transformers_gated_norm_is_skipped():
    mamba2 = pytest.importorskip("transformers.models.mamba2.modeling_mamba2")
    gated = _gated_norm_class(mamba2)
    sizes = {"group_size": 8} if "group_size" in inspect.signature(gated).parameters else {}
    model = nn.Sequential(nn.Linear(8, 8), gated(8, **sizes))  # group_size: transformers ≥ 5.2x
    torchfuser.optimize(model, backend="reference")
    assert type(model[1]) is gated
    assert "gate" in torchfuser.report(model).skipped[0].reason


# ------------------------------------------------------------------ attribute reads

def _tiny(model_type, **sizes):
    from transformers import AutoConfig, AutoModelForCausalLM

    torch.manual_seed(0)
    return AutoModelForCausalLM.from_config(AutoConfig.for_model(model_type, vocab_size=128, **sizes)).float()


def _models():
    llama = _tiny("llama", hidden_size=64, intermediate_size=128, num_hidden_layers=1, num_attention_heads=4,
                  num_key_value_heads=2)
    gpt2 = _tiny("gpt2", n_embd=64, n_layer=1, n_head=4, bos_token_id=0, eos_token_id=0)
    return [llama, gpt2]


def _plain_attrs(model):
    """{qualname: {attribute: value}} of every module's plain public instance attributes."""
    return {n: {k: v for k, v in vars(m).items() if not k.startswith("_") and k != "training"}
            for n, m in model.named_modules()}


def _fused(model):
    return {n: m for n, m in model.named_modules() if isinstance(m, FusedModule)}


def _check_reads(model, attrs):
    for name, module in _fused(model).items():
        for key, value in attrs[name].items():
            got = getattr(module, key)  # AttributeError is the failure this test is about
            if key not in vars(type(module)) and key not in module.__dict__:
                assert got is value or got == value, f"{name}.{key}"


def test_fused_modules_answer_the_originals_attribute_reads():
    kinds = set()
    for model in _models():
        attrs = _plain_attrs(model)
        torchfuser.optimize(model, backend="reference")
        kinds.update(type(m).__name__ for m in _fused(model).values())
        _check_reads(model, attrs)
    assert {"FusedRMSNorm", "FusedLayerNorm", "FusedGatedMLP", "FusedMLP", "FusedAttention"} <= kinds


def test_attribute_reads_by_class_and_misses():
    model = _models()[0]
    torchfuser.optimize(model, backend="reference")
    norm, mlp = model.model.norm, model.model.layers[0].mlp
    assert norm.variance_epsilon == 1e-6 and mlp.hidden_size == 64 and mlp.config is model.config
    assert callable(mlp.act_fn)  # a submodule the fused MLP does not hold
    assert norm.extra_repr().startswith("spec=")  # its own methods first
    with pytest.raises(AttributeError, match="FusedRMSNorm.*nor has the LlamaRMSNorm"):
        norm.no_such_attribute
    assert not hasattr(norm, "__deepcopy__")
    del norm._parameters["weight"]  # as FSDP1 does before it registers its flat parameter
    assert not hasattr(norm, "weight")  # absent, not the replaced module's (stale) parameter


def test_attribute_reads_survive_save_load_deepcopy_and_restore():
    model = _models()[0]
    keys = list(model.state_dict())
    torchfuser.optimize(model, backend="reference")
    assert list(model.state_dict()) == keys
    buf = io.BytesIO()
    torch.save(model, buf)
    buf.seek(0)
    loaded = torch.load(buf, weights_only=False)
    twin = copy.deepcopy(model)
    for m in (loaded, twin):
        norm = m.model.norm
        assert isinstance(norm, FusedModule) and norm.variance_epsilon == 1e-6
        assert norm.__dict__["_original"].weight is norm.weight  # one parameter, not a stale copy
        assert list(m.state_dict()) == keys
        torchfuser.restore(m)
        assert not _fused(m) and m.model.norm.weight is norm.weight
    assert twin.model.norm.weight is not model.model.norm.weight


# ------------------------------------------------------------------ a whole model on meta

def _meta_llama():
    from transformers import AutoConfig, AutoModelForCausalLM

    cfg = AutoConfig.for_model("llama", hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                               num_attention_heads=4, num_key_value_heads=2, vocab_size=128)
    with torch.device("meta"):
        return AutoModelForCausalLM.from_config(cfg)


def _meta_step(model):
    ids = torch.zeros(2, 12, dtype=torch.long, device="meta")
    loss = model(input_ids=ids, labels=ids).loss
    loss.backward()
    return loss


def test_fused_norms_run_a_meta_model():
    """The norms alone (the patterns owned by the ops' layer): forward and backward on meta."""
    model = _meta_llama()
    torchfuser.optimize(model, patterns=["rms_norm"])
    assert len(_fused(model)) == 5
    loss = _meta_step(model)
    assert loss.device.type == "meta" and model.model.norm.weight.grad.shape == (64,)


def test_fused_llama_runs_on_meta():
    model = _meta_llama()
    _meta_step(model)  # the plain model runs
    model.zero_grad(set_to_none=True)
    torchfuser.optimize(model)
    loss = _meta_step(model)
    assert loss.device.type == "meta" and model.model.layers[0].mlp.down_proj.weight.grad.shape == (64, 128)
