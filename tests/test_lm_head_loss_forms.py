"""lm_head_loss at the edges: the loss form is learned from the model's own forward (shifted or
not, which keywords it honours), heads and scales that are not plain are skipped with the reason,
the capture head answers the real head's attributes, and labels outside the vocabulary raise."""
from __future__ import annotations

import copy

import pytest
import torch
from torch import nn
from transformers import AutoModelForCausalLM, LlamaConfig, LlamaForCausalLM

import torchfuser
from torchfuser.backends import unavailable_reason
from torchfuser.modules.lm_head import CaptureHead, LMHeadLossSpec

from arch_sweep import tiny_config
from numerics import assert_within_rule
from test_lm_head import assert_same_loss_and_grads, batch

V = 128


def _fuse(model, backend="reference"):
    fused = copy.deepcopy(model)
    torchfuser.optimize(fused, backend=backend, patterns=["lm_head_loss"])
    model.train(), fused.train()
    (entry,) = torchfuser.report(fused).entries
    return fused, entry


def _tiny(model_type):
    torch.manual_seed(0)
    return AutoModelForCausalLM.from_config(tiny_config(model_type)).float()


def _assert_exact(ref, fused):
    """Loss and every gradient of the fused model within the numerics rule of the unfused one's, both
    against the unfused model in float64 (a tiny gradient's last bits are not a fused error)."""
    ids, _, labels = batch()
    ref64 = copy.deepcopy(ref).double()
    a, b, c = ref(input_ids=ids, labels=labels), fused(input_ids=ids, labels=labels), ref64(input_ids=ids, labels=labels)
    assert "logits" not in b
    assert_within_rule(b.loss, a.loss, c.loss, 1e-6, "loss")
    for out in (a, b, c):
        out.loss.backward()
    for (n, p), q, p64 in zip(ref.named_parameters(), fused.parameters(), ref64.parameters()):
        if p.grad is None:  # a parameter the loss does not reach (BART's encoder): none either way
            assert q.grad is None and p64.grad is None, n
            continue
        assert_within_rule(q.grad, p.grad, p64.grad, 1e-6, n)


def _spec(fused) -> LMHeadLossSpec:
    return fused.__dict__["forward"].spec


@pytest.mark.parametrize("model_type", ["bart", "xlnet", "whisper", "cpmant"])
def test_unshifted_losses_are_learned_and_reproduced(model_type):
    """BART's decoder (and the others) take labels already shifted: CrossEntropyLoss(logits, labels)."""
    ref = _tiny(model_type)
    rng = torch.get_rng_state()
    fused, entry = _fuse(ref)
    assert torch.equal(rng, torch.get_rng_state()), "the probes drew from the global generator"
    assert entry.is_fused and _spec(fused).shift is False and _spec(fused).loss_kwargs == ()
    _assert_exact(ref, fused)


def test_hf_loss_is_learned_as_shifted_with_every_keyword():
    ref = _tiny("llama")
    fused, entry = _fuse(ref)
    assert _spec(fused).shift is True and set(_spec(fused).loss_kwargs) == {"num_items_in_batch", "ignore_index", "shift_labels"}


_CFG = LlamaConfig(hidden_size=64, num_hidden_layers=1, num_attention_heads=4, num_key_value_heads=2,
                   intermediate_size=128, vocab_size=V)


class FormLlamaForCausalLM(LlamaForCausalLM):
    """A causal LM computing its loss in one of several forms, from its own logits."""

    form = "unshifted"

    def forward(self, input_ids=None, labels=None, num_items_in_batch=None, **kwargs):
        out = super().forward(input_ids=input_ids, **kwargs)
        if labels is None:
            return out
        z, y = out.logits.float().reshape(-1, V), labels.reshape(-1)
        ce = nn.functional.cross_entropy
        if self.form == "unshifted":  # num_items_in_batch accepted but not used
            out.loss = ce(z, y)
        elif self.form == "unshifted_items":
            out.loss = ce(z, y) if num_items_in_batch is None else ce(z, y, reduction="sum") / num_items_in_batch
        elif self.form == "smoothed":
            out.loss = ce(z, y, label_smoothing=0.1)
        elif self.form == "items_doubled":
            out.loss = ce(z, y) * (1 if num_items_in_batch is None else 2)
        return out


def _form(form):
    torch.manual_seed(0)
    model = FormLlamaForCausalLM(_CFG)
    model.form = form
    return model


@pytest.mark.parametrize("items", [None, 5, torch.tensor(23)])
@pytest.mark.parametrize("form, kwargs", [("unshifted", ()), ("unshifted_items", ("num_items_in_batch",))])
def test_num_items_in_batch_is_honoured_only_where_the_forward_honours_it(form, kwargs, items):
    ref = _form(form)
    fused, entry = _fuse(ref)
    assert entry.is_fused and _spec(fused).shift is False and _spec(fused).loss_kwargs == kwargs
    ids, _, labels = batch()
    extra = {} if items is None else {"num_items_in_batch": items}
    assert_same_loss_and_grads(ref(input_ids=ids, labels=labels, **extra), fused(input_ids=ids, labels=labels, **extra),
                               ref, fused)


@pytest.mark.parametrize("form, reason", [
    ("smoothed", "not a cross-entropy of shifted or unshifted labels"),
    ("items_doubled", "with num_items_in_batch= given is neither"),
])
def test_a_loss_form_the_fused_loss_does_not_reproduce_is_skipped(form, reason):
    fused, entry = _fuse(_form(form))
    assert not entry.is_fused and reason in entry.reason
    assert "forward" not in fused.__dict__


class ParamScaleLlamaForCausalLM(LlamaForCausalLM):
    """Logits times a learnable scale read from a parameter of the model's top level."""

    def __init__(self, cfg):
        super().__init__(cfg)
        self.temperature = nn.Parameter(torch.tensor(0.5))

    def forward(self, input_ids=None, labels=None, **kwargs):
        out = super().forward(input_ids=input_ids, **kwargs)
        out.logits = out.logits * self.temperature
        if labels is not None:
            out.loss = self.loss_function(out.logits, labels, V)
        return out


def test_a_logit_scale_from_a_parameter_is_skipped():
    """Measured once it would be baked in as a constant: stale after a step, and no gradient."""
    torch.manual_seed(0)
    fused, entry = _fuse(ParamScaleLlamaForCausalLM(_CFG))
    assert not entry.is_fused and "parameter" in entry.reason and "no gradient" in entry.reason


def test_dory_head_with_a_learnable_logit_scale_is_skipped():
    from transformers import CONFIG_MAPPING

    if "dory" not in CONFIG_MAPPING:
        pytest.skip("this transformers has no Dory")
    fused, entry = _fuse(_tiny("dory"))
    assert not entry.is_fused and "logit_scale" in entry.reason and "plain nn.Linear" in entry.reason


class DoubledHead(nn.Linear):
    def forward(self, x):
        return super().forward(x) * 2


@pytest.mark.parametrize("how", ["subclass forward", "instance forward", "forward hook"])
def test_a_head_that_is_no_plain_linear_is_skipped(how):
    torch.manual_seed(0)
    model = LlamaForCausalLM(_CFG)
    old = model.lm_head
    if how == "subclass forward":
        model.lm_head = DoubledHead(old.in_features, old.out_features, bias=False)
    elif how == "instance forward":
        model.lm_head.forward = lambda x: nn.Linear.forward(old, x) * 2
    else:
        model.lm_head.register_forward_hook(lambda m, i, o: o * 2)
    torchfuser.optimize(model, backend="reference", patterns=["lm_head_loss"])
    (entry,) = torchfuser.report(model).entries
    assert not entry.is_fused and "plain nn.Linear" in entry.reason


def test_capture_head_answers_the_real_heads_attributes():
    real = nn.Linear(8, 5, bias=True)
    capture = CaptureHead(real=real)
    assert capture.weight is real.weight and capture.bias is real.bias and capture.in_features == 8
    assert list(capture.parameters()) == []  # not a submodule: the model's parameters are not doubled
    with pytest.raises(AttributeError):
        capture.no_such_attribute  # noqa: B018
    with pytest.raises(AttributeError):
        CaptureHead().weight  # noqa: B018


@pytest.mark.parametrize("model_type", ["mamba", "falcon_mamba"])
def test_a_forward_reading_the_heads_weight_dtype_is_fused_exactly(model_type):
    """``self.lm_head(h.to(self.lm_head.weight.dtype))``: the capture head must answer ``weight``."""
    ref = _tiny(model_type)
    fused, entry = _fuse(ref)
    assert entry.is_fused
    _assert_exact(ref, fused)


def test_prophetnet_is_skipped_with_the_reason():
    """Its head sees n-gram streams (B, n, S, H) for labels (B, S), and its loss is its own."""
    ref = _tiny("prophetnet")
    fused, entry = _fuse(ref)
    assert not entry.is_fused and "loss_function" in entry.reason
    # Fused anyway (a spec forced past the pattern), the shape mismatch is a clear error, not a ValueError deep down.
    from torchfuser.modules.lm_head import FusedLMHeadLoss
    fused.__dict__["forward"] = FusedLMHeadLoss(fused, LMHeadLossSpec(head="lm_head", shift=False, loss_kwargs=()), "reference")
    ids, _, labels = batch()
    with pytest.raises(RuntimeError, match="one label per position.*exclude=\\['lm_head_loss'\\]"):
        fused.train()(input_ids=ids, labels=labels)


@pytest.mark.parametrize("backend", ["reference", "mlir"])
@pytest.mark.parametrize("bad", [V, -5])
def test_labels_outside_the_vocabulary_raise_through_the_fused_head(backend, bad):
    if backend == "mlir" and unavailable_reason("mlir", "cpu"):
        pytest.skip(unavailable_reason("mlir", "cpu"))
    ref = _tiny("llama")
    fused, _ = _fuse(ref, backend)
    ids, _, labels = batch()
    labels[0, 4] = bad
    with pytest.raises(IndexError):  # PyTorch's own message differs; both raise
        ref(input_ids=ids, labels=labels)
    with pytest.raises(IndexError, match=f"label {bad} is outside the vocabulary \\[0, {V}\\)"):
        fused(input_ids=ids, labels=labels)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="the in-kernel flag is the CUDA path")
@pytest.mark.parametrize("bad", [V, -5])
def test_labels_outside_the_vocabulary_give_a_nan_loss_on_cuda(bad):
    """On CUDA a host check would wait for the GPU every step: the loss is NaN instead, with no raise,
    in eager and under CUDA graphs; the same batch with the label fixed is finite."""
    ref = _tiny("llama").cuda()
    for graphs in (False, True):
        fused = torchfuser.optimize(copy.deepcopy(ref), cuda_graphs=graphs).train()
        ids, _, labels = (t.cuda() for t in batch())
        for _ in range(3):  # capture, then replays
            good = fused(input_ids=ids, labels=labels, use_cache=False).loss
            good.backward()
            assert torch.isfinite(good)
        labels[0, 4] = bad
        loss = fused(input_ids=ids, labels=labels, use_cache=False).loss
        loss.backward()
        assert torch.isnan(loss), (graphs, loss)


class DtypeLlamaForCausalLM(LlamaForCausalLM):
    """Mamba's way: the head's input cast to ``self.lm_head.weight.dtype``, then HF's loss."""

    def forward(self, input_ids=None, labels=None, **kwargs):
        from transformers.modeling_outputs import CausalLMOutputWithPast

        h = self.model(input_ids=input_ids).last_hidden_state
        logits = self.lm_head(h.to(self.lm_head.weight.dtype))
        loss = None if labels is None else self.loss_function(logits, labels, V, **kwargs)
        return CausalLMOutputWithPast(loss=loss, logits=logits)


def test_reading_the_heads_weight_compiles_in_one_graph():
    from torch._dynamo.utils import counters

    torch.manual_seed(0)
    ref = DtypeLlamaForCausalLM(_CFG)
    fused, entry = _fuse(ref)
    assert entry.is_fused
    ids, _, labels = batch()
    counters.clear()
    b = torch.compile(fused, fullgraph=True, backend="eager")(input_ids=ids, labels=labels)
    assert not counters["graph_break"] and "logits" not in b
    assert_same_loss_and_grads(ref(input_ids=ids, labels=labels), b, ref, fused)
