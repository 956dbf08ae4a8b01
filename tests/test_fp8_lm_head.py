"""``optimize(model, fp8=..., fp8_lm_head=True)``: the fused LM head + loss runs its three products (the
logits h·Wᵀ, dh = g·W, dW = gᵀ·h) as FP8 GEMMs (``backends._fp8_gemm.mm``), on the reference backend and
on the Triton one (Triton's interpreter on the CPU); off by default, off again on a second call, gone
with restore; calls it cannot take run bf16 and are counted in the report.

FP8 is lossy, so the numerics rule of docs/numerics.md does not apply. The rule here comes from
e4m3's precision: 3 mantissa bits, a relative rounding error of up to U = 2⁻⁴ per operand element.
A product of two such operands, summed over its inner dimension, stays within about U of the exact
one in norm, so each gradient is held to ‖got − want‖ ≤ 2·U·‖want‖ (which is a cosine similarity of
about 0.99, the rule tests/test_fp8.py holds the projections to) and the loss, a mean over tokens, to
1 %; against a float64 reference and against the bf16 fused head alike. The Triton backend and the
reference one quantise the same values but for the bf16 roundings of the Triton logits and softmax −
onehot, which move some of e4m3's rounding decisions: they agree within U / 2 in norm."""
from __future__ import annotations

import copy
import sys
from pathlib import Path

import pytest
import torch
import torch.nn.functional as TF
from transformers import LlamaConfig, LlamaForCausalLM

import torchfuser
import torchfuser.functional as F
from numerics import needs_mlir
from torchfuser.backends import _fp8_gemm, kernel

sys.path.insert(0, str(Path(__file__).parent / "backends"))
from test_triton_ops import DEVICE, interpreter  # noqa: E402,F401  (module fixture: the interpreted Triton backend)

U = 2.0 ** -4  # e4m3's unit roundoff (3 mantissa bits)
RECIPES = ("rowwise", "tensorwise")
VOCAB = 144  # no projection of the tiny llama has 144 rows or columns: the head's GEMMs are told by it
CFG = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=1, num_attention_heads=4,
           num_key_value_heads=2)


def _model():
    torch.manual_seed(0)
    return LlamaForCausalLM(LlamaConfig(**CFG))


class _HeadGemms:
    """The FP8 GEMMs the LM head's backends run (``_fp8_gemm.mm`` calls with a vocabulary-sized operand)."""

    def __init__(self, monkeypatch, vocab=VOCAB):
        self.shapes = []
        real = _fp8_gemm.mm

        def spy(a, b, out_dtype, bias=None):
            if vocab in (*a[0].shape, *b[0].shape):
                self.shapes.append((tuple(a[0].shape), tuple(b[0].shape)))
            return real(a, b, out_dtype, bias=bias)
        monkeypatch.setattr(_fp8_gemm, "mm", spy)

    @property
    def calls(self):
        return len(self.shapes)


def _cos(a, b):
    return TF.cosine_similarity(a.double().flatten(), b.double().flatten(), dim=0).item()


def _rel(a, b):
    return ((a.double() - b.double()).norm() / b.double().norm()).item()


def assert_lossy(got, want, what, tol=2 * U, loss_tol=1e-2):
    """(loss, grads) within the FP8 rule of the module docstring."""
    (loss, grads), (loss_want, grads_want) = got, want
    assert abs(loss - loss_want) <= loss_tol * abs(loss_want), f"{what}: loss {loss} against {loss_want}"
    assert len(grads) == len(grads_want)
    for i, (g, w) in enumerate(zip(grads, grads_want)):
        assert torch.isfinite(g).all(), f"{what}: gradient {i} not finite"
        assert _rel(g, w) <= tol, f"{what}: gradient {i} off by {_rel(g, w):.3e} in norm (> {tol:.3e})"
        if tol >= 2 * U:
            assert _cos(g, w) >= 0.99, f"{what}: gradient {i} cosine {_cos(g, w):.4f}"


# ---------------------------------------------------------------- the op

def _inputs(n=48, hdim=64, vocab=80, bias=False, seed=0, device="cpu"):
    g = torch.Generator().manual_seed(seed)
    h = torch.randn(n, hdim, generator=g).bfloat16()
    w = (torch.randn(vocab, hdim, generator=g) * 0.2).bfloat16()
    b = (torch.randn(vocab, generator=g) * 0.5).bfloat16() if bias else None
    labels = torch.randint(0, vocab, (n,), generator=g)
    return tuple(None if t is None else t.to(device) for t in (h, w, b, labels))


def _lce(backend, fp8, h, w, b, labels, **kw):
    """(loss, [dh, dW(, db)]) of functional.linear_cross_entropy, backward included."""
    leaves = [t.detach().clone().requires_grad_() for t in (h, w) + ((b,) if b is not None else ())]
    loss = F.linear_cross_entropy(leaves[0], leaves[1], labels, bias=leaves[2] if b is not None else None,
                                  backend=backend, fp8=fp8, **kw)
    loss.backward()
    return loss.item(), [t.grad for t in leaves]


def _lce64(h, w, b, labels, softcap=None, ignore_index=-100, reduction="mean"):
    leaves = [t.detach().double().requires_grad_() for t in (h, w) + ((b,) if b is not None else ())]
    z = leaves[0] @ leaves[1].T + (leaves[2] if b is not None else 0)
    if softcap is not None:
        z = torch.tanh(z / softcap) * softcap
    loss = TF.cross_entropy(z, labels, ignore_index=ignore_index, reduction=reduction)
    loss.backward()
    return loss.item(), [t.grad for t in leaves]


def _backend(name, request):
    """(backend, device): Triton's kernels on DEVICE (the CPU: interpreted; a GPU where there is one)."""
    if name == "triton":
        request.getfixturevalue("interpreter")
        return name, DEVICE
    return name, "cpu"


@pytest.mark.parametrize("recipe", RECIPES)
@pytest.mark.parametrize("backend", ["reference", "triton"])
def test_fp8_gemms_run_and_stay_close(backend, recipe, request, monkeypatch):
    """(a) the three products are FP8 GEMMs of the operands named in the backends' docstrings; (b) the
    loss and dh, dW within the FP8 rule of a float64 reference and of the bf16 fused op."""
    backend, device = _backend(backend, request)
    h, w, _, labels = _inputs(device=device)
    bf16 = _lce(backend, None, h, w, None, labels)
    gemms = _HeadGemms(monkeypatch, vocab=80)
    got = _lce(backend, recipe, h, w, None, labels)
    # logits q(h)·q(W)ᵀ, dh from q(g)·q(Wᵀ)ᵀ, dW = q(gᵀ)·q(hsᵀ)ᵀ
    assert gemms.shapes == [((48, 64), (80, 64)), ((48, 80), (64, 80)), ((80, 48), (64, 48))]
    with torch.no_grad():  # no gradients: the logits' GEMM alone
        F.linear_cross_entropy(h, w, labels, backend=backend, fp8=recipe)
    assert gemms.calls == 4
    assert_lossy(got, _lce64(h, w, None, labels), f"{backend} {recipe} vs float64")
    assert_lossy(got, bf16, f"{backend} {recipe} vs bf16")


@pytest.mark.parametrize("recipe", RECIPES)
@pytest.mark.parametrize("backend", ["reference", "triton"])
def test_softcap_bias_ignore_index_sum(backend, recipe, request):
    """(g) a bias (added in the CE kernel, its gradient Σ a·g), a softcap, ignored tokens (a custom
    ignore_index: their rows of dh are exactly 0) and the sum reduction, under FP8."""
    backend, device = _backend(backend, request)
    h, w, b, labels = _inputs(bias=True, seed=1, device=device)
    labels[::5] = 7
    for reduction in ("mean", "sum"):
        kw = dict(softcap=5.0, ignore_index=7, reduction=reduction)
        got = _lce(backend, recipe, h, w, b, labels, **kw)
        assert_lossy(got, _lce64(h, w, b, labels, **kw), f"{backend} {recipe} {reduction} vs float64")
        assert_lossy(got, _lce(backend, None, h, w, b, labels, **kw), f"{backend} {recipe} {reduction} vs bf16")
        assert torch.equal(got[1][0][::5], torch.zeros_like(got[1][0][::5]))


@pytest.mark.parametrize("recipe", RECIPES)
def test_triton_agrees_with_the_reference(recipe, interpreter, monkeypatch):  # noqa: F811
    """(c) the Triton FP8 path against the reference one, in one chunk and in three of 16 tokens (its
    chunks quantise gᵀ and hsᵀ per chunk; W's two copies are still made once per call)."""
    h, w, b, labels = _inputs(bias=True, seed=2, device=DEVICE)
    labels[3::7] = -100
    kw = dict(softcap=30.0)
    want = _lce("reference", recipe, h, w, b, labels, **kw)
    assert_lossy(_lce("triton", recipe, h, w, b, labels, **kw), want, f"triton vs reference {recipe}", tol=U / 2,
                 loss_tol=1e-3)
    # The module of the function the dispatch runs (remembered since the first interpreted import,
    # perhaps another test module's): chunks of 16 tokens at most, and W's quantisation counted.
    lce = kernel("triton", "linear_cross_entropy_fwd").__globals__
    monkeypatch.setitem(lce, "EXTRA_BYTES", 0)
    monkeypatch.setitem(lce, "MIN_CHUNK_BYTES", 1)
    monkeypatch.setitem(lce, "FP8_MIN_CHUNK", 16)
    both = []
    real = lce["fp8_quantize_both"]
    monkeypatch.setitem(lce, "fp8_quantize_both", lambda t, tw: both.append(tuple(t.shape)) or real(t, tw))
    gemms = _HeadGemms(monkeypatch, vocab=80)
    got = _lce("triton", recipe, h, w, b, labels, **kw)
    assert gemms.calls == 3 * 3 and [s for s in both if s == (80, 64)] == [(80, 64)]
    assert both.count((16, 80)) == 3  # each chunk's g, both ways
    assert_lossy(got, want, f"triton in chunks vs reference {recipe}", tol=U / 2, loss_tol=1e-3)


@needs_mlir
def test_mlir_runs_fp8_on_the_reference_backend(monkeypatch):
    """The MLIR backend has no FP8 GEMMs: fp8 on the CPU runs on the reference backend, whichever is asked."""
    h, w, b, labels = _inputs(bias=True)
    want = _lce("reference", "rowwise", h, w, b, labels)
    gemms = _HeadGemms(monkeypatch, vocab=80)
    for backend in ("mlir", "auto"):
        got = _lce(backend, "rowwise", h, w, b, labels)
        assert got[0] == want[0] and all(torch.equal(g, v) for g, v in zip(got[1], want[1]))
    assert gemms.calls == 6
    with pytest.raises(ValueError, match="backend 'mlir' has no FP8 GEMMs"):  # the op itself, asked directly
        torch.ops.torchfuser.linear_cross_entropy_fwd(h, w, None, labels, -100, None, "mean", False, "rowwise", "mlir")


def test_fp8_needs_bf16_and_multiples_of_16():
    h, w, _, labels = _inputs()
    with pytest.raises(ValueError, match="in float32; FP8 GEMMs need bf16"):
        F.linear_cross_entropy(h.float(), w.float(), labels, backend="reference", fp8="rowwise")
    with pytest.raises(ValueError, match="47 tokens × 64 → 80 is not in multiples of 16"):
        F.linear_cross_entropy(h[:47], w, labels[:47], backend="reference", fp8="rowwise")
    with pytest.raises(ValueError, match="fp8 must be None, 'rowwise' or 'tensorwise'"):
        F.linear_cross_entropy(h, w, labels, backend="reference", fp8="e5m2")
    with torch.autocast("cpu", dtype=torch.bfloat16):  # fp32 tensors under bf16 autocast: FP8 runs
        assert F.linear_cross_entropy_fp8_blocker(h.float(), w.float()) is None
        F.linear_cross_entropy(h.float(), w.float(), labels, backend="reference", fp8="rowwise")


def test_fake_impl_matches_the_fp8_outputs():
    """The gradients keep their dtypes and shapes under FP8: the fake impl (torch.compile plans from it)."""
    h, w, b, labels = _inputs(bias=True)
    op = torch.ops.torchfuser.linear_cross_entropy_fwd
    for need_grad in (True, False):
        args = (h, w, b, labels, -100, None, "mean", need_grad, "tensorwise", "reference")
        real = op(*args)
        fake = op(*[a.to("meta") if isinstance(a, torch.Tensor) else a for a in args])
        for r, f in zip(real, fake):
            assert (r.shape, r.dtype, r.stride()) == (f.shape, f.dtype, f.stride())


# ---------------------------------------------------------------- optimize(model, fp8_lm_head=True)

def _step(model, ids, autocast=True):
    model.zero_grad(set_to_none=True)
    ids = ids.to(next(model.parameters()).device)
    with torch.autocast(ids.device.type, dtype=torch.bfloat16, enabled=autocast):
        loss = model(input_ids=ids, labels=ids).loss
    loss.backward()
    return loss.item(), [p.grad.clone() for p in model.parameters()]


def _ids(length=16, seed=1):
    return torch.randint(0, VOCAB, (2, length), generator=torch.Generator().manual_seed(seed))


def _head_fp8(model):
    return model.__dict__["forward"].fp8 if "forward" in model.__dict__ else None


@pytest.mark.parametrize("recipe", RECIPES)
@pytest.mark.parametrize("backend", ["reference", "triton"])
def test_model_head_runs_fp8_close_to_bf16(backend, recipe, request, monkeypatch):
    """A tiny llama with only its head fused (the projections stay unfused, in bf16 autocast): the head's
    GEMMs run FP8, and the loss and every gradient stay within the FP8 rule of the bf16 fused head's
    and of the float64 model's. The report says the head runs FP8, and counts no fallback."""
    backend, device = _backend(backend, request)
    base = _model().to(device)
    bf16 = torchfuser.optimize(copy.deepcopy(base), backend=backend, patterns=["lm_head_loss"], fp8=recipe)
    model = torchfuser.optimize(copy.deepcopy(base), backend=backend, patterns=["lm_head_loss"], fp8=recipe,
                                fp8_lm_head=True)
    assert list(model.state_dict()) == list(base.state_dict())
    assert _head_fp8(model) == recipe and _head_fp8(bf16) is None
    note = next(n for n in torchfuser.report(model).notes if n.startswith("fp8: "))
    assert "LM head + loss runs FP8 GEMMs too" in note and "stays bf16" not in note
    ids = _ids()
    gemms = _HeadGemms(monkeypatch)
    want = _step(bf16, ids)
    assert gemms.calls == 0
    got = _step(model, ids)
    assert gemms.calls == 3
    assert_lossy(got, want, f"{backend} {recipe} vs bf16 head")
    assert_lossy(got, _step(copy.deepcopy(base).double(), ids, autocast=False), f"{backend} {recipe} vs float64")
    assert not torchfuser.report(model).fallbacks


def test_needs_fp8():
    """(d) fp8_lm_head without fp8 says what to pass, before anything changes."""
    model = _model()
    with pytest.raises(ValueError, match="fp8='rowwise' or fp8='tensorwise'"):
        torchfuser.optimize(model, backend="reference", fp8_lm_head=True)
    assert "forward" not in model.__dict__
    with pytest.raises(TypeError, match="fp8_lm_head must be True or False"):
        torchfuser.optimize(model, backend="reference", fp8="rowwise", fp8_lm_head="yes")


def test_off_by_default_off_again_and_gone_after_restore(monkeypatch):
    """(e) fp8 alone leaves the head bf16 (said in the note); a second optimize keeps fp8_lm_head as it is
    unless passed, fp8_lm_head=False or fp8=None turns it off; restore takes it away with the fused
    forward, and a later optimize starts without it."""
    model = torchfuser.optimize(_model(), backend="reference", patterns=["lm_head_loss"], fp8="rowwise")
    assert _head_fp8(model) is None
    assert any("the LM head stays bf16 (fp8_lm_head=False)" in n for n in torchfuser.report(model).notes)
    gemms = _HeadGemms(monkeypatch)
    ids = _ids()
    _step(model, ids)
    assert gemms.calls == 0
    torchfuser.optimize(model, backend="reference", patterns=["lm_head_loss"], fp8="rowwise", fp8_lm_head=True)
    _step(model, ids)
    assert gemms.calls == 3
    torchfuser.optimize(model, backend="reference", patterns=["lm_head_loss"], fp8="rowwise")
    assert _head_fp8(model) == "rowwise"  # kept
    torchfuser.optimize(model, backend="reference", patterns=["lm_head_loss"], fp8="rowwise", fp8_lm_head=False)
    assert _head_fp8(model) is None
    _step(model, ids)
    assert gemms.calls == 3
    torchfuser.optimize(model, backend="reference", patterns=["lm_head_loss"], fp8="rowwise", fp8_lm_head=True)
    torchfuser.optimize(model, backend="reference", patterns=["lm_head_loss"], fp8=None)
    assert _head_fp8(model) is None and not any(n.startswith("fp8: ") for n in torchfuser.report(model).notes)
    torchfuser.optimize(model, backend="reference", patterns=["lm_head_loss"], fp8="tensorwise", fp8_lm_head=True)
    torchfuser.restore(model)
    assert "forward" not in model.__dict__
    torchfuser.optimize(model, backend="reference", patterns=["lm_head_loss"], fp8="rowwise")
    assert _head_fp8(model) is None
    _step(model, ids)
    assert gemms.calls == 3


def test_calls_it_cannot_take_run_bf16_and_are_counted(monkeypatch):
    """(f) 2 × 17 tokens (not a multiple of 16) and float32 (no autocast): the head runs bf16 / fp32, as
    with fp8_lm_head off, and the report counts each call with its reason."""
    base = _model()
    bf16 = torchfuser.optimize(copy.deepcopy(base), backend="reference", patterns=["lm_head_loss"], fp8="rowwise")
    model = torchfuser.optimize(copy.deepcopy(base), backend="reference", patterns=["lm_head_loss"], fp8="rowwise",
                                fp8_lm_head=True)
    gemms = _HeadGemms(monkeypatch)
    ids = _ids(length=17)
    for autocast in (True, True, False):
        (loss, grads), (loss_want, grads_want) = _step(model, ids, autocast), _step(bf16, ids, autocast)
        assert loss == loss_want and all(torch.equal(g, w) for g, w in zip(grads, grads_want))
    assert gemms.calls == 0
    reasons = torchfuser.report(model).fallbacks[""]
    assert reasons == {
        "fp8: the LM head + loss ran without FP8 GEMMs: 34 tokens × 64 → 144 is not in multiples of 16 "
        "(pad the batch's tokens to a multiple of 16)": 2,
        "fp8: the LM head + loss ran without FP8 GEMMs: its products would run in float32; FP8 GEMMs need "
        "bf16 operands (bf16 autocast or bf16 hidden states and weight)": 1,
    }
    assert any("(model): 2 calls left the fused path: fp8: the LM head" in n for n in torchfuser.report(model).notes)


def test_fp8_chunks_of_a_real_head_stay_large():
    """At llama1b's head (8192 tokens, 2048 → 128256) FP8 runs chunks of at least 1024 tokens: W's e4m3
    copies and the chunk's dW product once counted against the chunks' memory left 43 chunks of ≈ 190
    tokens a step, 35 ms slower than bf16's 6 (run 127)."""
    from torchfuser.backends.triton import linear_cross_entropy as L

    n, v, h = 8192, 128256, 2048
    grads = n * h * 2 + v * h * 2  # dh and dW in bf16, what the forward counts
    rows = L.chunk_rows(n, v, 2, grads, h, fp8=True)
    assert rows >= L.FP8_MIN_CHUNK == 1024 and len(L.chunks(n, rows)) <= 8
