"""``optimize(model, checkpointing="offload" | True)``: each fused decoder layer keeps only its input for the
backward (on the host on CUDA; on the CPU the input itself) and runs again in the backward
(torchfuser/modules/offload.py). Measured, not assumed: the bytes autograd saves while each decoder layer
runs (a counting saved-tensor hook, as ``torchfuser bench`` counts) are exactly one layer input per layer;
loss and every gradient equal the unfused model's (fp32) and the fused model's without checkpointing (bit
for bit, dropout masks included); PEFT LoRA adapters' gradients exact (fp32) and within DESIGN.md's rule
(bf16); Hugging Face's gradient checkpointing, where enabled, runs instead (each layer checkpointed once);
torch.compile runs the checkpointed layers eagerly; CUDA graphs are refused."""
from __future__ import annotations

import copy
import pickle

import pytest
import torch
import transformers.modeling_utils
from transformers import LlamaConfig, LlamaForCausalLM

import torchfuser
from torchfuser.modules import fallbacks, offload, recompute

LAYERS, B, T, H = 2, 2, 32, 64


def _model(seed=0, **kw):
    cfg = LlamaConfig(hidden_size=H, intermediate_size=96, num_hidden_layers=LAYERS, num_attention_heads=4,
                      num_key_value_heads=2, vocab_size=128, attn_implementation="sdpa", use_cache=False, **kw)
    torch.manual_seed(seed)
    return LlamaForCausalLM(cfg)


def _ids():
    return torch.randint(0, 128, (B, T), generator=torch.Generator().manual_seed(4))


class _Meter:
    """Bytes saved for the backward while each decoder layer runs (a counting hook: what is made again
    is not counted, what offloading keeps is), attention calls (a recomputed layer's run twice) and
    calls of the checkpoint function."""

    def __init__(self, model, monkeypatch=None):
        self.layer, self.bytes, self.attention_calls, self.checkpoints = None, [0] * LAYERS, 0, 0
        self.handles = []
        for i, layer in enumerate(model.model.layers):
            self.handles.append(layer.register_forward_pre_hook(lambda *_, i=i: setattr(self, "layer", i)))
            self.handles.append(layer.register_forward_hook(lambda *_: setattr(self, "layer", None)))
            self.handles.append(layer.self_attn.register_forward_pre_hook(lambda *_: self._attention()))
        if monkeypatch is not None:
            real = offload.checkpoint

            def spy(*args, **kwargs):
                self.checkpoints += 1
                return real(*args, **kwargs)
            monkeypatch.setattr(offload, "checkpoint", spy)

    def _attention(self):
        self.attention_calls += 1

    def pack(self, t):
        if self.layer is not None:
            self.bytes[self.layer] += t.numel() * t.element_size()
        return t

    def step(self, model, ids, seed=7):
        model.zero_grad(set_to_none=True)
        def pack(t):
            return self.pack(t)
        setattr(pack, recompute.COUNTING, True)
        torch.manual_seed(seed)
        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        for h in self.handles:
            h.remove()
        return loss.detach(), {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


def _same(a, b, exact=False):
    (la, ga), (lb, gb) = a, b
    tol = dict(rtol=0, atol=0) if exact else dict(rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(la, lb, **tol)
    assert ga.keys() == gb.keys() and ga
    for n in gb:
        torch.testing.assert_close(ga[n], gb[n], **tol, msg=n)


@pytest.mark.parametrize("mode, backend", [("offload", "reference"), (True, "reference"), ("offload", "auto")])
def test_each_layer_keeps_only_its_input(mode, backend, monkeypatch):
    """Saved per layer: one layer input (B·T·H fp32), where the fused layer without checkpointing keeps
    far more; each layer checkpointed once and run again in the backward; loss and every gradient as
    unfused, and bit for bit as fused without checkpointing (the forward is the same)."""
    base, ids = _model(), _ids()
    ref = _Meter(base_copy := copy.deepcopy(base)).step(base_copy, ids)
    plain = torchfuser.optimize(copy.deepcopy(base), backend=backend)
    plain_meter = _Meter(plain)
    plain_run = plain_meter.step(plain, ids)
    model = torchfuser.optimize(copy.deepcopy(base), backend=backend, checkpointing=mode)
    meter = _Meter(model, monkeypatch)
    run = meter.step(model, ids)
    assert meter.bytes == [B * T * H * 4] * LAYERS, meter.bytes
    assert all(b > 10 * B * T * H * 4 for b in plain_meter.bytes), plain_meter.bytes
    assert meter.checkpoints == LAYERS and meter.attention_calls == 2 * LAYERS
    assert plain_meter.attention_calls == LAYERS
    assert not fallbacks.counts(model)
    _same(run, plain_run, exact=True)
    _same(run, ref)


def test_dropout_masks_are_drawn_again_alike(monkeypatch):
    """Attention dropout on: the recompute draws the masks the forward drew (the generators are kept for
    it), so the gradients are the fused model's without checkpointing, bit for bit."""
    base, ids = _model(attention_dropout=0.3), _ids()
    plain = torchfuser.optimize(copy.deepcopy(base), backend="reference")
    model = torchfuser.optimize(copy.deepcopy(base), backend="reference", checkpointing="offload")
    meter = _Meter(model, monkeypatch)
    run = meter.step(model, ids)
    assert meter.checkpoints == LAYERS
    _same(run, _Meter(plain).step(plain, ids), exact=True)
    no_dropout = torchfuser.optimize(_model(attention_dropout=0.0), backend="reference")
    assert not torch.equal(run[0], _Meter(no_dropout).step(no_dropout, ids)[0])  # the dropout is on


@pytest.fixture
def hf_checkpoints(monkeypatch):
    calls = []
    real = transformers.modeling_utils.checkpoint

    def spy(function, *args, **kwargs):
        calls.append(function)
        return real(function, *args, **kwargs)
    monkeypatch.setattr(transformers.modeling_utils, "checkpoint", spy)
    return calls


def _enable(model, reentrant):
    kwargs = {"use_reentrant": reentrant}
    if hasattr(model, "activation_checkpointing_enable"):  # transformers 5.25; the older name warns there
        model.activation_checkpointing_enable(kwargs)
    else:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs=kwargs)


@pytest.mark.parametrize("reentrant", [True, False])
@pytest.mark.parametrize("order", ["optimize_first", "checkpointing_first"])
def test_hugging_face_checkpointing_runs_instead(order, reentrant, hf_checkpoints, monkeypatch):
    """With gradient_checkpointing_enable as well, in either order: Hugging Face's checkpoint runs on each
    layer, ours stands aside (each layer checkpointed once, run twice), the report says so; exact."""
    base, ids = _model(), _ids()
    ref = copy.deepcopy(base)
    _enable(ref, reentrant)
    model = copy.deepcopy(base)
    if order == "checkpointing_first":
        _enable(model, reentrant)
    torchfuser.optimize(model, backend="reference", checkpointing="offload")
    if order == "optimize_first":
        _enable(model, reentrant)
    meter = _Meter(model, monkeypatch)
    run = meter.step(model, ids)
    assert (len(hf_checkpoints), meter.checkpoints, meter.attention_calls) == (LAYERS, 0, 2 * LAYERS)
    assert not fallbacks.counts(model)
    notes = [n for n in torchfuser.report(model).notes if n.startswith(offload.HEAD)]
    assert any("model.layers.* (2 layers): Hugging Face's gradient checkpointing" in n for n in notes), notes
    _same(run, _Meter(ref).step(ref, ids))


def test_report_settings_and_errors():
    """The report names the layers checkpointed and how; the setting is kept by later optimize calls, a
    copy and pickling; False turns it off, restore takes it away; wrong values and CUDA graphs refused."""
    model = torchfuser.optimize(_model(), backend="reference", checkpointing="offload")
    notes = [n for n in torchfuser.report(model).notes if n.startswith(offload.HEAD)]
    assert notes[0].startswith("checkpointing: model.layers.* (2 layers): checkpointing='offload': each keeps only")
    torchfuser.optimize(model)
    assert all(offload.of(layer).mode == "offload" for layer in model.model.layers)
    for other in (copy.deepcopy(model), pickle.loads(pickle.dumps(model))):
        assert all(offload.of(layer).mode == "offload" for layer in other.model.layers)
    torchfuser.optimize(model, checkpointing=True)
    assert all(offload.of(layer).mode is True for layer in model.model.layers)
    assert "checkpointing=True" in " ".join(torchfuser.report(model).notes)
    torchfuser.optimize(model, checkpointing=False)
    assert all(offload.of(layer) is None for layer in model.model.layers)
    assert not any(n.startswith(offload.HEAD) for n in torchfuser.report(model).notes)
    torchfuser.optimize(model, checkpointing="offload")
    torchfuser.restore(model)
    assert all(offload.KEY not in layer.__dict__ for layer in model.model.layers)
    for bad in ("cpu", 1, None, "Offload"):
        with pytest.raises(ValueError, match="checkpointing must be"):
            torchfuser.optimize(_model(), checkpointing=bad)
    with pytest.raises(ValueError, match="do not go together"):
        torchfuser.optimize(_model(), checkpointing="offload", cuda_graphs=True)
    kept = torchfuser.optimize(_model(), backend="reference", checkpointing=True)
    with pytest.raises(ValueError, match=r"kept from the earlier optimize call"):
        torchfuser.optimize(kept, cuda_graphs=True)
    assert all(offload.of(layer).mode is True for layer in kept.model.layers)  # the failed call changed nothing


def test_eval_and_no_grad_checkpoint_nothing(monkeypatch):
    model = torchfuser.optimize(_model(), backend="reference", checkpointing="offload")
    meter = _Meter(model, monkeypatch)
    with torch.no_grad():
        model(input_ids=_ids())
    model.eval()
    model(input_ids=_ids())
    assert meter.checkpoints == 0


def test_torch_compile_runs_the_checkpointed_layers_eagerly(monkeypatch):
    """Under torch.compile each checkpointed layer is a graph break and runs fused and checkpointed
    (not the original forward, which would keep everything); loss and gradients as unfused."""
    base, ids = _model(), _ids()
    model = torchfuser.optimize(copy.deepcopy(base), backend="reference", checkpointing="offload")
    meter = _Meter(model, monkeypatch)
    compiled = torch.compile(model, backend="eager")
    torch._dynamo.reset()
    loss = compiled(input_ids=ids, labels=ids).loss
    loss.backward()
    assert meter.checkpoints == LAYERS and meter.attention_calls == 2 * LAYERS
    ref = copy.deepcopy(base)
    _same((loss.detach(), {n: p.grad for n, p in model.named_parameters()}), _Meter(ref).step(ref, ids))


peft = pytest.importorskip("peft")


def test_lora_adapter_gradients_exact_fp32(monkeypatch):
    """PEFT LoRA on all seven projections (with LoRA dropout): loss and every adapter gradient as PEFT's
    unfused model's; the fused LoRA nodes run (inside the recompute too)."""
    from test_lora_fused import _Spy, _pair, _same as lora_same

    ref, fused = _pair("llama", lora_dropout=0.1)
    torchfuser.optimize(fused, checkpointing="offload")
    spy = _Spy(monkeypatch)
    lora_same(ref, fused)
    assert spy.calls == 2 * 8  # 4 fused LoRA nodes a layer (q/k/v, o, gate/up, down), forward and again


def test_lora_bf16_within_the_rule():
    """bf16 base, fp32 adapters: loss and every adapter gradient within DESIGN.md's rule against the same
    PEFT model in float64, as without checkpointing."""
    from test_lora_fused import _pair, _rule_bf16

    ref, fused = _pair("llama", dtype=torch.bfloat16, lora_dropout=0.1)
    torchfuser.optimize(fused, checkpointing="offload")
    _rule_bf16(fused, ref, copy.deepcopy(ref).double())


@pytest.mark.skipif(not torch.cuda.is_available(), reason="host offload needs a CUDA device")
def test_offload_on_cuda(monkeypatch):
    """On the GPU: what each layer keeps is on the host (pinned), nothing of it on the device; loss and
    gradients the fused model's without checkpointing, over two steps (the host copies and the copies back
    one layer ahead made again)."""
    base, ids = _model().cuda(), _ids().cuda()
    plain = torchfuser.optimize(copy.deepcopy(base))
    model = torchfuser.optimize(copy.deepcopy(base), checkpointing="offload")
    devices = []

    def where(t):  # a layer's input parked on the host (not other CPU tensors saved, as the CPU RNG state)
        if t.device.type == "cpu" and t.numel() == B * T * H:
            devices.append(t.is_pinned())
        return t
    for _ in range(2):
        meter = _Meter(model, monkeypatch)
        real = meter.pack
        meter.pack = lambda t: (where(t), real(t))[1]
        run = meter.step(model, ids)
        assert meter.bytes == [B * T * H * 4] * LAYERS and meter.checkpoints == LAYERS
        _same(run, _Meter(plain).step(plain, ids))  # not bit for bit: the Triton backward may sum in any order
        monkeypatch.undo()
    assert devices == [True] * (2 * LAYERS)

    def held_after_forward(m):
        torch.cuda.synchronize()
        before = torch.cuda.memory_allocated()
        loss = m(input_ids=ids, labels=ids).loss
        torch.cuda.synchronize()
        held = torch.cuda.memory_allocated() - before
        loss.backward()
        m.zero_grad(set_to_none=True)
        return held
    # The device keeps none of the layers' activations: at least the layers' own saved bytes fewer.
    assert held_after_forward(model) + LAYERS * 5 * B * T * H * 4 < held_after_forward(plain)
