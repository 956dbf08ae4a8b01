"""CUDA-graph length buckets (torchfuser/cuda_graphs/buckets.py): which bucket a length falls in, how
a layer call's tensors are padded, and that the padded call computes exactly the unpadded one —
forward and every gradient, with no gradient from the padding. Checked here on the CPU on the very
layer calls a decoder makes; the graphs themselves are tested in test_cuda_graphs.py on a GPU."""
from __future__ import annotations

import pytest
import torch
from torch import nn
from transformers import AutoConfig, AutoModelForCausalLM

import torchfuser
from torchfuser import backends
from torchfuser import cuda_graphs
from torchfuser.cuda_graphs import buckets
from torchfuser.cuda_graphs.buckets import GraphOptions, bucket_length, padding


def _model(family="llama"):
    cfg = AutoConfig.for_model(family, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                               num_key_value_heads=2, vocab_size=128, attn_implementation="sdpa")
    torch.manual_seed(0)
    return torchfuser.optimize(AutoModelForCausalLM.from_config(cfg).double(), backend="reference")


def _layer_call(model, seq, padded_row=False):
    """(layout, tensors) of layer 0's call as the model makes it, for a batch of 2 × ``seq``."""
    seen = {}
    hook = model.model.layers[0].register_forward_pre_hook(lambda m, a, k: seen.update(a=a, k=k), with_kwargs=True)
    ids = torch.randint(0, 128, (2, seq), generator=torch.Generator().manual_seed(seq))
    mask = torch.ones(2, seq, dtype=torch.long)
    if padded_row:
        mask[1, seq - 3:] = 0  # right padding in the second row: transformers passes a 4-D mask
    model(input_ids=ids, attention_mask=mask, use_cache=False)
    hook.remove()
    return cuda_graphs.split_call(seen["a"], seen["k"])


def test_bucket_lengths():
    assert [bucket_length(s) for s in (1, 3, 8, 9, 16, 17, 100, 1024, 1025, 1800, 2048, 2049)] == \
        [8, 8, 8, 16, 16, 24, 112, 1024, 1280, 2048, 2048, 2560]
    assert [bucket_length(s, per_octave=1) for s in (1025, 2048)] == [2048, 2048]
    assert all(0 <= bucket_length(s) - s < max(8, s / 4) for s in range(1, 5000))


@pytest.mark.parametrize("padded_row", [False, True], ids=["causal", "mask"])
def test_padding_rules_of_a_decoder_layer_call(padded_row):
    layout, tensors = _layer_call(_model(), 13, padded_row)
    pad = padding(layout, tensors, GraphOptions())
    assert (pad.s, pad.l) == (13, 16)
    names = [e[0] for e in layout if e[1] != "v" for _ in range(e[2] if e[1] == "seq" else 1)]
    rules = dict(zip(names, pad.rules))
    assert rules[0] == buckets.SEQ1 and rules["position_embeddings"] == buckets.SEQ1
    assert rules.get("attention_mask") == (buckets.MASK if padded_row else None)
    sample = pad.sample(tensors)
    assert [t.shape[1] for t in sample if t.dim() >= 2 and t.dim() < 4] == [16] * (len(sample) - padded_row)
    if "position_ids" in rules:  # positions go on past the real ones: nothing looks like a new sample
        pos = sample[names.index("position_ids")]
        assert pos[0, 12:].tolist() == [12, 13, 14, 15]
    if padded_row:
        m = sample[names.index("attention_mask")]
        assert m[..., :13, :13].equal(tensors[names.index("attention_mask")])
        assert not m[..., :13, 13:].any() and m[..., 13:, :].equal(torch.ones(16, 16, dtype=torch.bool).tril()[13:].expand(2, 1, 3, 16))
    assert padding(layout, tensors, GraphOptions(pad_lengths=False)) == "lengths are not padded (GraphOptions(pad_lengths=False))"


@pytest.mark.parametrize("padded_row", [False, True], ids=["causal", "mask"])
def test_padded_layer_call_is_the_unpadded_one_forward_and_backward(padded_row):
    """The math the bucketed graphs rely on, in float64: the real positions' outputs, the input's
    gradient and every parameter's gradient equal the unpadded call's, and the padding's gradient is 0."""
    model = _model()
    layer = model.model.layers[0]
    layout, tensors = _layer_call(model, 13, padded_row)
    pad = padding(layout, tensors, GraphOptions())
    assert buckets.check(layer.forward, layout, tensors, pad, cuda_graphs.join_call) is None
    weight = torch.randn(2, 13, 64, dtype=torch.float64, generator=torch.Generator().manual_seed(5))

    def run(ts, unpad):
        hidden = ts[0].detach().requires_grad_()
        args, kwargs = cuda_graphs.join_call(layout, [hidden, *ts[1:]])
        out = layer(*args, **kwargs)
        (unpad(out) * weight).sum().backward()
        grads = {n: p.grad.clone() for n, p in layer.named_parameters()}
        layer.zero_grad(set_to_none=True)
        return unpad(out).detach(), hidden.grad, grads

    out, d_hidden, grads = run(list(tensors), lambda o: o)
    out_p, d_hidden_p, grads_p = run(pad.sample(tensors, noise=True), pad.unpad)
    torch.testing.assert_close(out_p, out, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(d_hidden_p[:, :13], d_hidden, rtol=1e-12, atol=1e-12)
    assert d_hidden_p[:, 13:].abs().max() == 0
    for n in grads:
        torch.testing.assert_close(grads_p[n], grads[n], rtol=1e-10, atol=1e-12, msg=lambda m: f"{n}: {m}")


class _Mixer(nn.Module):
    """A layer whose positions interact (a bidirectional mix): padding would change it."""

    def forward(self, hidden_states):
        return hidden_states + hidden_states.mean(1, keepdim=True)


def test_check_refuses_a_layer_whose_positions_interact():
    x = torch.randn(2, 13, 8)
    layout, tensors = cuda_graphs.split_call((x,), {})
    pad = padding(layout, tensors, GraphOptions())
    why = buckets.check(_Mixer().forward, layout, tensors, pad, cuda_graphs.join_call)
    assert why is not None and why.startswith("the padding changed the real positions' outputs")


def test_arguments_that_cannot_be_padded_say_why():
    x = torch.randn(2, 13, 8)
    odd = cuda_graphs.split_call((x,), {"extra": torch.randn(13, 4, 2)})  # the length in dim 0 of a 3-D tensor
    assert "'extra' of shape (13, 4, 2)" in padding(*odd, GraphOptions())
    flat_mask = cuda_graphs.split_call((x,), {"attention_mask": torch.ones(2, 13, dtype=torch.bool)})
    assert padding(*flat_mask, GraphOptions()).startswith("an attention mask of shape (2, 13)")
    assert "not a (batch, sequence, hidden)" in padding(*cuda_graphs.split_call((x[0],), {}), GraphOptions())


def test_graph_options_are_checked_and_reach_the_stacks(monkeypatch):
    for bad in (dict(per_octave=0), dict(max_buckets=0), dict(pool_gib=0), dict(max_buckets=2.5)):
        with pytest.raises(ValueError, match="GraphOptions"):
            GraphOptions(**bad)
    model = _model()
    with pytest.raises(TypeError, match="cuda_graphs must be True, False or a torchfuser.GraphOptions"):
        torchfuser.optimize(model, cuda_graphs="yes")
    monkeypatch.setattr(cuda_graphs, "_unsupported", lambda model, layers: None)
    torchfuser.optimize(model, backend="reference", cuda_graphs=torchfuser.GraphOptions(max_buckets=2, pool_gib=4))
    assert cuda_graphs.options(model) == GraphOptions(max_buckets=2, pool_gib=4)
    if backends.unavailable_reason("mlir", "cpu") is None:  # a backend change captures anew, with the same options
        torchfuser.optimize(model, backend="mlir", cuda_graphs=True)
        assert cuda_graphs.options(model) == GraphOptions(max_buckets=2, pool_gib=4)
    torchfuser.restore(model)


class _Stand:
    """A stack's captures and replays stood in for on the CPU (no CUDA graph), to test its decisions:
    which bucket a call takes, when a set is captured or dropped, what the report says."""

    def __init__(self, monkeypatch, options):
        from types import SimpleNamespace

        from torchfuser.cuda_graphs import replay, signature

        self.model = _model()
        self.captured, self.pools = [], []

        def capture(layers, forwards, params, layout, tensors, chain=True, pool=None):
            self.captured.append(tensors[0].shape[1])
            self.pools.append(pool)
            return [SimpleNamespace(param_key=signature.param_key(p), inputs=[t.detach().requires_grad_(t.requires_grad)
                                    for t in tensors], chained=False, grad_inputs=(), out_spec=None, params=(),
                                    pending=lambda: False) for p in params]

        monkeypatch.setattr(replay, "capture", capture)
        monkeypatch.setattr(replay._Replay, "apply", lambda stack, g, pad, *ts: (ts[0],))
        monkeypatch.setattr(torch.cuda, "graph_pool_handle", lambda: (0, len(self.captured)))
        monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: False)
        monkeypatch.setattr(torch.cuda, "memory_allocated", lambda *a: 2**30 * len(self.captured))  # 1 GiB a set
        layers = self.model.model.layers
        self.stack = replay.Stack("model.layers", list(layers), [layer.forward for layer in layers], options)

    def step(self, seq):
        seen = {}
        hook = self.model.model.layers[0].register_forward_pre_hook(lambda m, a, k: seen.update(a=a, k=k), with_kwargs=True)
        ids = torch.randint(0, 128, (2, seq), generator=torch.Generator().manual_seed(seq))
        with torch.no_grad():
            self.model(input_ids=ids, use_cache=False)
        hook.remove()
        for i in range(len(self.stack.layers)):
            self.stack.call(i, *seen["a"], **seen["k"])


def test_stack_takes_buckets_and_reports_hit_rates(monkeypatch):
    stand = _Stand(monkeypatch, GraphOptions())
    for seq in (13, 16, 9, 30, 31, 13):
        stand.step(seq)
    s = stand.stack
    assert stand.captured == [16, 32] and s.checked and not s.eager and s.served == {16: 4, 32: 2}
    assert stand.pools == [(0, 0)] * 2  # every bucket's graphs in one pool
    assert s.replays == 6 * 2
    assert "length buckets (16: 4 steps, 75% hits, 32: 2 steps, 50% hits); 2 set(s) kept (max 8), 2.0 GiB" in s.describe()


def test_a_sets_memory_is_what_its_pool_reserves_not_only_what_stays_allocated(monkeypatch):
    # After a capture the blocks its backward freed again (saved activations, scratch) read as unallocated, yet
    # stay reserved for the graphs' pool: a set of graphs holds the reserved growth when that is the larger.
    stand = _Stand(monkeypatch, GraphOptions(pool_gib=4))
    monkeypatch.setattr(torch.cuda, "memory_reserved", lambda *a: 3 * 2**30 * len(stand.captured))  # 3 GiB a set
    for seq in (16, 32, 16):
        stand.step(seq)
    s = stand.stack
    # Counted as allocated (1 GiB a set) both lengths would fit the 4 GiB: two captures, none dropped.
    assert stand.captured == [16, 32, 16] and s.dropped == 2
    assert [b.bytes for b in s.sets.values()] == [3 * 2**30] and "1 set(s) kept (max 8), 3.0 GiB, 2 dropped" in s.describe()
    # What a peak of allocated memory misses while they replay: the 2 GiB that read as unallocated.
    assert s.pool_bytes() == (3 * 2**30, 2 * 2**30)
    stand.model.__dict__[cuda_graphs._ATTR] = [s, s]  # as install() keeps a model's stacks: summed over them
    assert cuda_graphs.pool_bytes(stand.model) == (6 * 2**30, 4 * 2**30)
    assert cuda_graphs.pool_bytes(_model()) == (0, 0)  # no graphs, nothing held


@pytest.mark.parametrize("options", [GraphOptions(max_buckets=1), GraphOptions(pool_gib=1.2)], ids=["max_buckets", "pool_gib"])
def test_stack_drops_sets_to_stay_in_bounds_then_stops(monkeypatch, options):
    stand = _Stand(monkeypatch, options)
    for seq in (16, 32, 16, 32, 16):
        stand.step(seq)
    s = stand.stack
    assert stand.captured == [16, 32, 16] and s.dropped == 2 and len(s.sets) == 1
    assert stand.pools == [(0, 0), (0, 1), (0, 2)]  # no set left alive: a new pool (the old one is gone with them)
    assert s.disabled.startswith("lengths kept leaving the 1 set(s) of graphs that fit (3 captures, 2 dropped)")
    assert s.eager[s.disabled] == 2 * 2 and s.replays == 3 * 2


def test_stack_with_unpadded_lengths_keeps_a_set_per_length(monkeypatch):
    stand = _Stand(monkeypatch, GraphOptions(pad_lengths=False))
    for seq in (13, 16, 13):
        stand.step(seq)
    s = stand.stack
    assert stand.captured == [13, 16] and s.served == {13: 2, 16: 1} and not s.checked
    assert "exact lengths (13: 2 steps, 50% hits, 16: 1 steps, 0% hits)" in s.describe()
    assert "graphs per exact length: lengths are not padded" in s.describe()


def test_a_layer_that_refuses_padded_shapes_gets_exact_lengths(monkeypatch):
    """The padding check runs the layer on the padded call; a layer that raises there gets graphs per exact
    length, with the reason, and the user's step goes on."""
    stand = _Stand(monkeypatch, GraphOptions())
    real = stand.stack.forwards[0]

    def only_unpadded(hidden_states, *args, **kwargs):
        if hidden_states.shape[1] != 13:
            raise ValueError("this layer takes 13 positions only")
        return real(hidden_states, *args, **kwargs)

    stand.stack.forwards[0] = only_unpadded
    stand.step(13)
    s = stand.stack
    assert s.exact == "the padded call raised ValueError: this layer takes 13 positions only"
    assert stand.captured == [13] and not s.eager and "graphs per exact length: the padded call raised" in s.describe()
