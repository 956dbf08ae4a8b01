"""Hugging Face gradient checkpointing on fused models: the fused layers are checkpointed (memory
measured, recompute counted), once, in either order of ``optimize`` and enabling it, reentrant and
not, and under the Trainer; loss and every gradient as unfused.

transformers 5.17 checkpoints a decoder layer in its ``__call__``, later versions in a wrapper of its
class's ``forward``, which the fused residual-norm forward (installed on the instance) bypasses:
``modules.residual_norm`` checkpoints its computation itself there. Memory is what the feature is
for, so it is measured: the bytes autograd saves for the backward (``saved_tensors_hooks``), counted
while the decoder layers run (the head and loss outside them differ fused and unfused).
"""
from __future__ import annotations

import copy
import functools
import warnings

import pytest
import torch
import transformers.modeling_utils
from transformers import LlamaConfig, LlamaForCausalLM

import torchfuser
from torchfuser.modules import FusedAttention, fallbacks
from torchfuser.modules.residual_norm import ResidualNormForward

from test_architectures import batch, make

LAYERS = 2


def _model(seed=0):
    cfg = LlamaConfig(hidden_size=64, intermediate_size=96, num_hidden_layers=LAYERS, num_attention_heads=4,
                      num_key_value_heads=2, vocab_size=128, attn_implementation="sdpa", use_cache=False)
    torch.manual_seed(seed)
    return LlamaForCausalLM(cfg)


def _enable(model, reentrant):
    kwargs = {"use_reentrant": reentrant}
    if hasattr(model, "activation_checkpointing_enable"):  # transformers 5.25; the older name warns there
        model.activation_checkpointing_enable(kwargs)
    else:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs=kwargs)


@pytest.fixture
def checkpoints(monkeypatch):
    """Counts calls of torch's checkpoint function through the one transformers binds at enable time."""
    calls = []
    real = transformers.modeling_utils.checkpoint

    @functools.wraps(real)
    def spy(function, *args, **kwargs):
        calls.append(function)
        return real(function, *args, **kwargs)

    monkeypatch.setattr(transformers.modeling_utils, "checkpoint", spy)
    return calls


class _Meter:
    """Saved-for-backward bytes packed while a decoder layer runs, and the attention calls (a
    checkpointed layer's attention runs again in the backward)."""

    def __init__(self, model):
        self.inside, self.bytes, self.attention_calls = 0, 0, 0
        self.handles = []
        for layer in model.model.layers:
            self.handles.append(layer.register_forward_pre_hook(lambda *_: self._enter()))
            self.handles.append(layer.register_forward_hook(lambda *_: self._leave()))
            self.handles.append(layer.self_attn.register_forward_pre_hook(lambda *_: self._attention()))

    def _enter(self):
        self.inside += 1

    def _leave(self):
        self.inside -= 1

    def _attention(self):
        self.attention_calls += 1

    def pack(self, t):
        if self.inside:
            self.bytes += t.numel() * t.element_size()
        return t

    def step(self, model, ids):
        """(loss, gradients) of one training step, the bytes and calls counted."""
        model.zero_grad(set_to_none=True)
        with torch.autograd.graph.saved_tensors_hooks(self.pack, lambda t: t):
            loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        for h in self.handles:
            h.remove()
        return loss.detach(), {n: p.grad.clone() for n, p in model.named_parameters()}


def _ids():
    return torch.randint(0, 128, (2, 64), generator=torch.Generator().manual_seed(4))


def _fused_layers(model):
    return [isinstance(layer.__dict__.get("forward"), ResidualNormForward)
            and isinstance(layer.self_attn, FusedAttention) for layer in model.model.layers]


def _same(loss, grads, loss_ref, grads_ref):
    torch.testing.assert_close(loss, loss_ref, rtol=1e-5, atol=1e-6)
    assert grads.keys() == grads_ref.keys()
    for name in grads_ref:
        torch.testing.assert_close(grads[name], grads_ref[name], rtol=1e-4, atol=1e-6, msg=name)


@pytest.mark.parametrize("reentrant", [True, False])
@pytest.mark.parametrize("order", ["optimize_first", "checkpointing_first"])
@pytest.mark.parametrize("backend", ["reference", "auto"])
def test_gradient_checkpointing_checkpoints_the_fused_layers(backend, order, reentrant, checkpoints):
    """Fused + checkpointing saves about what unfused + checkpointing saves inside the layers, far less
    than fused without; each layer is checkpointed once per step and recomputed in the backward, on
    the fused path (no fallback); loss and every gradient equal the unfused model's."""
    base, ids = _model(), _ids()
    runs = {}
    for name in ("unfused", "fused_plain", "unfused_ckpt", "fused_ckpt"):
        model = copy.deepcopy(base)
        fused, ckpt = name.startswith("fused"), name.endswith("ckpt")
        if ckpt and order == "checkpointing_first":
            _enable(model, reentrant)
        if fused:
            torchfuser.optimize(model, backend=backend)
            assert all(_fused_layers(model))
        if ckpt and order == "optimize_first":
            _enable(model, reentrant)
        meter, before = _Meter(model), len(checkpoints)
        loss, grads = meter.step(model, ids)
        runs[name] = (loss, grads, meter.bytes, meter.attention_calls, len(checkpoints) - before)
        assert not fallbacks.counts(model), fallbacks.counts(model)
    unfused_bytes, fused_bytes = runs["unfused_ckpt"][2], runs["fused_ckpt"][2]
    assert fused_bytes <= 1.1 * unfused_bytes + 4096, (fused_bytes, unfused_bytes)
    assert fused_bytes < 0.2 * runs["fused_plain"][2], (fused_bytes, runs["fused_plain"][2])
    # Checkpointed once per layer (never twice, nested), and each layer's forward ran again in the backward.
    assert runs["fused_ckpt"][3:] == runs["unfused_ckpt"][3:] == (2 * LAYERS, LAYERS)
    assert runs["fused_plain"][3:] == (LAYERS, 0)
    for name in ("fused_plain", "unfused_ckpt", "fused_ckpt"):
        _same(*runs[name][:2], *runs["unfused"][:2])


@pytest.mark.parametrize("kwargs", [None, {"use_reentrant": True}, {"use_reentrant": False}, "every_2nd_layer"])
@pytest.mark.parametrize("model_type", ["llama", "qwen2", "gpt2"])
def test_gradient_checkpointing_enable_then_train(model_type, kwargs, checkpoints):
    """What transformers' own checkpointing tests do (``gradient_checkpointing_enable``, every parameter
    trainable, a step): every parameter gets its gradient, equal to the unfused model's, and the layers
    transformers checkpoints (all, or every second with ``every_n_layers=2``) are checkpointed, once."""
    ref = make(model_type, use_cache=False)
    fused = torchfuser.optimize(copy.deepcopy(ref), backend="reference")
    every = 2 if kwargs == "every_2nd_layer" else 1
    grads, counts = [], []
    for m in (ref, fused):
        with warnings.catch_warnings():  # "gradient_checkpointing_enable is deprecated" (transformers 5.25)
            warnings.simplefilter("ignore", FutureWarning)
            m.gradient_checkpointing_enable(gradient_checkpointing_kwargs=None if every > 1 else kwargs,
                                            every_n_layers=every)
        m.train()
        for p in m.parameters():
            p.requires_grad_(True)
        ids, mask, labels = batch()
        before = len(checkpoints)
        loss = m(input_ids=ids, attention_mask=mask, labels=labels).loss
        counts.append(len(checkpoints) - before)
        loss.backward()
        assert all(p.grad is not None for p in m.parameters())
        grads.append((loss.detach(), {n: p.grad.clone() for n, p in m.named_parameters()}))
        torch.optim.SGD(m.parameters(), lr=0.01).step()
    _same(*grads[1], *grads[0])
    assert counts == [2 // every, 2 // every]
    assert not fallbacks.counts(fused), fallbacks.counts(fused)


def test_a_layer_that_falls_back_is_checkpointed_once(checkpoints):
    """A call the fused forward hands to the original (a hook on a norm) goes through transformers' own
    checkpointing of the layer: checkpointed once, not once more around it."""
    base, ids = _model(), _ids()
    model = torchfuser.optimize(copy.deepcopy(base), backend="reference")
    ref = copy.deepcopy(base)
    for m in (model, ref):
        _enable(m, False)
        m.model.layers[0].input_layernorm.register_forward_hook(lambda *_: None)
    meter = _Meter(model)
    loss, grads = meter.step(model, ids)
    assert len(checkpoints) == LAYERS and meter.attention_calls == 2 * LAYERS
    assert list(fallbacks.counts(model)) == ["model.layers.0"]
    ref_meter = _Meter(ref)
    _same(loss, grads, *ref_meter.step(ref, ids))
    assert meter.bytes <= 1.1 * ref_meter.bytes + 4096, (meter.bytes, ref_meter.bytes)


def test_checkpointing_off_again_and_in_eval_keeps_everything():
    """After gradient_checkpointing_disable the fused layers save their activations again, and in eval
    mode or without grad nothing is checkpointed (as transformers does)."""
    base, ids = _model(), _ids()
    model = torchfuser.optimize(copy.deepcopy(base), backend="reference")
    _enable(model, False)
    (model.activation_checkpointing_disable if hasattr(model, "activation_checkpointing_disable")
     else model.gradient_checkpointing_disable)()
    meter = _Meter(model)
    loss, grads = meter.step(model, ids)
    plain = torchfuser.optimize(copy.deepcopy(base), backend="reference")
    plain_meter = _Meter(plain)
    _same(loss, grads, *plain_meter.step(plain, ids))
    assert meter.attention_calls == LAYERS and meter.bytes == plain_meter.bytes
    _enable(model, False)
    model.eval()
    with torch.no_grad():
        torch.testing.assert_close(model(input_ids=ids).logits, base.eval()(input_ids=ids).logits, rtol=1e-5, atol=1e-5)


def test_trainer_gradient_checkpointing_checkpoints_the_fused_layers(tmp_path, checkpoints):
    """TrainingArguments(gradient_checkpointing=True) with the callback: the Trainer enables it after
    the callback fused the model; every layer is checkpointed, on the fused path, and it trains."""
    pytest.importorskip("accelerate")
    from transformers import Trainer, TrainingArguments

    model = _model()
    data = [{"input_ids": ids, "labels": ids} for ids in torch.randint(0, 128, (4, 16))]
    args = TrainingArguments(output_dir=str(tmp_path), per_device_train_batch_size=4, max_steps=1, save_strategy="no",
                             report_to=[], use_cpu=True, gradient_checkpointing=True)
    trainer = Trainer(model=model, args=args, train_dataset=data,
                      callbacks=[torchfuser.TorchFuserCallback(backend="reference")])
    assert all(_fused_layers(model))
    before = [p.detach().clone() for p in model.parameters()]
    trainer.train()
    assert len(checkpoints) == LAYERS
    assert not fallbacks.counts(model), fallbacks.counts(model)
    assert any(not torch.equal(a, p) for a, p in zip(before, model.parameters()))


@pytest.mark.skipif(not torch.cuda.is_available(), reason="the Triton kernels and CUDA graphs need a CUDA device")
@pytest.mark.parametrize("cuda_graphs", [False, True])
def test_gradient_checkpointing_on_cuda(cuda_graphs, checkpoints):
    """On the GPU (Triton kernels; with CUDA graphs, whose layers run eagerly while checkpointing is
    on): the fused layers are checkpointed once each, save what unfused ones save, and train alike."""
    base, ids = _model().cuda(), _ids().cuda()
    runs = {}
    for name in ("unfused_ckpt", "fused_ckpt"):
        model = copy.deepcopy(base)
        if name == "fused_ckpt":
            torchfuser.optimize(model, cuda_graphs=cuda_graphs)
            assert all(_fused_layers(model)) or cuda_graphs  # graphed: the stack's forward is on the instance
        _enable(model, False)
        meter, before = _Meter(model), len(checkpoints)
        loss, grads = meter.step(model, ids)
        runs[name] = (loss, grads, meter.bytes, meter.attention_calls, len(checkpoints) - before)
    fused_bytes, unfused_bytes = runs["fused_ckpt"][2], runs["unfused_ckpt"][2]
    assert fused_bytes <= 1.1 * unfused_bytes + 4096, (fused_bytes, unfused_bytes)
    assert runs["fused_ckpt"][3:] == runs["unfused_ckpt"][3:] == (2 * LAYERS, LAYERS)
    loss, grads = runs["fused_ckpt"][:2]
    torch.testing.assert_close(loss, runs["unfused_ckpt"][0], rtol=1e-4, atol=1e-5)
    for n, g in runs["unfused_ckpt"][1].items():
        torch.testing.assert_close(grads[n], g, rtol=1e-3, atol=1e-5, msg=n)
