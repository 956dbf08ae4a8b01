"""``optimize(model, fp8=...)``: the fused blocks' projections run FP8 GEMMs (torch._scaled_mm, which
PyTorch also runs on the CPU) forward and backward; the loss and every gradient stay close to the
bf16 fused model's; the weights' FP8 copies are made at every call (or once per optimizer step); errors are clear.

FP8 is lossy by design, so the numerics rule of docs/numerics.md does not apply: the loss is held
within 1 % of bf16's and every gradient to a cosine similarity of 0.99 with bf16's."""
from __future__ import annotations

import copy

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM

import torchfuser
from torchfuser.modules import fp8

# blockwise needs every GEMM side in multiples of 128: tests/test_fp8_blockwise.py, with a model of such sides
RECIPES = ("rowwise", "tensorwise")
CFG = dict(vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
           num_key_value_heads=2)


def _model():
    torch.manual_seed(0)
    return LlamaForCausalLM(LlamaConfig(**CFG))


class _Count:
    """The FP8 GEMMs run (``fp8.mm`` calls: ``torch._scaled_mm``, or its math in fp32 where this build's
    CPU kernel takes per-tensor scales only, as torch 2.11's)."""

    def __init__(self, monkeypatch):
        self.calls = 0
        real = fp8.mm

        def spy(*args, **kwargs):
            self.calls += 1
            return real(*args, **kwargs)
        monkeypatch.setattr(fp8, "mm", spy)


def _step(model, ids, autocast=True):
    model.zero_grad(set_to_none=True)
    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
        loss = model(input_ids=ids, labels=ids).loss
    loss.backward()
    return loss.item(), {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


@pytest.mark.parametrize("recipe", RECIPES)
def test_fp8_trains_close_to_bf16(recipe, monkeypatch):
    base = _model()
    bf16 = torchfuser.optimize(copy.deepcopy(base), backend="reference")
    model = torchfuser.optimize(copy.deepcopy(base), backend="reference", fp8=recipe)
    assert list(model.state_dict()) == list(base.state_dict())
    assert any(n.startswith("fp8: " + recipe) for n in torchfuser.report(model).notes)
    ids = torch.randint(0, 128, (2, 16), generator=torch.Generator().manual_seed(1))
    want, want_g = _step(bf16, ids)
    count = _Count(monkeypatch)
    got, got_g = _step(model, ids)
    # q/k/v, o, gate/up and down in each of the two layers; one GEMM forward, two backward.
    assert count.calls == 4 * 2 * 3
    assert abs(got - want) < 1e-2 * abs(want)
    assert list(got_g) == list(want_g)
    for name, g in want_g.items():
        cos = torch.nn.functional.cosine_similarity(got_g[name].flatten(), g.flatten(), dim=0)
        assert cos > 0.99, (name, cos.item())


def test_trainable_weights_are_quantised_at_every_call(monkeypatch):
    model = torchfuser.optimize(_model(), backend="reference", fp8="rowwise")
    made = []
    real = fp8.quantize_both
    monkeypatch.setattr(fp8, "quantize_both", lambda t, recipe, *a: made.append(tuple(t.shape)) or real(t, recipe, *a))
    ids = torch.randint(0, 128, (2, 16))
    h, q, kv, inter = CFG["hidden_size"], CFG["hidden_size"], CFG["hidden_size"] // 2, CFG["intermediate_size"]
    weights = [(q + 2 * kv, h), (h, q), (2 * inter, h), (h, inter)] * CFG["num_hidden_layers"]  # qkv, o, gate/up, down
    for _ in range(2):  # two micro-batches
        before = len(made)
        with torch.autocast("cpu", dtype=torch.bfloat16):
            model(input_ids=ids, labels=ids).loss.backward()
        step = made[before:]
        # Every group's weights both ways (rowwise of W and of Wᵀ) at every call, and so are x and dy
        # (32 tokens: both dx and dW are needed).
        assert sorted(s for s in step if s[0] != 32) == sorted(weights)
        assert len(step) == 3 * len(weights)


@pytest.mark.parametrize("fused", [False, True])
def test_fp8_forward_follows_the_optimizer_step(fused):
    """A fused AdamW updates the weights in place without bumping their version counters: the next
    forward must still see the new weights (a cache keyed on versions trained on the first step's)."""
    model = torchfuser.optimize(_model(), backend="reference", fp8="rowwise")
    ids = torch.randint(0, 128, (2, 16), generator=torch.Generator().manual_seed(3))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, fused=fused)
    for _ in range(2):
        with torch.autocast("cpu", dtype=torch.bfloat16):
            model(input_ids=ids, labels=ids).loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
    fresh = torchfuser.optimize(torchfuser.restore(copy.deepcopy(model)), backend="reference", fp8="rowwise")
    with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16):
        torch.testing.assert_close(model(input_ids=ids, labels=ids).loss, fresh(input_ids=ids, labels=ids).loss,
                                   rtol=0, atol=0)


@pytest.mark.parametrize("recipe", [*RECIPES, None])
def test_a_backward_inside_autocast_computes_what_one_outside_does(recipe):
    """torch._scaled_mm is on autocast's list: a backward called inside the autocast region (as many
    training loops do) once recast its scales, and dW came out ≈ 5 % off. The FP8 backward runs with
    autocast off, as its forward does, so both places give the same bits (None: the bf16 fused model's
    backward, likewise)."""
    model = torchfuser.optimize(_model(), backend="reference", fp8=recipe)
    ids = torch.randint(0, 128, (2, 16), generator=torch.Generator().manual_seed(4))
    _, outside = _step(model, ids)
    model.zero_grad(set_to_none=True)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        model(input_ids=ids, labels=ids).loss.backward()
    for name, q in model.named_parameters():
        torch.testing.assert_close(q.grad, outside[name], rtol=0, atol=0, msg=name)


def test_accumulation_clipping_and_checkpointing():
    """Two micro-batches accumulated give the sum of their gradients; HF gradient checkpointing (the
    layers' forwards recomputed in the backward, quantisation included) gives the same gradients as
    without it; clipping then scales them all alike. Every projection ran FP8 (no fallback counted)."""
    base = _model()
    plain = torchfuser.optimize(copy.deepcopy(base), backend="reference", fp8="rowwise")
    ckpt = copy.deepcopy(base)
    ckpt.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    ckpt = torchfuser.optimize(ckpt, backend="reference", fp8="rowwise")
    gen = torch.Generator().manual_seed(5)
    batches = [torch.randint(0, 128, (2, 16), generator=gen) for _ in range(2)]
    singles = []
    for ids in batches:
        plain.zero_grad(set_to_none=True)
        singles.append(_step(plain, ids)[1])
    grads = {}
    for model in (plain, ckpt):
        model.zero_grad(set_to_none=True)
        for ids in batches:
            with torch.autocast("cpu", dtype=torch.bfloat16):
                model(input_ids=ids, labels=ids).loss.backward()
        grads[model is ckpt] = {n: q.grad.clone() for n, q in model.named_parameters()}
    for name, g in grads[False].items():
        torch.testing.assert_close(g, singles[0][name] + singles[1][name], rtol=1e-5, atol=1e-7, msg=name)
        torch.testing.assert_close(grads[True][name], g, rtol=0, atol=0, msg=name)  # same ops, same bits
    norm = torch.nn.utils.clip_grad_norm_(plain.parameters(), 0.5)
    assert torch.isfinite(norm) and norm > 0.5
    for name, q in plain.named_parameters():
        torch.testing.assert_close(q.grad, grads[False][name] * (0.5 / (norm + 1e-6)), rtol=1e-5, atol=0)
    assert not torchfuser.report(plain).fallbacks and not torchfuser.report(ckpt).fallbacks


@pytest.mark.parametrize("mode", ["per_call", "per_step"])
def test_frozen_weights_are_quantised_per_call_or_kept_per_step(mode, monkeypatch):
    """Frozen weights as trainable ones: per call by default (a ``param.data`` write is invisible to any key,
    tests/test_fp8_weight_writes.py), kept with ``per_step`` while no optimizer steps."""
    model = torchfuser.optimize(_model(), backend="reference", fp8="tensorwise", fp8_weights=mode)
    for p in model.parameters():
        p.requires_grad_(False)
    model.model.embed_tokens.weight.requires_grad_(True)  # something to train: the gradient reaches every layer
    made = []
    real = fp8.quantize
    monkeypatch.setattr(fp8, "quantize", lambda t, recipe, **kw: made.append(t.shape) or real(t, recipe, **kw))
    ids = torch.randint(0, 128, (2, 16))
    for _ in range(2):
        with torch.autocast("cpu", dtype=torch.bfloat16):
            model(input_ids=ids, labels=ids).loss.backward()
    groups = 4 * 2
    weights = groups * 2 * (2 if mode == "per_call" else 1)  # both copies: every call, or once
    assert len(made) == weights + 2 * groups * 2  # x and dy each call (no dW)


def test_off_again_and_restore():
    model = torchfuser.optimize(_model(), backend="reference", fp8="rowwise")
    torchfuser.optimize(model, backend="reference")  # kept
    assert any("_fp8" in m.__dict__ for m in model.modules())
    torchfuser.optimize(model, fp8=None)
    assert not any("_fp8" in m.__dict__ for m in model.modules())
    assert not any(n.startswith("fp8: ") for n in torchfuser.report(model).notes)
    torchfuser.restore(model)
    assert not any("_fp8" in m.__dict__ for m in model.modules())


def test_float32_calls_run_without_fp8_and_are_counted():
    model = torchfuser.optimize(_model(), backend="reference", fp8="rowwise")
    ids = torch.randint(0, 128, (2, 16))
    _step(model, ids, autocast=False)
    reasons = [why for per_module in torchfuser.report(model).fallbacks.values() for why in per_module]
    assert reasons and all("float32, not FP8" in why for why in reasons)


def test_bad_requests_say_what_to_do(monkeypatch):
    with pytest.raises(ValueError, match="'rowwise', 'tensorwise' or 'blockwise'"):
        torchfuser.optimize(_model(), fp8="e5m2")
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (8, 0))
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: "NVIDIA A100")
    with pytest.raises(ValueError, match="compute capability 8.9 or newer.*A100 is 8.0"):
        fp8.check("rowwise", torch.device("cuda", 0))
    with pytest.raises(ValueError, match="not on mps"):
        fp8.check("rowwise", torch.device("mps"))


def test_tokens_not_in_multiples_of_16_run_bf16_and_are_counted(monkeypatch):
    model = torchfuser.optimize(_model(), backend="reference", fp8="rowwise")
    count = _Count(monkeypatch)
    _step(model, torch.randint(0, 128, (1, 15)))
    assert count.calls == 0
    reasons = [why for per_module in torchfuser.report(model).fallbacks.values() for why in per_module]
    assert reasons and all("multiples of 16" in why for why in reasons)


def test_compiled_or_captured_calls_quantise_the_weights_every_call(monkeypatch):
    """A graph that recorded a cached FP8 copy would replay it after the optimizer changed the weight."""
    model = torchfuser.optimize(_model(), backend="reference", fp8="rowwise")
    made = []
    real = fp8.quantize
    monkeypatch.setattr(fp8, "quantize", lambda t, recipe, **kw: made.append(t.shape) or real(t, recipe, **kw))
    monkeypatch.setattr(fp8, "_recording", lambda t: True)
    ids = torch.randint(0, 128, (2, 16))
    counts = []
    for _ in range(2):
        before = len(made)
        with torch.autocast("cpu", dtype=torch.bfloat16), torch.no_grad():
            model(input_ids=ids)
        counts.append(len(made) - before)
    assert counts == [4 * 2 * 3] * 2  # x and both weight copies, every call


def test_torch_compile_traces_the_fp8_projections():
    model = torchfuser.optimize(_model(), backend="reference", fp8="rowwise")
    ids = torch.randint(0, 128, (2, 16))
    want, _ = _step(model, ids)
    got, grads = _step(torch.compile(model), ids)
    torch._dynamo.reset()
    assert abs(got - want) < 1e-2 * abs(want)
    assert grads and all(torch.isfinite(g).all() for g in grads.values())


def test_lora_bases_run_fp8_and_are_quantised_per_call(monkeypatch):
    """PEFT LoRA on a bf16 model: the frozen bases' products are FP8 GEMMs inside the fused LoRA node
    (forward and dx), quantised at every call; the adapters stay in their own dtype and train as with bf16."""
    peft = pytest.importorskip("peft")

    def lora_model(recipe):
        torch.manual_seed(0)
        model = LlamaForCausalLM(LlamaConfig(**CFG)).to(torch.bfloat16)
        torchfuser.optimize(model, backend="reference", fp8=recipe)
        torch.manual_seed(1)
        cfg = peft.LoraConfig(r=8, lora_alpha=16, target_modules="all-linear", lora_dropout=0.0, init_lora_weights=False)
        return peft.get_peft_model(model, cfg)

    ids = torch.randint(0, 128, (2, 16), generator=torch.Generator().manual_seed(1))
    want, want_g = _step(lora_model(None), ids, autocast=False)
    model = lora_model("rowwise")
    count = _Count(monkeypatch)
    made = []
    real = fp8.quantize
    monkeypatch.setattr(fp8, "quantize", lambda t, recipe, **kw: made.append(t.shape) or real(t, recipe, **kw))
    got, got_g = _step(model, ids, autocast=False)
    # Each group's base: forward and dx (frozen: no dW), but for the first layer's q/k/v, whose input
    # (the frozen embeddings, normed) needs no gradient.
    assert count.calls == 4 * 2 * 2 - 1
    first = len(made)
    _step(model, ids, autocast=False)
    assert len(made) - first == first  # the second step made the weight copies again (per call)
    assert abs(got - want) < 1e-2 * abs(want)
    assert list(got_g) == list(want_g) and all("lora_" in n for n in got_g)
    for name, g in want_g.items():
        cos = torch.nn.functional.cosine_similarity(got_g[name].flatten().float(), g.flatten().float(), dim=0)
        assert cos > 0.99, (name, cos.item())


def test_transposed_quantisation_is_that_of_the_transposed_copy():
    """dW's operands: ``quantize(t, recipe, transpose=True)`` gives exactly what quantising
    ``t.t().contiguous()`` gave, from t itself (the Triton kernels write it transposed on CUDA)."""
    g = torch.Generator().manual_seed(0)
    t = (torch.randn(48, 80, generator=g) * torch.exp(torch.randn(1, 80, generator=g))).bfloat16()
    for recipe in RECIPES:
        (q, s), (qr, sr) = fp8.quantize(t, recipe, transpose=True), fp8.quantize(t.t().contiguous(), recipe)
        assert q.shape == (80, 48) and q.is_contiguous() and s.shape == sr.shape
        assert torch.equal(q.view(torch.uint8), qr.view(torch.uint8)) and torch.equal(s, sr)


def test_backward_quantises_dw_operands_transposed(monkeypatch):
    """Per projection group and step: x, dy and the weight as they are (forward, dx), dy, x and the
    weight transposed (dW, and the weight's copy for dx), and never a transposed copy of any."""
    model = torchfuser.optimize(_model(), backend="reference", fp8="rowwise")
    seen = []
    real = fp8.quantize
    # SwiGLU's outputs, forward and backward, hand their maxima on and skip quantize (test_fp8_producers.py)
    monkeypatch.setattr(fp8, "producer_maxima", lambda *a: False)
    monkeypatch.setattr(fp8, "quantize", lambda t, recipe, transpose=False: seen.append(
        (transpose, t.is_contiguous())) or real(t, recipe, transpose))
    _step(model, torch.randint(0, 128, (2, 16)))
    groups = 4 * 2
    assert sorted(seen) == sorted([(False, True)] * 3 * groups + [(True, True)] * 3 * groups)


def _group(recipe, outs=(32, 16), bias=False, trainable=True):
    torch.manual_seed(0)
    linears = [torch.nn.Linear(64, n, bias=bias) for n in outs]
    for m in linears:
        m.requires_grad_(trainable)
    owner = torch.nn.Module()
    owner.__dict__["_fp8"] = recipe
    return owner, linears


@pytest.mark.parametrize("recipe", RECIPES)
@pytest.mark.parametrize("bias", [False, True])
def test_backward_keeps_e4m3_not_the_input(recipe, bias):
    """dW's operand xᵀ is made in the forward, with x's own quantisation (one pass pair on CUDA), and kept
    for the backward in e4m3 with its fp32 scales: no bf16 or fp32 copy of the projection's input is
    saved (half its bytes; the backward reads no x). The gradients are those of quantising x, dy and W in
    the backward as before, bit for bit."""
    owner, linears = _group(recipe, bias=bias)
    x = torch.randn(2, 16, 64, generator=torch.Generator().manual_seed(1)).bfloat16().requires_grad_()
    saved = []
    with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(t) or t, lambda t: t):
        with torch.autocast("cpu", dtype=torch.bfloat16):
            y = fp8.linear(x, linears, owner)
    assert y is not None and y.shape == (2, 16, 48) and y.dtype == torch.bfloat16
    scale = () if recipe == "tensorwise" else (64, 1)
    assert [(t.dtype, tuple(t.shape)) for t in saved] == [(fp8.E4M3, (64, 32)), (torch.float32, scale)]
    dy = torch.randn(2, 16, 48, generator=torch.Generator().manual_seed(2)).bfloat16()
    y.backward(dy)

    x2, dy2 = x.detach().reshape(32, 64), dy.reshape(32, 48)
    w = torch.cat([m.weight.detach() for m in linears])
    b = torch.cat([m.bias.detach() for m in linears]).bfloat16() if bias else None
    want_y = fp8.mm(fp8.quantize(x2, recipe), fp8.quantize(w, recipe), torch.bfloat16, bias=b)
    want_dx = fp8.mm(fp8.quantize(dy2, recipe), fp8.quantize(w, recipe, transpose=True), torch.bfloat16)
    want_dw = fp8.mm(fp8.quantize(dy2, recipe, transpose=True), fp8.quantize(x2, recipe, transpose=True),
                     torch.float32)
    assert torch.equal(y.detach().reshape(32, 48), want_y)
    assert torch.equal(x.grad.reshape(32, 64), want_dx)
    assert torch.equal(torch.cat([m.weight.grad for m in linears]), want_dw)
    if bias:
        assert torch.equal(torch.cat([m.bias.grad for m in linears]), dy2.sum(0, dtype=torch.float32))


@pytest.mark.parametrize("recipe", RECIPES)
def test_what_each_call_quantises_and_keeps(recipe, monkeypatch):
    """Both ways only where both GEMMs need the operand: frozen weights keep nothing of x and quantise x and
    dy rowwise only; an input that needs no gradient gets dy transposed only; no grad mode, no Function."""
    calls, inside = [], []
    real_q, real_b = fp8.quantize, fp8.quantize_both

    def both(t, r, amax=None):  # on the CPU its two quantize calls (the reference composition) are not counted apart
        calls.append("both")
        inside.append(1)
        try:
            return real_b(t, r, amax)
        finally:
            inside.pop()

    def one(t, r, transpose=False):
        if not inside:
            calls.append("t" if transpose else "r")
        return real_q(t, r, transpose=transpose)
    monkeypatch.setattr(fp8, "quantize", one)
    monkeypatch.setattr(fp8, "quantize_both", both)

    def run(x_grad, trainable, grad=True):
        owner, linears = _group(recipe, outs=(32,), trainable=trainable)
        x = torch.randn(32, 64).bfloat16().requires_grad_(x_grad)
        saved = []
        calls.clear()
        with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(t) or t, lambda t: t), \
                torch.set_grad_enabled(grad), torch.autocast("cpu", dtype=torch.bfloat16):
            y = fp8.linear(x, linears, owner)
        fwd = list(calls)
        if y.requires_grad:
            y.backward(torch.ones_like(y))
        assert not trainable or not grad or linears[0].weight.grad is not None
        assert not x_grad or not grad or x.grad is not None
        return fwd, calls[len(fwd):], len(saved), y.grad_fn is not None

    # (the weights' two copies come from quantize_both, made at every call, trainable or frozen)
    assert run(True, True) == (["both", "both"], ["both"], 2, True)
    assert run(True, False) == (["both", "r"], ["r"], 0, True)
    assert run(False, True) == (["both", "both"], ["t"], 2, True)
    assert run(True, True, grad=False) == (["both", "r"], [], 0, False)


def test_projection_biases_in_the_gemm_epilogue(monkeypatch):
    """Qwen2's q/k/v biases are added by the FP8 GEMM itself (``_scaled_mm(bias=...)``), not by a pass of
    their own; the loss and every gradient (the biases' too) stay close to the bf16 fused model's."""
    from transformers import Qwen2Config, Qwen2ForCausalLM

    torch.manual_seed(0)
    base = Qwen2ForCausalLM(Qwen2Config(**CFG))
    with torch.no_grad():
        for name, p in base.named_parameters():
            if name.endswith("bias"):
                p.normal_(std=0.02)  # Qwen2 starts them at 0: non-zero, at the weights' init scale
    bf16 = torchfuser.optimize(copy.deepcopy(base), backend="reference")
    model = torchfuser.optimize(copy.deepcopy(base), backend="reference", fp8="rowwise")
    ids = torch.randint(0, 128, (2, 16), generator=torch.Generator().manual_seed(1))
    want, want_g = _step(bf16, ids)
    with_bias, epilogue = [], []
    real_mm, real_scaled = fp8.mm, torch._scaled_mm
    monkeypatch.setattr(fp8, "mm", lambda *a, **k: with_bias.append(k.get("bias") is not None) or real_mm(*a, **k))
    monkeypatch.setattr(torch, "_scaled_mm",
                        lambda *a, **k: epilogue.append(k.get("bias") is not None) or real_scaled(*a, **k))
    got, got_g = _step(model, ids)
    assert sum(with_bias) == 2  # each layer's q/k/v forward GEMM
    if fp8._cpu_rowwise():  # else the products are _scaled_mm's math in fp32 (torch 2.11's CPU), bias added there
        assert sum(epilogue) == 2
    assert abs(got - want) < 1e-2 * abs(want)
    assert list(got_g) == list(want_g) and any(n.endswith("q_proj.bias") for n in got_g)
    for name, g in want_g.items():
        cos = torch.nn.functional.cosine_similarity(got_g[name].flatten(), g.flatten(), dim=0)
        assert cos > 0.99, (name, cos.item())


def test_quantisation_under_torch_compile_follows_the_policy(monkeypatch):
    """On CUDA a compiled graph traces the quantisation as PyTorch code by default (Inductor fuses it with
    the operand's producer); TORCHFUSER_COMPILED_ELEMENTWISE=kernels keeps the Triton custom op."""
    from torchfuser.ops import fp8_quant

    monkeypatch.delenv("TORCHFUSER_COMPILED_ELEMENTWISE", raising=False)
    assert fp8_quant._compiled_as_definition()
    for policy, definition in (("kernels", False), ("inductor", True), ("inductor:fp8_quantize", True),
                               ("inductor:rms_norm", False)):
        monkeypatch.setenv("TORCHFUSER_COMPILED_ELEMENTWISE", policy)
        monkeypatch.setattr(torch.compiler, "is_compiling", lambda: True)
        assert fp8_quant._compiled_as_definition() is definition, policy


def test_cpu_rowwise_emulation_is_scaled_mm_math(monkeypatch):
    """torch 2.11's CPU _scaled_mm takes per-tensor scales only (the GPU machine's CPU): rowwise products
    there are computed as its math in fp32, which must equal what a build that has them computes."""
    a, b, bias = torch.randn(32, 64), torch.randn(48, 64), torch.randn(48)
    qa, qb = fp8.quantize(a, "rowwise"), fp8.quantize(b, "rowwise")
    monkeypatch.setattr(fp8, "_cpu_rowwise", lambda: False)
    emulated = fp8.mm(qa, qb, torch.float32, bias)
    want = (qa[0].double() * qa[1].double()) @ (qb[0].double() * qb[1].double()).t() + bias.double()
    torch.testing.assert_close(emulated.double(), want, rtol=1e-5, atol=1e-5)
    monkeypatch.undo()
    if fp8._cpu_rowwise():
        torch.testing.assert_close(fp8.mm(qa, qb, torch.float32, bias), emulated, rtol=1e-5, atol=1e-5)
