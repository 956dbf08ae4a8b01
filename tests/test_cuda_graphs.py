"""optimize(model, cuda_graphs=True): decoder layers captured into CUDA graphs and replayed.

The oracle is the same fused model without graphs: a replay runs the very kernels the eager
call runs, so losses and every gradient must agree to rounding, step after step, through the
optimizer. The GPU tests run on the device machine; on the CPU the install path is checked.
"""
from __future__ import annotations

import copy
import functools
import warnings

import pytest
import torch
from transformers import AutoConfig, AutoModelForCausalLM

import torchfuser
from torchfuser import cuda_graphs

cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA graphs need a CUDA device")
VOCAB = 256


def tiny_llama(device="cpu", layers=3, attn="sdpa", family="llama"):
    shape = dict(hidden_size=128, intermediate_size=256, num_hidden_layers=layers, num_attention_heads=4,
                 num_key_value_heads=2, vocab_size=VOCAB, attn_implementation=attn)
    if family == "gpt2":
        shape = dict(n_embd=128, n_layer=layers, n_head=4, vocab_size=VOCAB, attn_implementation=attn,
                     resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0, bos_token_id=0, eos_token_id=0)
    cfg = AutoConfig.for_model(family, **shape)
    torch.manual_seed(0)
    return AutoModelForCausalLM.from_config(cfg).to(device).train()


def test_split_and_join_call_round_trip():
    x, cos, sin = torch.randn(2, 3), torch.randn(3), torch.randn(3)
    args, kwargs = (x,), {"attention_mask": None, "position_embeddings": (cos, sin), "use_cache": False, "k": 2}
    layout, tensors = cuda_graphs.split_call(args, kwargs)
    assert [t is u for t, u in zip(tensors, (x, cos, sin))] == [True] * 3
    args2, kwargs2 = cuda_graphs.join_call(layout, tensors)
    assert args2[0] is x and kwargs2["position_embeddings"] == (cos, sin)
    assert kwargs2 == {**kwargs, "position_embeddings": kwargs2["position_embeddings"]}
    # True and 1 hash alike: the layout keeps their types apart, so they are different signatures.
    assert cuda_graphs.split_call((x,), {"k": True})[0] != cuda_graphs.split_call((x,), {"k": 1})[0]
    layout, name = cuda_graphs.split_call((x,), {"cache": object()})
    assert layout is None and name == "object"
    # The loss's token count reaches the layers but not their math: it is no part of a signature.
    assert cuda_graphs.split_call((x,), {"num_items_in_batch": 7}) == cuda_graphs.split_call((x,), {})


def test_cpu_model_is_left_alone_with_a_reason():
    model = tiny_llama()
    torchfuser.optimize(model, backend="reference", cuda_graphs=True)
    notes = [n for n in torchfuser.report(model).notes if n.startswith("cuda graphs")]
    assert notes == ["cuda graphs: not used for model.layers — the model is on cpu: move it to a CUDA device "
                     "before optimize(..., cuda_graphs=True)"]
    assert type(model.model.layers[0].__dict__["forward"]).__name__ == "ResidualNormForward"  # no graph


def test_install_and_restore_on_a_stand_in_device(monkeypatch):
    """What install does to a model, checked on the CPU by letting it through the CUDA check."""
    monkeypatch.setattr(cuda_graphs, "_unsupported", lambda model, layers: None)
    model = tiny_llama()
    torchfuser.optimize(model, backend="reference", cuda_graphs=True)
    layers = model.model.layers
    assert all(isinstance(layer.__dict__.get("forward"), functools.partial) for layer in layers)
    notes = torchfuser.report(model).notes
    assert "cuda graphs: model.layers (3 × LlamaDecoderLayer): captured at the first training step" in notes
    assert any("use_cache is True" in n for n in notes)
    assert list(model.state_dict()) == list(tiny_llama().state_dict())
    torchfuser.optimize(model, cuda_graphs=True)  # again: nothing installed twice
    assert len(model.__dict__[cuda_graphs._ATTR]) == 1
    # The graphs capture the layers' fused forwards (residual adds inside the norms) and put them back.
    fused_forwards = _stack(model).forwards
    assert all(type(f).__name__ == "ResidualNormForward" and f.layer is layer for f, layer in zip(fused_forwards, layers))
    cuda_graphs.remove(model)
    assert [layer.__dict__["forward"] for layer in layers] == fused_forwards
    torchfuser.restore(model)
    assert all("forward" not in layer.__dict__ for layer in layers) and cuda_graphs.describe(model) is None


def test_unfused_model_has_no_stack():
    model = tiny_llama()
    torchfuser.optimize(model, backend="reference", patterns=["lm_head_loss"], cuda_graphs=True)
    assert any("no stack of fused layers" in n for n in torchfuser.report(model).notes)


# ---------------------------------------------------------------------------------------------- GPU


def _step(model, ids, opt=None, autocast=False):
    return _batch_step(model, {"input_ids": ids, "labels": ids}, opt, autocast)


def _batch_step(model, batch, opt=None, autocast=False):
    with torch.autocast("cuda", dtype=torch.bfloat16, enabled=autocast):
        loss = model(**batch, use_cache=False).loss
    loss.backward()
    grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    if opt is not None:
        opt.step()
        opt.zero_grad(set_to_none=True)
    return loss.detach(), grads


def _pair(**kw):
    """The same fused model twice (same seed), the second one graphed."""
    return (torchfuser.optimize(tiny_llama("cuda", **kw), cuda_graphs=False),
            torchfuser.optimize(tiny_llama("cuda", **kw), cuda_graphs=True))


def _close_to(a, b, what, rtol, atol):
    assert a.keys() == b.keys(), what
    for n in a:
        torch.testing.assert_close(a[n], b[n], rtol=rtol, atol=atol, msg=lambda m: f"{what}: {n}\n{m}")


_close = functools.partial(_close_to, rtol=2e-5, atol=2e-6)


def _stack(model):
    return model.__dict__[cuda_graphs._ATTR][0]


@cuda
@pytest.mark.parametrize("autocast", [False, True], ids=["fp32", "bf16-autocast"])
def test_graphed_training_matches_eager(autocast):
    plain, graphed = _pair()
    opts = [torch.optim.AdamW(m.parameters(), lr=1e-3) for m in (plain, graphed)]
    gen = torch.Generator().manual_seed(1)
    for step in range(4):
        ids = torch.randint(0, VOCAB, (2, 32), generator=gen).cuda()
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            (la, ga), (lb, gb) = (_step(m, ids, o, autocast) for m, o in zip((plain, graphed), opts))
        # No cross-stream gradient accumulation: the accumulators were made on the caller's stream.
        assert not [w for w in caught if "AccumulateGrad node's stream" in str(w.message)]
        torch.testing.assert_close(la, lb, rtol=2e-5, atol=2e-6)
        _close(ga, gb, f"step {step}")
    stack = _stack(graphed)
    assert stack.captures == 1 and stack.replays == 4 * 3 and not stack.eager  # step 0 captures in layer 0's call
    note = next(n for n in torchfuser.report(graphed).notes if n.startswith("cuda graphs: model.layers"))
    assert "12 layer calls replayed, 1 capture(s)" in note


@cuda
@pytest.mark.parametrize("family", ["qwen2", "gpt2"])
def test_other_families_and_autograd_grad(family):
    plain, graphed = _pair(family=family)
    ids = torch.randint(0, VOCAB, (2, 16)).cuda()
    for _ in range(2):
        (la, ga), (lb, gb) = _step(plain, ids), _step(graphed, ids)
        torch.testing.assert_close(la, lb, rtol=2e-5, atol=2e-6)
        _close(ga, gb, family)
        for m in (plain, graphed):
            m.zero_grad(set_to_none=True)
    assert _stack(graphed).replays == 2 * 3 and not _stack(graphed).eager
    # torch.autograd.grad gets the gradients without touching .grad
    grads = [torch.autograd.grad(m(input_ids=ids, labels=ids, use_cache=False).loss, list(m.parameters()), allow_unused=True)
             for m in (plain, graphed)]
    for a, b in zip(*grads):
        assert (a is None) == (b is None)
        if a is not None:
            torch.testing.assert_close(a, b, rtol=2e-5, atol=2e-6)
    assert all(p.grad is None for p in graphed.parameters())


@cuda
@pytest.mark.parametrize("autocast", [False, True], ids=["fp32", "bf16-autocast"])
def test_mixture_of_experts_layers_are_captured(autocast):
    """Fused MoE blocks (router, sort, grouped GEMMs: no host sync) replay in the layers' graphs under bf16
    autocast. In fp32 the experts' grouped GEMMs read the group sizes back to the host (torch 2.11's CUDA
    fp32 path), which the warm-up finds: the layers run eagerly, with that reason, and compute the same."""
    from arch_sweep import tiny_config

    def build():
        torch.manual_seed(0)
        return AutoModelForCausalLM.from_config(tiny_config("qwen3_moe")).cuda().train()

    plain, graphed = torchfuser.optimize(build()), torchfuser.optimize(build(), cuda_graphs=True)
    assert any(e.pattern == "moe" and e.is_fused for e in torchfuser.report(graphed).entries)
    gen = torch.Generator().manual_seed(1)
    for step in range(3):
        ids = torch.randint(0, 128, (2, 16), generator=gen).cuda()
        (la, ga), (lb, gb) = _step(plain, ids, autocast=autocast), _step(graphed, ids, autocast=autocast)
        tol = dict(rtol=2e-2, atol=2e-3) if autocast else dict(rtol=2e-5, atol=2e-6)
        torch.testing.assert_close(la, lb, **tol)
        _close_to(ga, gb, f"step {step}", **tol)
        for m in (plain, graphed):
            m.zero_grad(set_to_none=True)
    stack = _stack(graphed)
    if autocast or not stack.disabled:  # a torch whose fp32 grouped GEMM needs no host read captures fp32 too
        assert stack.captures == 1 and stack.replays > 0 and not stack.eager
    else:
        assert "reads tensor values on the host" in stack.disabled and stack.replays == 0
        assert any(stack.disabled in n for n in torchfuser.report(graphed).notes)  # the report says why


@cuda
@pytest.mark.parametrize("set_to_none", [True, False])
def test_gradient_accumulation_across_backwards(set_to_none):
    plain, graphed = _pair()
    gen = torch.Generator().manual_seed(2)
    batches = [torch.randint(0, VOCAB, (2, 16), generator=gen).cuda() for _ in range(3)]
    for model in (plain, graphed):
        model(input_ids=batches[0], labels=batches[0], use_cache=False).loss.backward()  # capture
        model.zero_grad(set_to_none=set_to_none)
        for ids in batches[1:]:  # two micro-batches summed into .grad
            model(input_ids=ids, labels=ids, use_cache=False).loss.backward()
    grads = [{n: p.grad for n, p in m.named_parameters()} for m in (plain, graphed)]
    _close(*grads, "accumulated")


@cuda
def test_two_forwards_before_one_backward_fall_back():
    plain, graphed = _pair()
    a, b = (torch.randint(0, VOCAB, (2, 16)).cuda() for _ in range(2))
    for model in (plain, graphed):
        model.zero_grad(set_to_none=True)
        model(input_ids=a, labels=a, use_cache=False).loss.backward()  # graphed captures here
        model.zero_grad(set_to_none=True)
        loss = model(input_ids=a, labels=a, use_cache=False).loss + model(input_ids=b, labels=b, use_cache=False).loss
        loss.backward()
    _close(*({n: p.grad for n, p in m.named_parameters()} for m in (plain, graphed)), "two forwards")
    assert _stack(graphed).eager["an earlier forward of this layer still waits for its backward"] == 3


@cuda
def test_second_backward_through_a_replay_raises():
    _, graphed = _pair()
    ids = torch.randint(0, VOCAB, (2, 16)).cuda()
    _step(graphed, ids)  # capture
    # The decoder's output, not the fused loss (which refuses a second backward itself).
    loss = graphed.model(input_ids=ids, use_cache=False).last_hidden_state.square().mean()
    loss.backward(retain_graph=True)
    with pytest.raises(RuntimeError, match="second backward"):
        loss.backward()


@cuda
def test_new_shape_recaptures_and_leaf_input_grads_accumulate():
    plain, graphed = _pair()
    for seq in (16, 24, 16):  # lengths that are buckets of their own
        ids = torch.randint(0, VOCAB, (2, seq)).cuda()
        ga, gb = (_step(m, ids)[1] for m in (plain, graphed))
        _close(ga, gb, f"seq {seq}")
        for m in (plain, graphed):
            m.zero_grad(set_to_none=True)
    assert _stack(graphed).captures == 2  # 16's graphs are kept for its second step
    # Gradients reaching a leaf input are the caller's to keep: two backwards add up.
    embeds = [m.model.embed_tokens(ids).detach().requires_grad_() for m in (plain, graphed)]
    for m, e in zip((plain, graphed), embeds):
        for _ in range(2):
            m(inputs_embeds=e, labels=ids, use_cache=False).loss.backward()
    torch.testing.assert_close(embeds[0].grad, embeds[1].grad, rtol=2e-5, atol=2e-6)


def _batch(seq, gen, padded_rows):
    """2 × ``seq`` tokens; with ``padded_rows`` the second row's last quarter is padding (labels −100)."""
    ids = torch.randint(0, VOCAB, (2, seq), generator=gen)
    mask = torch.ones(2, seq, dtype=torch.long)
    if padded_rows:
        mask[1, seq - seq // 4:] = 0
    return {"input_ids": ids.cuda(), "attention_mask": mask.cuda(), "labels": ids.masked_fill(mask == 0, -100).cuda()}


def _masked_step(model, batch, opt=None):
    out = _batch_step(model, batch, opt)
    model.zero_grad(set_to_none=True)
    return out


@cuda
@pytest.mark.parametrize("padded_rows", [False, True], ids=["causal", "padded-rows"])
def test_varying_lengths_replay_length_buckets(padded_rows):
    """Lengths 9–31 fall in the buckets 16 and 32: two captures serve every step, each call padded inside
    the graph path; losses and every gradient follow the unpadded eager model through AdamW steps."""
    plain, graphed = _pair()
    opts = [torch.optim.AdamW(m.parameters(), lr=1e-3) for m in (plain, graphed)]
    gen = torch.Generator().manual_seed(4)
    for step, seq in enumerate((13, 16, 9, 30, 14, 31, 25, 16)):
        batch = _batch(seq, gen, padded_rows)
        (la, ga), (lb, gb) = (_masked_step(m, batch, o) for m, o in zip((plain, graphed), opts))
        torch.testing.assert_close(la, lb, rtol=1e-4, atol=1e-5)
        _close_to(ga, gb, f"step {step} (length {seq})", rtol=1e-4, atol=1e-5)
    stack = _stack(graphed)
    assert stack.captures == 2 and stack.checked and not stack.eager and stack.served == {16: 5, 32: 3}
    note = next(n for n in torchfuser.report(graphed).notes if n.startswith("cuda graphs: model.layers"))
    assert "length buckets (16: 5 steps, 80% hits, 32: 3 steps, 67% hits); 2 set(s) kept (max 8)" in note


@cuda
@pytest.mark.parametrize("options", [cuda_graphs.GraphOptions(max_buckets=1), cuda_graphs.GraphOptions(pool_gib=1e-6)],
                         ids=["max_buckets", "pool_gib"])
def test_lengths_beyond_the_bounds_drop_sets_then_stay_eager(options):
    plain = torchfuser.optimize(tiny_llama("cuda"), cuda_graphs=False)
    graphed = torchfuser.optimize(tiny_llama("cuda"), cuda_graphs=options)
    gen = torch.Generator().manual_seed(5)
    for seq in (16, 32, 16, 32, 16):
        batch = _batch(seq, gen, False)
        (la, ga), (lb, gb) = _masked_step(plain, batch), _masked_step(graphed, batch)
        torch.testing.assert_close(la, lb, rtol=1e-4, atol=1e-5)
        _close_to(ga, gb, f"length {seq}", rtol=1e-4, atol=1e-5)
    stack = _stack(graphed)
    assert stack.captures == 3 and stack.dropped == 2 and len(stack.sets) == 1
    assert stack.disabled.startswith("lengths kept leaving the") and stack.eager[stack.disabled] == 2 * 3


@cuda
def test_packed_rows_run_eagerly_with_the_reason():
    plain, graphed = _pair()
    ids = torch.randint(0, VOCAB, (1, 24)).cuda()
    pos = torch.cat([torch.arange(10), torch.arange(14)])[None].cuda()  # two samples in one row
    for _ in range(2):
        la, lb = (m(input_ids=ids, position_ids=pos, labels=ids, use_cache=False).loss for m in (plain, graphed))
        torch.testing.assert_close(la, lb, rtol=1e-5, atol=1e-6)
        lb.backward()
    stack = _stack(graphed)
    assert stack.replays == 0 and [w for w in stack.eager if w.startswith("packed rows")] and stack.eager.total() == 6


@cuda
def test_frozen_embeddings_as_under_lora():
    """LoRA trains a few weights and freezes the embeddings: layer 0's hidden state needs no grad while
    every later layer's does, so each layer's graphs are captured with its own."""
    plain, graphed = _pair()
    for m in (plain, graphed):
        for n, p in m.named_parameters():
            p.requires_grad_("q_proj" in n or "down_proj" in n)
    gen = torch.Generator().manual_seed(6)
    for step in range(3):
        batch = _batch(24, gen, padded_rows=False)
        (la, ga), (lb, gb) = _masked_step(plain, batch), _masked_step(graphed, batch)
        torch.testing.assert_close(la, lb, rtol=1e-4, atol=1e-5)
        _close_to(ga, gb, f"step {step}", rtol=1e-4, atol=1e-5)
        assert len(ga) == 2 * 3
    stack = _stack(graphed)
    assert stack.replays == 3 * 3 and not stack.eager
    (bucket,) = stack.sets.values()
    assert [g.inputs[0].requires_grad for g in bucket.graphs] == [False, True, True]


@cuda
def test_calls_a_graph_cannot_serve_run_eagerly_with_reasons():
    plain, graphed = _pair()
    ids = torch.randint(0, VOCAB, (2, 16)).cuda()
    graphed(input_ids=ids, labels=ids).loss.backward()  # use_cache defaults to True: a cache object
    with torch.no_grad():
        torch.testing.assert_close(graphed(input_ids=ids).logits, plain(input_ids=ids).logits)
    eager = _stack(graphed).eager
    assert eager["a DynamicCache object is passed (in training: pass use_cache=False)"] == 3
    assert eager["grad is disabled (graphs are captured for training steps)"] == 3
    note = next(n for n in torchfuser.report(graphed).notes if n.startswith("cuda graphs: model.layers"))
    assert "DynamicCache" in note and _stack(graphed).replays == 0


@cuda
def test_compile_and_restore():
    plain, graphed = _pair()
    ids = torch.randint(0, VOCAB, (2, 16)).cuda()
    compiled = torch.compile(graphed, fullgraph=True)
    la, ga = _step(plain, ids)
    lb, gb = _step(compiled, ids)
    torch.testing.assert_close(la, lb, rtol=1e-4, atol=1e-5)
    assert _stack(graphed).replays == 0 and _stack(graphed).captures == 0
    torchfuser.restore(graphed)
    assert all("forward" not in layer.__dict__ for layer in graphed.model.layers)
    assert cuda_graphs.describe(graphed) is None


@cuda
@pytest.mark.parametrize("autocast", [False, True], ids=["fp32", "bf16-autocast"])
def test_compile_reduce_overhead_trains_as_eager(autocast):
    """torch.compile(optimize(model), mode="reduce-overhead"), Inductor's own CUDA graphs around the
    fused ops (the fastest qwen05b step: NOTES-train-step.md, runs 54–56): no graph is skipped, and
    losses and every gradient follow the uncompiled fused model, in fp32 through AdamW steps. Under
    bf16 autocast the two fuse their bf16 products differently, and AdamW's sign-like first updates
    turn that rounding into different weights (2.7 % apart in a q_proj gradient one step later on
    the H200), so there the weights stay fixed and each replay's gradients are compared."""
    from torch._dynamo.utils import counters

    plain, compiled_model = torchfuser.optimize(tiny_llama("cuda"), cuda_graphs=False), torchfuser.optimize(tiny_llama("cuda"))
    compiled = torch.compile(compiled_model, mode="reduce-overhead")
    opts = [torch.optim.AdamW(m.parameters(), lr=1e-3) for m in (plain, compiled_model)]
    counters.clear()
    gen = torch.Generator().manual_seed(1)
    for step in range(4):
        ids = torch.randint(0, VOCAB, (2, 32), generator=gen).cuda()
        torch.compiler.cudagraph_mark_step_begin()
        steps = [None, None] if autocast else opts
        (la, ga), (lb, gb) = _step(plain, ids, steps[0], autocast), _step(compiled, ids, steps[1], autocast)
        gb = {n.removeprefix("_orig_mod."): g for n, g in gb.items()}
        assert ga.keys() == gb.keys()
        if not autocast:
            torch.testing.assert_close(la, lb, rtol=1e-4, atol=1e-5)
            _close_to(ga, gb, f"step {step}", rtol=1e-4, atol=1e-5)
            continue
        # bf16 products fused differently: whole tensors agree to bf16 rounding, not every element.
        torch.testing.assert_close(la, lb, rtol=5e-3, atol=0)
        for m in (plain, compiled_model):
            m.zero_grad(set_to_none=True)
        for n in ga:
            assert (ga[n] - gb[n]).norm() <= 2e-2 * ga[n].norm(), f"step {step}: {n}"
    assert not counters["inductor"]["cudagraph_skips"], dict(counters["inductor"])


@cuda
def test_hidden_states_and_layer_hooks_see_the_replayed_outputs():
    plain, graphed = _pair()
    ids = torch.randint(0, VOCAB, (2, 16)).cuda()
    _step(graphed, ids)  # capture
    seen = []
    graphed.model.layers[1].register_forward_hook(lambda mod, args, out: seen.append(out.detach().clone()))
    outs = [m(input_ids=ids, labels=ids, use_cache=False, output_hidden_states=True) for m in (plain, graphed)]
    for a, b in zip(outs[0].hidden_states, outs[1].hidden_states):
        torch.testing.assert_close(a, b, rtol=2e-5, atol=2e-6)
    torch.testing.assert_close(seen[0], outs[1].hidden_states[2])
    outs[1].loss.backward()
    assert _stack(graphed).replays == 2 * 3 and not _stack(graphed).eager


@cuda
def test_layers_share_the_hidden_state_buffers_and_gradients_stay_in_the_pool():
    plain, graphed = _pair()
    opts = [torch.optim.AdamW(m.parameters(), lr=1e-3) for m in (plain, graphed)]
    ids = torch.randint(0, VOCAB, (2, 16)).cuda()
    for step in range(3):
        (la, ga), (lb, gb) = (_step(m, ids, o) for m, o in zip((plain, graphed), opts))
        _close(ga, gb, f"step {step}")
    (bucket,) = _stack(graphed).sets.values()
    graphs = bucket.graphs
    # Each layer reads its predecessor's output buffer, and that predecessor's backward reads the
    # gradient this layer's backward writes: no copy of the hidden state either way.
    assert [g.chained for g in graphs] == [False, True, True]
    for before, after in zip(graphs, graphs[1:]):
        assert after.inputs[0].data_ptr() == before.outputs[0].data_ptr()
        assert before.grad_outputs[0].data_ptr() == after.grad_inputs[0].data_ptr()
    _step(graphed, ids)
    pooled = _stack(graphed).pooled_grads
    assert pooled and all(p.grad.data_ptr() in pooled for layer in graphed.model.layers for p in layer.parameters())


@cuda
def test_something_between_the_layers_breaks_the_chain_and_recaptures():
    plain, graphed = _pair()
    for m in (plain, graphed):  # a new tensor between layers 0 and 1
        m.model.layers[0].register_forward_hook(lambda mod, args, out: out * 1.0)
    gen = torch.Generator().manual_seed(3)
    for step in range(3):
        ids = torch.randint(0, VOCAB, (2, 16), generator=gen).cuda()
        (la, ga), (lb, gb) = _step(plain, ids), _step(graphed, ids)
        torch.testing.assert_close(la, lb, rtol=2e-5, atol=2e-6)
        _close(ga, gb, f"step {step}")
    stack = _stack(graphed)
    assert not stack.chain and stack.captures == 2 and not any(g.chained for b in stack.sets.values() for g in b.graphs)
    assert stack.eager["the layer was passed something other than the previous layer's output (recaptured unchained)"] == 1
    assert stack.replays == 1 + 3 + 3  # step 0: layer 0 only; then every layer


@cuda
def test_a_chained_input_changed_in_place_after_the_call_is_a_clear_error():
    _, graphed = _pair()
    ids = torch.randint(0, VOCAB, (2, 16)).cuda()
    _step(graphed, ids)  # capture

    def bump(mod, args, out):  # after layer 1 ran: its backward reads this buffer (layer 0's output)
        args[0].add_(1.0)

    graphed.model.layers[1].register_forward_hook(bump)
    loss = graphed(input_ids=ids, labels=ids, use_cache=False).loss
    with pytest.raises(RuntimeError, match="changed in place after the layer ran"):
        loss.backward()


@cuda
def test_eager_attention_with_a_padding_mask():
    plain, graphed = _pair(attn="eager")
    ids = torch.randint(0, VOCAB, (2, 16)).cuda()
    mask = torch.ones_like(ids)
    mask[1, 12:] = 0  # right padding: no query row is fully masked
    for step in range(2):
        (la, ga), (lb, gb) = (_step_masked(m, ids, mask) for m in (plain, graphed))
        torch.testing.assert_close(la, lb, rtol=1e-4, atol=1e-5)
        for n in ga:  # graphs take the exact (math) SDPA kernel, the plain call a fused one
            torch.testing.assert_close(ga[n], gb[n], rtol=1e-3, atol=1e-5, msg=lambda m: f"{n}\n{m}")
    assert _stack(graphed).replays == 2 * 3


def _step_masked(model, ids, mask):
    model.zero_grad(set_to_none=True)
    loss = model(input_ids=ids, attention_mask=mask, labels=ids, use_cache=False).loss
    loss.backward()
    return loss.detach(), {n: p.grad.clone() for n, p in model.named_parameters()}


def _with_mlp_wrapped(model, wrap):
    mlp = model.model.layers[1].mlp
    inner = mlp.forward
    mlp.forward = lambda x: wrap(inner(x))


@cuda
@pytest.mark.parametrize("where", ["warm-up", "capture"])
def test_a_layer_that_cannot_be_captured_runs_eagerly_and_rng_survives(where):
    plain, graphed = _pair()
    if where == "warm-up":  # reads a value on the host: found before any capture starts
        _with_mlp_wrapped(graphed, lambda y: y * (1.0 + 0.0 * float(y.sum())))
    else:  # something a capture refuses, done only while capturing
        def wrap(y):
            if torch.cuda.is_current_stream_capturing():
                torch.cuda.synchronize()
            return y
        _with_mlp_wrapped(graphed, wrap)
    ids = torch.randint(0, VOCAB, (2, 16)).cuda()
    (la, ga), (lb, gb) = _step(plain, ids), _step(graphed, ids)
    torch.testing.assert_close(la, lb, rtol=2e-5, atol=2e-6)
    _close(ga, gb, where)
    stack = _stack(graphed)
    assert stack.disabled and stack.replays == 0 and stack.eager[stack.disabled] == 3
    if where == "warm-up":
        assert "reads tensor values on the host" in stack.disabled
    torch.nn.functional.dropout(torch.ones(64, device="cuda"), 0.5)  # the generator still works


@cuda
def test_trainer_callback_with_accumulation_clipping_and_bf16(tmp_path):
    """The Hugging Face Trainer path: gradient accumulation, gradient clipping, bf16 autocast."""
    pytest.importorskip("accelerate")
    from transformers import Trainer, TrainingArguments

    data = [{"input_ids": ids, "labels": ids} for ids in torch.randint(0, VOCAB, (16, 24))]
    runs = []
    for graphs in (False, True):
        model = tiny_llama("cuda")
        model.config.use_cache = False
        args = TrainingArguments(output_dir=str(tmp_path / str(graphs)), per_device_train_batch_size=2,
                                 gradient_accumulation_steps=2, max_steps=3, learning_rate=1e-3, max_grad_norm=0.5,
                                 bf16=True, logging_steps=1, save_strategy="no", report_to=[], seed=0)
        callback = torchfuser.TorchFuserCallback(cuda_graphs=graphs)
        Trainer(model=model, args=args, train_dataset=data, callbacks=[callback]).train()
        runs.append(model)
    plain, graphed = runs
    stack = _stack(graphed)
    if torch.cuda.device_count() > 1:  # the Trainer wraps the model in nn.DataParallel: replicas run eagerly
        assert stack.replays == 0 and list(stack.eager) == ["nn.DataParallel replica (DistributedDataParallel keeps the graphs)"]
    else:
        assert stack.replays == 3 * 2 * 3 and not stack.eager  # 3 steps × 2 micro-batches × 3 layers
    for (n, a), b in zip(plain.named_parameters(), graphed.parameters()):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-6, msg=lambda m: f"{n}\n{m}")


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="nn.DataParallel needs two CUDA devices")
@pytest.mark.parametrize("graphs", [False, True])
def test_data_parallel_replicas_give_the_unfused_loss_and_gradients(graphs):
    """nn.DataParallel copies each module's __dict__ into a replica per GPU on every call: the fused LM
    head must run on its replica's modules, and graphed layers' replicas run eagerly on their GPU."""
    plain = tiny_llama("cuda")
    fused = torchfuser.optimize(copy.deepcopy(plain), cuda_graphs=graphs)
    ids = torch.randint(0, VOCAB, (4, 16), generator=torch.Generator().manual_seed(2)).cuda()
    losses = []
    for model in (plain, fused):
        loss = torch.nn.DataParallel(model)(input_ids=ids, labels=ids, use_cache=False).loss
        assert loss.shape == (2,)  # one loss per replica
        loss.mean().backward()
        losses.append(loss.detach())
    torch.testing.assert_close(losses[1], losses[0], rtol=1e-4, atol=1e-5)
    for (n, a), b in zip(plain.named_parameters(), fused.parameters()):
        torch.testing.assert_close(b.grad, a.grad, rtol=2e-3, atol=2e-5, msg=lambda m: f"{n}\n{m}")
    if graphs:
        assert _stack(fused).eager["nn.DataParallel replica (DistributedDataParallel keeps the graphs)"] == 2 * 3



@cuda
def test_fsdp2_sharded_layers_run_eagerly_with_the_reason(tmp_path):
    """Sharded after optimize(cuda_graphs=True): FSDP2's hooks gather parameters and reduce gradients
    around autograd, which a replay would bypass, so such layers run as without graphs."""
    import torch.distributed as dist
    from torch.distributed.fsdp import fully_shard

    dist.init_process_group("nccl", init_method=f"file://{tmp_path}/store", rank=0, world_size=1)
    try:
        plain, graphed = _pair()
        for model in (plain, graphed):
            for layer in model.model.layers:
                fully_shard(layer)
            fully_shard(model)
        opts = [torch.optim.SGD(m.parameters(), lr=0.1) for m in (plain, graphed)]
        for step in range(3):
            ids = torch.randint(0, VOCAB, (2, 16), generator=torch.Generator().manual_seed(step)).cuda()
            (la, _), (lb, _) = _step(plain, ids, opts[0]), _step(graphed, ids, opts[1])
            torch.testing.assert_close(la, lb, rtol=2e-5, atol=2e-6)
        for (n, a), b in zip(plain.named_parameters(), graphed.parameters()):
            torch.testing.assert_close(b.full_tensor(), a.full_tensor(), rtol=2e-5, atol=2e-6, msg=lambda m: f"{n}\n{m}")
        stack = _stack(graphed)
        assert stack.replays == 0 and [why for why in stack.eager if "FSDP2" in why]
    finally:
        dist.destroy_process_group()
