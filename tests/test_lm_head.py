"""The lm_head_loss pattern: HF's loss exactly (shift, ignore_index, num_items_in_batch, softcap),
logits never materialised, per-instance and reversible, and skips for logit transforms it does not know."""
from __future__ import annotations

import copy
import inspect

import pytest
import torch
from transformers import AutoConfig, AutoModelForCausalLM, LlamaConfig, LlamaForCausalLM

import torchfuser
from torchfuser.modules import FusedLMHeadLoss

from test_architectures import batch, make


def lm_pair(model_type="llama", **overrides):
    ref = make(model_type, **overrides)
    fused = copy.deepcopy(ref)
    torchfuser.optimize(fused, backend="reference", patterns=["lm_head_loss"])
    ref.train(), fused.train()
    return ref, fused


def both(ref, fused, **kwargs):
    a, b = ref(**kwargs), fused(**kwargs)
    return a, b


def assert_same_loss_and_grads(a, b, ref, fused):
    torch.testing.assert_close(b.loss, a.loss, rtol=1e-5, atol=1e-6)
    a.loss.backward()
    b.loss.backward()
    for (n, p), q in zip(ref.named_parameters(), fused.parameters()):
        torch.testing.assert_close(q.grad, p.grad, rtol=1e-4, atol=1e-6, msg=n)


def test_logits_are_never_materialised():
    _, fused = lm_pair()
    calls = []
    fused.lm_head.register_forward_hook(lambda m, i, o: calls.append(o.shape))
    ids, mask, labels = batch()
    out = fused(input_ids=ids, attention_mask=mask, labels=labels)
    assert "logits" not in out and out.loss.ndim == 0 and calls == []


def test_steps_after_the_first_build_no_tensor_from_host_values(monkeypatch):
    """``torch.tensor(values, device=cuda)`` is a blocking copy: made in every step, the host would
    wait there for the whole forward. The probe logits are made once per dtype and device."""
    _, fused = lm_pair()
    ids, mask, labels = batch()
    first = fused(input_ids=ids, attention_mask=mask, labels=labels).loss
    made = []
    real = torch.tensor
    monkeypatch.setattr(torch, "tensor", lambda *a, **k: made.append(a) or real(*a, **k))
    again = fused(input_ids=ids, attention_mask=mask, labels=labels).loss
    assert not [a for a in made if a and a[0] == torchfuser.modules.lm_head.PROBE_LOGITS]
    torch.testing.assert_close(again, first)


@pytest.mark.parametrize("case", ["ignore_index", "all_ignored_row", "num_items_tensor", "num_items_int", "shift_labels"])
def test_loss_matches_hf(case):
    ref, fused = lm_pair()
    ids, mask, labels = batch()
    kwargs = dict(input_ids=ids, attention_mask=mask, labels=labels)
    if case == "ignore_index":
        labels[0, ::2] = -100
    elif case == "all_ignored_row":
        labels[0] = -100
    elif case == "num_items_tensor":
        kwargs["num_items_in_batch"] = torch.tensor(37)
    elif case == "num_items_int":
        kwargs["num_items_in_batch"] = 11
    elif case == "shift_labels":  # context-parallel style: labels already shifted by the caller
        shifted = torch.nn.functional.pad(labels, (0, 1), value=-100)[:, 1:].contiguous()
        shifted[1, -3:] = -100
        kwargs["shift_labels"] = shifted
    assert_same_loss_and_grads(*both(ref, fused, **kwargs), ref, fused)


def test_custom_ignore_index_kwarg():
    ref, fused = lm_pair()
    ids, mask, labels = batch()
    labels[labels == -100] = 7
    labels[0, :4] = 7
    assert_same_loss_and_grads(*both(ref, fused, input_ids=ids, attention_mask=mask, labels=labels, ignore_index=7), ref, fused)


def test_all_labels_ignored_is_nan_like_hf():
    ref, fused = lm_pair()
    ids, mask, labels = batch()
    a, b = both(ref, fused, input_ids=ids, attention_mask=mask, labels=torch.full_like(labels, -100))
    assert torch.isnan(a.loss) and torch.isnan(b.loss)


@pytest.mark.parametrize("softcap", [30.0, 0.5, None])
def test_gemma2_final_logit_softcapping(softcap):
    ref, fused = lm_pair("gemma2", final_logit_softcapping=softcap)
    assert fused.__dict__["forward"].spec.softcap == softcap
    ids, mask, labels = batch()
    assert_same_loss_and_grads(*both(ref, fused, input_ids=ids, attention_mask=mask, labels=labels), ref, fused)


def test_return_dict_false_puts_loss_first():
    ref, fused = lm_pair()
    ids, mask, labels = batch()
    a = ref(input_ids=ids, attention_mask=mask, labels=labels, return_dict=False)
    b = fused(input_ids=ids, attention_mask=mask, labels=labels, return_dict=False)
    assert isinstance(b, tuple) and len(b) == len(a) - 1  # the logits (None) are left out
    torch.testing.assert_close(b[0], a[0], rtol=1e-5, atol=1e-6)


def test_eval_no_labels_and_logits_to_keep_run_the_original():
    ref, fused = lm_pair()
    ids, mask, labels = batch()
    with torch.no_grad():
        assert torch.equal(fused(input_ids=ids, attention_mask=mask).logits, ref(input_ids=ids, attention_mask=mask).logits)
        a, b = both(ref, fused, input_ids=ids, attention_mask=mask, logits_to_keep=3)
        assert torch.equal(b.logits, a.logits)
        with pytest.raises(ValueError):  # HF's own error for labels with sliced logits: the original ran
            fused(input_ids=ids, attention_mask=mask, labels=labels, logits_to_keep=3)
        ref.eval(), fused.eval()
        a, b = both(ref, fused, input_ids=ids, attention_mask=mask, labels=labels)
        assert torch.equal(b.logits, a.logits) and torch.equal(b.loss, a.loss)


def test_positional_labels():
    ref, fused = lm_pair()
    ids, mask, labels = batch()
    names = list(inspect.signature(type(ref).forward).parameters)[1:]
    args = [{"input_ids": ids, "attention_mask": mask, "labels": labels}.get(n) for n in names[: names.index("labels") + 1]]
    a, b = ref(*args), fused(*args)
    assert "logits" not in b
    torch.testing.assert_close(b.loss, a.loss, rtol=1e-5, atol=1e-6)


def test_per_instance_signature_kept_and_restore():
    ref, fused = lm_pair()
    other = make("llama")
    assert "forward" not in other.__dict__ and "forward" not in ref.__dict__
    assert isinstance(fused.__dict__["forward"], FusedLMHeadLoss)
    assert inspect.signature(fused.forward) == inspect.signature(ref.forward)  # generate()/Trainer inspect it
    torchfuser.restore(fused)
    assert "forward" not in fused.__dict__
    ids, mask, labels = batch()
    assert fused(input_ids=ids, attention_mask=mask, labels=labels).logits is not None


def test_forward_that_transforms_logits_unexpectedly_raises():
    # Softcapping switched on after optimize: the spec said none, the forward now applies one.
    _, fused = lm_pair("gemma2", final_logit_softcapping=None)
    fused.config.final_logit_softcapping = 5.0
    ids, mask, labels = batch()
    with pytest.raises(RuntimeError, match="exclude=\\['lm_head_loss'\\]"):
        fused(input_ids=ids, attention_mask=mask, labels=labels)


def _tiny(model_type, **kw):
    cfg = AutoConfig.for_model(model_type, hidden_size=64, num_hidden_layers=1, num_attention_heads=4,
                               num_key_value_heads=2, intermediate_size=128, vocab_size=128, pad_token_id=0,
                               bos_token_id=1, eos_token_id=2, **kw)
    return AutoModelForCausalLM.from_config(cfg)


class ShiftedLlamaForCausalLM(LlamaForCausalLM):
    """A logit transform that is no scale (logits + 1): the measured transform must say so."""

    def forward(self, input_ids=None, labels=None, **kwargs):
        out = super().forward(input_ids=input_ids, labels=labels, **kwargs)
        out.logits = out.logits + 1.0
        return out


def test_a_logit_transform_that_is_no_scale_is_skipped():
    cfg = LlamaConfig(hidden_size=64, num_hidden_layers=1, num_attention_heads=4, num_key_value_heads=2,
                      intermediate_size=128, vocab_size=128)
    model = ShiftedLlamaForCausalLM(cfg)
    torchfuser.optimize(model, backend="reference", patterns=["lm_head_loss"])
    (entry,) = torchfuser.report(model).entries
    assert not entry.is_fused and "not as a positive scale" in entry.reason
    assert "forward" not in model.__dict__


def test_custom_loss_function_is_skipped():
    model = make("llama")
    model.loss_function = lambda logits, labels, **kw: logits.sum()
    torchfuser.optimize(model, backend="reference", patterns=["lm_head_loss"])
    (entry,) = torchfuser.report(model).entries
    assert not entry.is_fused and "loss_function" in entry.reason


def test_data_parallel_replica_runs_its_own_modules():
    """nn.DataParallel copies the model's __dict__ (with the fused forward) into a replica per GPU:
    each replica's loss must come from that replica's modules, and restore takes the hook away."""
    ref, fused = lm_pair()
    replica = fused._replicate_for_data_parallel()
    assert replica.forward.model is replica and fused.forward.model is fused
    clone = copy.deepcopy(fused)  # a copy of the model follows its own replicas
    clone_replica = clone._replicate_for_data_parallel()
    assert clone_replica.forward.model is clone_replica and clone_replica._modules["model"] is clone.model
    torch.manual_seed(5)
    other = torch.nn.Linear(ref.lm_head.in_features, ref.lm_head.out_features, bias=False)
    replica._modules["lm_head"] = other
    ref.lm_head = copy.deepcopy(other)
    ids = batch(padded=False)[0]
    a, b = ref(input_ids=ids, labels=ids), replica(input_ids=ids, labels=ids)
    assert "logits" not in b  # the fused path ran
    torch.testing.assert_close(b.loss, a.loss, rtol=1e-5, atol=1e-6)
    torchfuser.restore(fused)
    assert "_replicate_for_data_parallel" not in fused.__dict__ and "forward" not in fused.__dict__


@pytest.mark.parametrize("model_type", ["mixtral", "qwen2_moe"])
def test_mixture_of_experts_router_loss_is_added_as_with_labels(model_type):
    """With output_router_logits the forward adds router_aux_loss_coef · aux_loss to the loss when it
    gets labels; the fused path calls it without labels, so it must add the same term itself."""
    cfg = AutoConfig.for_model(model_type, vocab_size=128, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                               num_attention_heads=4, num_key_value_heads=2, num_local_experts=4, num_experts=4,
                               moe_intermediate_size=32, shared_expert_intermediate_size=32, num_experts_per_tok=2,
                               output_router_logits=True, router_aux_loss_coef=0.5, pad_token_id=0)
    cfg._attn_implementation = "sdpa"
    torch.manual_seed(0)
    ref = AutoModelForCausalLM.from_config(cfg).float().train()
    fused = copy.deepcopy(ref)
    torchfuser.optimize(fused, backend="reference", patterns=["lm_head_loss"])
    ids = batch(padded=False)[0]
    a, b = ref(input_ids=ids, labels=ids), fused(input_ids=ids, labels=ids)
    assert "logits" not in b and a.aux_loss is not None
    torch.testing.assert_close(b.loss, a.loss, rtol=1e-5, atol=1e-6)
    assert_same_loss_and_grads(a, b, ref, fused)


@pytest.mark.parametrize("model_type, overrides, scale", [
    ("cohere", dict(logit_scale=0.25), 0.25),            # logits · logit_scale
    ("granite", dict(logits_scaling=4.0), 0.25),         # logits / logits_scaling
    ("hyperclovax", dict(logits_scaling=0.5), 0.5),      # logits · logits_scaling: same name, other way round
])
def test_logit_scale_is_measured_from_the_forward_and_reproduced(model_type, overrides, scale):
    """The logit scale is read off the model's own forward (decoder stubbed, head returning probe
    values), not guessed from the config's attribute names, then applied as (s·h)·Wᵀ."""
    cfg = AutoConfig.for_model(model_type, vocab_size=128, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                               num_attention_heads=4, num_key_value_heads=2, pad_token_id=0, **overrides)
    cfg._attn_implementation = "sdpa"
    torch.manual_seed(0)
    ref = AutoModelForCausalLM.from_config(cfg).float().train()
    fused = copy.deepcopy(ref)
    torchfuser.optimize(fused, backend="reference", patterns=["lm_head_loss"])
    assert fused.__dict__["forward"].spec.logit_scale == pytest.approx(scale)
    ids = batch(padded=False)[0]
    a, b = ref(input_ids=ids, labels=ids), fused(input_ids=ids, labels=ids)
    assert "logits" not in b
    assert_same_loss_and_grads(a, b, ref, fused)


def test_a_z_loss_is_skipped_with_the_reason():
    """Bamba adds z_loss_coefficient · mean(logsumexp(logits)²) to the loss when given labels."""
    cfg = LlamaConfig(hidden_size=64, num_hidden_layers=1, num_attention_heads=4, num_key_value_heads=2,
                      intermediate_size=128, vocab_size=128)
    model = LlamaForCausalLM(cfg)
    model.z_loss_coefficient = 1e-4
    torchfuser.optimize(model, backend="reference", patterns=["lm_head_loss"])
    (entry,) = torchfuser.report(model).entries
    assert not entry.is_fused and "z_loss_coefficient=0.0001" in entry.reason


def tied_pair():
    """A tied Llama whose padding row is among the tokens, with repeated tokens."""
    ref, fused = lm_pair(tie_word_embeddings=True, pad_token_id=5)
    assert fused.lm_head.weight is fused.model.embed_tokens.weight
    ids, mask, labels = batch()
    ids[0, :3] = 5  # the padding row gets no gradient from the embedding
    ids[1, 4:8] = 9  # one row's gradient summed over four tokens
    return ref, fused, dict(input_ids=ids, attention_mask=mask, labels=labels)


def vocab_sized_ops(prof, vocab):
    """The ATen ops of a profile that took a vocab-sized (V×H) tensor."""
    return {e.name for e in prof.events()
            if any(isinstance(s, list) and s[:1] == [vocab] and len(s) == 2 for s in e.input_shapes)}


def test_a_tied_input_embedding_adds_its_gradient_into_the_heads():
    """The tied weight's two gradients meet without a dense V×H embedding gradient or an add of
    two V×H tensors: the embedding's rows go into the head's gradient in place, which becomes W.grad."""
    ref, fused, kwargs = tied_pair()
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU], record_shapes=True) as prof:
        b = fused(**kwargs)
        b.loss.backward()
    a = ref(**kwargs)
    a.loss.backward()
    torch.testing.assert_close(b.loss, a.loss, rtol=1e-5, atol=1e-6)
    for (n, p), q in zip(ref.named_parameters(), fused.parameters()):
        torch.testing.assert_close(q.grad, p.grad, rtol=1e-5, atol=1e-6, msg=n)
    ops = vocab_sized_ops(prof, fused.config.vocab_size)
    assert "aten::index_put_" in ops
    assert not ops & {"aten::embedding_dense_backward", "aten::embedding_backward", "aten::add", "aten::add_",
                      "aten::clone", "aten::zeros", "aten::new_zeros"}, ops


def test_a_tied_embedding_gradient_accumulates_and_reaches_autograd_grad():
    ref, fused, kwargs = tied_pair()
    for _ in range(2):  # the second step adds to an existing W.grad
        ref(**kwargs).loss.backward()
        fused(**kwargs).loss.backward()
    for (n, p), q in zip(ref.named_parameters(), fused.parameters()):
        torch.testing.assert_close(q.grad, p.grad, rtol=1e-5, atol=1e-6, msg=n)
    (want,) = torch.autograd.grad(ref(**kwargs).loss, [ref.lm_head.weight])
    (got,) = torch.autograd.grad(fused(**kwargs).loss, [fused.lm_head.weight])
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)


def test_tied_embeddings_given_as_inputs_embeds_or_hooked_take_the_plain_path():
    ref, fused, kwargs = tied_pair()
    embeds = ref.model.embed_tokens(kwargs.pop("input_ids")).detach().requires_grad_()
    a, b = ref(inputs_embeds=embeds, **kwargs), fused(inputs_embeds=embeds, **kwargs)
    assert_same_loss_and_grads(a, b, ref, fused)
    calls = []
    fused.model.embed_tokens.register_forward_hook(lambda m, i, o: calls.append(o.shape))
    ref.zero_grad(), fused.zero_grad()
    _, _, kwargs = tied_pair()
    assert_same_loss_and_grads(*both(ref, fused, **kwargs), ref, fused)
    assert calls == [kwargs["input_ids"].shape + (fused.config.hidden_size,)]  # module hooks still run
    assert "forward" not in fused.model.embed_tokens.__dict__  # routed only during the fused call


def test_the_tied_embedding_backward_without_the_heads_gradient_is_nn_embeddings():
    """When the alias of W is not used (no head's gradient reaches the node), the embedding's
    backward returns its own dense gradient."""
    from torchfuser.modules import tied_embedding as te

    g = torch.Generator().manual_seed(3)
    weight = torch.randn(11, 6, generator=g, requires_grad=True)
    ids = torch.tensor([[1, 4, 4, 2], [4, 0, 1, 9]])
    up = torch.randn(2, 4, 6, generator=g)
    (want,) = torch.autograd.grad(torch.nn.functional.embedding(ids, weight, padding_idx=4), [weight], up)
    out, _alias = te._TiedEmbedding.apply(ids, weight, 4)
    (got,) = torch.autograd.grad(out, [weight], up)
    torch.testing.assert_close(got, want, rtol=0, atol=1e-6)
    assert got[4].abs().max() == 0


def test_the_tied_embedding_node_sums_out_of_place_when_building_a_graph():
    """create_graph: the head's gradient is a tensor of the graph being built, so the rows are added
    out of place, and the sum is differentiable in both gradients."""
    from torchfuser.modules import tied_embedding as te

    g = torch.Generator().manual_seed(4)
    weight = torch.randn(11, 6, generator=g, dtype=torch.float64, requires_grad=True)
    ids = torch.tensor([[1, 4, 4, 2], [4, 0, 1, 9]])
    up, head = torch.randn(2, 4, 6, generator=g, dtype=torch.float64), torch.randn(11, 6, generator=g, dtype=torch.float64)

    def loss(embed, alias):
        return (embed * up).sum() + (alias.sin() * head).sum()

    (want,) = torch.autograd.grad(loss(torch.nn.functional.embedding(ids, weight, padding_idx=4), weight), [weight],
                                  create_graph=True)
    (got,) = torch.autograd.grad(loss(*te._TiedEmbedding.apply(ids, weight, 4)), [weight], create_graph=True)
    torch.testing.assert_close(got, want, rtol=0, atol=1e-12)
    (ww,), (gg,) = torch.autograd.grad(want.square().sum(), [weight]), torch.autograd.grad(got.square().sum(), [weight])
    torch.testing.assert_close(gg, ww, rtol=0, atol=1e-12)


def test_a_fused_forward_pickled_before_the_probe_cache_loads_and_runs(tmp_path):
    _, fused = lm_pair()
    ids, mask, labels = batch()
    want = fused(input_ids=ids, attention_mask=mask, labels=labels).loss
    del fused.forward.probes  # as saved by a version without the cache
    torch.save(fused, tmp_path / "model.pt")
    loaded = torch.load(tmp_path / "model.pt", weights_only=False)
    torch.testing.assert_close(loaded(input_ids=ids, attention_mask=mask, labels=labels).loss, want)
    assert loaded.forward.probes


def test_a_tied_model_compiles_in_one_graph_with_the_plain_tied_gradient():
    """Under torch.compile the tied-embedding routing stays out of the trace (autograd's own sum)."""
    from torch._dynamo.utils import counters

    ref, fused, kwargs = tied_pair()
    counters.clear()
    b = torch.compile(fused, fullgraph=True, backend="eager")(**kwargs)
    assert not counters["graph_break"]
    assert "forward" not in fused.model.embed_tokens.__dict__
    assert_same_loss_and_grads(ref(**kwargs), b, ref, fused)
