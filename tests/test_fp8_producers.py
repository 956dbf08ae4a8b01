"""Quantisation fused into the producers of FP8 GEMM operands (issue 23): the packed SwiGLU / GeGLU
kernels forward and backward also take their output's maxima (backends/triton/gated_fp8.py), and the
GEMM that takes it runs the both-ways writer alone (``fp8_quantize_both_amax``).

Everything here is bit for bit: the producers' outputs against the plain kernels', their maxima against
the reference's, the quantisations from them against ``fp8_quantize_both``'s, and a whole FP8 model's
loss and every gradient with the producers on against off. The kernels run under Triton's interpreter
on the CPU (compiled on a GPU where there is one); the model on the CPU (emulated FP8 GEMMs)."""
from __future__ import annotations

import copy
import sys
from pathlib import Path

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM

import torchfuser
from torchfuser.backends.reference import fp8_quant as R
from torchfuser.modules import fp8
from torchfuser.ops import fp8_quant as Q
from torchfuser.switches import SWITCHES

triton = pytest.importorskip("triton")
sys.path.insert(0, str(Path(__file__).parent / "backends"))

from test_fp8_quant import _assert_same, _rand  # noqa: E402
from test_triton_ops import DEVICE, interpreter  # noqa: E402,F401  (module fixture)

ACTS = ("swiglu", "geglu")
SHAPES = [(1, 64), (123, 123), (300, 96), (40, 200)]  # (rows, N): [gate | up] is rows × 2N


def _packed(rows, n, strided=False, seed=0):
    gu = _rand(rows, 2 * n + (6 if strided else 0), dtype=torch.bfloat16, seed=seed)
    return (gu[:, 3:3 + 2 * n] if strided else gu).to(DEVICE)


def _same_bits(a, b, what):
    assert a.shape == b.shape and a.dtype == b.dtype, what
    assert torch.equal(a.cpu().view(torch.int16 if a.element_size() == 2 else torch.int32),
                       b.cpu().view(torch.int16 if b.element_size() == 2 else torch.int32)), what


@pytest.mark.parametrize("act", ACTS)
@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("strided", [False, True], ids=["dense", "row-strided"])
def test_producers_write_the_plain_kernels_bits_and_their_maxima(interpreter, act, shape, strided):
    gu = _packed(*shape, strided)
    h, amax = getattr(interpreter, f"{act}_packed_fp8_fwd")(gu)
    _same_bits(h, getattr(interpreter, f"{act}_packed_fwd")(gu), f"{act} forward {shape}")
    _same_bits(amax, R.fp8_amax_both(h.cpu()), f"{act} forward maxima {shape}")
    dy = _rand(shape[0], shape[1], dtype=torch.bfloat16, seed=1).to(DEVICE)
    d, amax = getattr(interpreter, f"{act}_packed_fp8_bwd")(dy, gu)
    _same_bits(d, getattr(interpreter, f"{act}_packed_bwd")(dy, gu), f"{act} backward {shape}")
    _same_bits(amax, R.fp8_amax_both(d.cpu()), f"{act} backward maxima {shape}")


@pytest.mark.parametrize("act", ACTS)
def test_producer_programs_of_several_steps(interpreter, act, monkeypatch):
    """On one SM: a few programs along the rows, each walking several row steps, their maxima maxed in."""
    monkeypatch.setattr(interpreter.gated_fp8, "_sms", lambda t: 1)
    gu = _packed(300, 96)
    for config in (interpreter.gated_fp8._FWD, interpreter.gated_fp8._BWD):
        grid, per_prog = interpreter.fp8_quant.tile_grid(300, 96, config[0], interpreter.gated_fp8._BLOCK_B, config[2], 1)
        assert grid[0] > 1 and per_prog > config[0], (grid, per_prog)  # several programs, several steps each
    h, amax = getattr(interpreter, f"{act}_packed_fp8_fwd")(gu)
    _same_bits(amax, R.fp8_amax_both(h.cpu()), "forward maxima")
    d, amax = getattr(interpreter, f"{act}_packed_fp8_bwd")(h, gu)
    _same_bits(d, getattr(interpreter, f"{act}_packed_bwd")(h, gu), "backward")
    _same_bits(amax, R.fp8_amax_both(d.cpu()), "backward maxima")


def test_producer_maxima_propagate_nan_and_take_inf(interpreter):
    gu = _packed(64, 96)
    gu[5, 7] = float("nan")  # a gate: h's row 5 and column 7 are NaN
    gu[9, 96 + 11] = float("inf")  # an up: h = silu(g)·inf
    h, amax = interpreter.swiglu_packed_fp8_fwd(gu)
    want = R.fp8_amax_both(h.cpu())
    assert torch.equal(amax.cpu().view(torch.float32).isnan(), want.view(torch.float32).isnan())
    assert torch.equal(amax.cpu().view(torch.float32).nan_to_num(), want.view(torch.float32).nan_to_num())


@pytest.mark.parametrize("shape", [(1, 64), (123, 123), (300, 96), (2, 8192)])
def test_both_ways_from_the_maxima_is_quantize_both(interpreter, shape):
    t = _rand(*shape, dtype=torch.bfloat16)
    t[0, 1], t[-1, 0] = float("inf"), 0.0
    want = R.fp8_quantize_both(t, False)
    amax = R.fp8_amax_both(t)
    got = interpreter.fp8_quantize_both_amax(t.to(DEVICE), amax.to(DEVICE))
    for g, w, what in zip(got, want, ("rows", "columns")):
        _assert_same(g, w, f"kernel {what} {shape}")
    for g, w, what in zip(R.fp8_quantize_both_amax(t, amax), want, ("rows", "columns")):
        _assert_same(g, w, f"reference {what} {shape}")


def test_both_ways_writer_programs_of_several_steps(interpreter, monkeypatch):
    monkeypatch.setattr(interpreter.fp8_quant, "_sms", lambda t: 1)
    t = _rand(300, 200, dtype=torch.bfloat16)
    (_, writer) = interpreter.fp8_quant.both_config(300, 200, 1, False)
    assert writer[0][0] > 1 and writer[1] > writer[2], writer  # several programs along the rows, several steps each
    for g, w in zip(interpreter.fp8_quant.fp8_quantize_both_amax(t.to(DEVICE), R.fp8_amax_both(t).to(DEVICE)),
                    R.fp8_quantize_both(t, False)):
        _assert_same(g, w, "several steps")
    for tensorwise in (False, True):  # and the atomic path, both recipes
        for g, w in zip(interpreter.fp8_quant.fp8_quantize_both(t.to(DEVICE), tensorwise), R.fp8_quantize_both(t, tensorwise)):
            _assert_same(g, w, f"atomic path, tensorwise={tensorwise}")


def test_both_ways_from_the_maxima_checks_its_arguments(interpreter):
    t = _rand(16, 32, dtype=torch.bfloat16).to(DEVICE)
    with pytest.raises(ValueError, match="48 entries"):
        interpreter.fp8_quantize_both_amax(t, torch.zeros(47, dtype=torch.int32, device=DEVICE))
    with pytest.raises(ValueError, match="dense last dim"):
        interpreter.fp8_quantize_both_amax(t.t(), torch.zeros(48, dtype=torch.int32, device=DEVICE))


def test_attached_maxima_are_void_after_an_in_place_change():
    t = torch.randn(4, 8)
    Q.attach_amax(t, R.fp8_amax_both(t))
    assert Q.attached_amax(t) is not None
    assert Q.attached_amax(t.view(2, 16)) is None  # another tensor object: nothing attached
    t[:, :4].mul_(2)  # through a view: the shared version counter moves
    assert Q.attached_amax(t) is None


CFG = dict(vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
           num_key_value_heads=2)


def _step(model, ids):
    model.zero_grad(set_to_none=True)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        loss = model(input_ids=ids, labels=ids).loss
    loss.backward()
    return loss, {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


class _Uses:
    """How many FP8 operands were quantised from a producer's maxima."""

    def __init__(self, monkeypatch):
        self.n = 0
        real = Q.attached_amax

        def spy(t):
            got = real(t)
            self.n += got is not None
            return got
        monkeypatch.setattr(Q, "attached_amax", spy)


@pytest.mark.parametrize("act", ["silu", "gelu_pytorch_tanh"])
@pytest.mark.parametrize("norms", [False, True], ids=["default", "norm-producers"])
def test_a_model_with_the_producers_computes_what_it_does_without(act, norms, monkeypatch):
    monkeypatch.setattr(SWITCHES, "fp8_norm_producers", norms)
    torch.manual_seed(0)
    model = torchfuser.optimize(LlamaForCausalLM(LlamaConfig(**CFG, hidden_act=act)), backend="reference",
                                fp8="rowwise")
    ids = torch.randint(0, 128, (2, 16), generator=torch.Generator().manual_seed(1))
    note = next(n for n in torchfuser.report(model).notes if n.startswith("fp8: "))
    assert f"in {CFG['num_hidden_layers']} gated MLPs the activation's kernels, for the down" in note, note
    assert (f"in {CFG['num_hidden_layers']} decoder layers the norms', for the q/k/v" in note) == norms, note
    uses = _Uses(monkeypatch)
    loss, grads = _step(model, ids)
    # each layer: h for down, [dg | du] for gate/up (the activation); with the norms, the q/k/v and
    # gate/up inputs and o's dy
    assert uses.n == (5 if norms else 2) * CFG["num_hidden_layers"]
    monkeypatch.setattr(fp8, "producer_maxima", lambda *a: False)
    uses.n = 0
    want, want_g = _step(model, ids)
    assert uses.n == 0
    assert torch.equal(loss, want) and list(grads) == list(want_g)
    for name, g in want_g.items():
        assert torch.equal(grads[name], g), name


@pytest.mark.skipif(not torch.cuda.is_available() or torch.cuda.get_device_capability() < (8, 9),
                    reason="needs a GPU with FP8 GEMMs (compute capability 8.9 or newer)")
def test_a_gpu_model_with_the_producers_computes_what_it_does_without(monkeypatch):
    """The Triton producers, compiled: a model's loss and every gradient the same bits with them as without."""
    monkeypatch.setattr(SWITCHES, "fp8_norm_producers", True)
    torch.manual_seed(0)
    cfg = dict(CFG, hidden_size=256, intermediate_size=512)
    model = torchfuser.optimize(LlamaForCausalLM(LlamaConfig(**cfg)).cuda(), backend="triton", fp8="rowwise")
    ids = torch.randint(0, 128, (2, 64), generator=torch.Generator().manual_seed(1)).cuda()
    uses = _Uses(monkeypatch)
    with torch.autocast("cuda", dtype=torch.bfloat16):
        loss = model(input_ids=ids, labels=ids).loss
    loss.backward()
    got = loss.detach().clone(), {n: p.grad.clone() for n, p in model.named_parameters()}
    assert uses.n == 5 * cfg["num_hidden_layers"]
    monkeypatch.setattr(fp8, "producer_maxima", lambda *a: False)
    model.zero_grad(set_to_none=True)
    uses.n = 0
    with torch.autocast("cuda", dtype=torch.bfloat16):
        loss = model(input_ids=ids, labels=ids).loss
    loss.backward()
    assert uses.n == 0 and torch.equal(got[0], loss.detach())
    for name, p in model.named_parameters():
        assert torch.equal(got[1][name], p.grad), name


def test_no_producer_where_the_gemm_takes_its_operand_one_way(monkeypatch):
    """Frozen projections (LoRA bases: no dW), no grad, tensorwise: the operand is quantised one way or
    by one amax over all of it, so no maxima are taken."""
    torch.manual_seed(0)
    base = LlamaForCausalLM(LlamaConfig(**CFG))
    ids = torch.randint(0, 128, (2, 16))
    uses = _Uses(monkeypatch)
    frozen = torchfuser.optimize(copy.deepcopy(base), backend="reference", fp8="rowwise")
    for p in frozen.parameters():
        p.requires_grad_(False)
    frozen.model.embed_tokens.weight.requires_grad_(True)  # so there is a backward at all
    _step(frozen, ids)
    with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16):
        torchfuser.optimize(copy.deepcopy(base), backend="reference", fp8="rowwise")(input_ids=ids)
    _step(torchfuser.optimize(copy.deepcopy(base), backend="reference", fp8="tensorwise"), ids)
    assert uses.n == 0


def test_no_producer_under_torch_compile(monkeypatch):
    torch.manual_seed(0)
    model = torchfuser.optimize(LlamaForCausalLM(LlamaConfig(**CFG)), backend="reference", fp8="rowwise")
    taken = []
    real = fp8.producer_maxima
    monkeypatch.setattr(fp8, "producer_maxima", lambda *a: taken.append(real(*a)) or taken[-1])
    compiled = torch.compile(model, backend="eager", fullgraph=False)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        compiled(input_ids=torch.randint(0, 128, (2, 16))).logits.sum().backward()
    assert taken and not any(taken)


def test_a_call_with_no_tokens_runs_bf16_and_is_counted():
    """No tokens: no scale is defined, so the call runs the bf16 path (it crashed in the reference amax)."""
    torch.manual_seed(0)
    model = torchfuser.optimize(LlamaForCausalLM(LlamaConfig(**CFG)), backend="reference", fp8="rowwise")
    mlp = model.model.layers[0].mlp
    x = torch.zeros(0, CFG["hidden_size"], requires_grad=True)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        y = mlp(x)
    y.float().sum().backward()
    assert y.shape == (0, CFG["hidden_size"]) and x.grad.shape == x.shape
    reasons = [why for whys in torchfuser.report(model).fallbacks.values() for why in whys]
    assert any("no tokens" in why for why in reasons), reasons

