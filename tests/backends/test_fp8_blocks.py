"""The blockwise FP8 kernels (backends/triton/fp8_blocks.py) against the reference quantisation
(backends/reference/fp8_blocks.py, run on the CPU: true divisions), bit for bit in the e4m3 values and
the fp32 scales, with the same shapes, dtypes and strides: an activation rows only, columns only and both
ways; a weight's 128 × 128 blocks in scaled_mm's padded scale layouts (the round-up rows of 1 written by
the kernel); fp32 / bf16 / fp16; one and several blocks each way, wide (128 × 8192) and tall (1024 × 128);
transposed, row-strided and both-strided inputs; NaN, ±inf, zero and tiny blocks (a NaN makes only its
own block's scale and values NaN); values on every e4m3 rounding tie; one launch a call; the op layer's
fake layouts; the reference's errors. Run by Triton's interpreter on the CPU (TRITON_INTERPRET=1, its
e4m3 cast fixed to round as the GPU does: _interpret.py), compiled on a GPU where there is one.
"""
from __future__ import annotations

import pytest
import torch

from test_triton_ops import DEVICE, interpreter  # noqa: F401  (module fixture: the interpreted backend)
from torchfuser.backends.reference import fp8_blocks as R
from torchfuser.backends.reference.fp8_quant import rounding_cases

pytest.importorskip("triton")

WAYS = {"rows": (True, False), "cols": (False, True), "both": (True, True)}


def _assert_same(got, want, what, strides=True):
    """Each output: equal shape, dtype and strides; equal bit patterns, NaN only as NaN (its sign bit
    is not specified)."""
    assert len(got) == len(want) == 4, what
    for i, (g, w) in enumerate(zip(got, want)):
        where = f"{what} [output {i}]"
        layout = lambda x: (x.shape, x.dtype, x.stride() if strides else None)  # noqa: E731
        assert layout(g) == layout(w), f"{where}: {layout(g)} != {layout(w)}"
        g = g.cpu()
        gn, wn = g.float().isnan(), w.float().isnan()
        assert torch.equal(gn, wn), f"{where}: NaN values differ"
        bits = torch.uint8 if g.dtype == R.E4M3 else torch.int32
        bad = (g.view(bits) != w.view(bits)) & ~gn
        assert not bad.any(), f"{where}: {bad.sum().item()} values differ, first at {bad.nonzero()[0].tolist()}"


def _rand(*shape, dtype=torch.float32, seed=0):
    g = torch.Generator().manual_seed(seed)
    # Rows and columns of very different magnitudes: every block's scale matters, both ways.
    t = torch.randn(*shape, generator=g) * torch.exp(2 * torch.randn(shape[0], 1, generator=g))
    return (t * torch.exp(2 * torch.randn(1, shape[1], generator=g))).to(dtype)


def _check(interpreter, t, ways, what=""):
    # The reference on a dense copy (the same values): for a transposed view it would keep the view's
    # layout in q (column-major); the kernels give q row-major, as the ops' fake impl and scaled_mm take it.
    want = R.fp8_quantize_blocks(t.cpu().contiguous(), *WAYS[ways])
    got = interpreter.fp8_quantize_blocks(t.to(DEVICE), *WAYS[ways])
    _assert_same(got, want, f"{what} {tuple(t.shape)} {t.dtype} {ways}")
    return got


def _check_weight(interpreter, w, what=""):
    want = R.fp8_quantize_weight_blocks(w.cpu().contiguous())
    got = interpreter.fp8_quantize_weight_blocks(w.to(DEVICE))
    _assert_same(got, want, f"weight {what} {tuple(w.shape)} {w.dtype}")
    return got


@pytest.fixture
def poisoned_scales(interpreter, monkeypatch):
    """Scale buffers allocated full of NaN: an entry the kernel does not write (a round-up 1 included)
    fails the comparison instead of passing on whatever the allocator left there."""
    mod = interpreter.fp8_blocks
    for name in ("_column_major", "_padded"):
        real = getattr(mod, name)
        monkeypatch.setattr(mod, name, lambda *a, real=real: real(*a).fill_(float("nan")))


@pytest.mark.parametrize("ways", WAYS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("shape", [(128, 128), (256, 384), (384, 128), (128, 8192), (1024, 128)])
def test_bit_for_bit(interpreter, poisoned_scales, shape, dtype, ways):
    _check(interpreter, _rand(*shape, dtype=dtype), ways)


def test_nothing_asked_gives_empty_outputs(interpreter):
    got = interpreter.fp8_quantize_blocks(_rand(128, 256).to(DEVICE), False, False)
    _assert_same(got, R.fp8_quantize_blocks(_rand(128, 256), False, False), "nothing asked")
    assert all(g.numel() == 0 for g in got)


@pytest.mark.parametrize("ways", WAYS)
@pytest.mark.parametrize("view", ["transposed", "row_strided", "both_strided"])
def test_non_contiguous(interpreter, poisoned_scales, ways, view):
    base = _rand(384, 768, dtype=torch.bfloat16)
    t = {"transposed": lambda: base[:, :256].t(),  # (256, 384), first dim dense: read as it lies
         "row_strided": lambda: base[:256, 128:512],  # a slice of a wider buffer
         "both_strided": lambda: base[::3, ::2]}[view]()  # (128, 384), neither dim dense: a copy
    _check(interpreter, t, ways, view)


def test_nan_inf_zero_blocks(interpreter):
    """One NaN makes its 1 × 128 block's scale NaN and that block's values NaN, each way, and nothing else;
    inf scales its block to inf (inf / inf: NaN, the rest 0); a zero block takes the 1e-12 floor."""
    t = _rand(256, 384)
    t[3, 5] = float("nan")
    t[200, 300], t[130, 260] = float("inf"), -float("inf")
    t[128:256, 128:256] = 0.0  # a zero 128 × 128 block (both ways' scales at the floor)
    t[0:128, 256:384] *= 1e-30  # amax below 1e-12: the floor's scale, values to 0
    t[10, 130:140] = 1e-30  # next to normal values these round to 0
    q, s, qt, st = _check(interpreter, t, "both")
    q, s, qt, st = (x.cpu() for x in (q, s, qt, st))
    assert s.isnan().nonzero().tolist() == [[3, 0]] and st.isnan().nonzero().tolist() == [[5, 0]]
    nan_q = q.float().isnan()
    assert nan_q[3, :128].all() and nan_q[3, :128].sum() + nan_q[200, 256:].sum() + nan_q[130, 256:].sum() \
        == nan_q.sum()
    assert qt.float().isnan()[5, :128].all() and qt.float().isnan()[5].sum() == 128
    assert s[200, 2].item() == float("inf") and st[300, 1].item() == float("inf")


def test_rounding_ties_and_subnormals(interpreter):
    """The tie table (every e4m3 value and rounding midpoint, on it and one fp32 ulp either side) as rows
    and as columns: each row (column) holds 448, so its block's scale is exactly 1 and the cast is tested
    tie by tie; the weight's blocks hold 448 too."""
    cases = rounding_cases(width=128)
    t = cases.repeat(-(-128 // cases.shape[0]), 1)[:128]
    _check(interpreter, t, "rows", "ties as rows")
    _check(interpreter, t.t().contiguous(), "cols", "ties as columns")
    _check_weight(interpreter, t, "ties")


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("shape", [(128, 128), (256, 384), (384, 512)])  # K/128 = 3, N/128 = 3: round-ups
def test_weight_bit_for_bit(interpreter, poisoned_scales, shape, dtype):
    _, s_fwd, _, s_bwd = _check_weight(interpreter, _rand(*shape, dtype=dtype))
    n, k = shape[0] // 128, shape[1] // 128
    assert (s_fwd.cpu()[k:] == 1).all() and (s_bwd.cpu()[n:] == 1).all()  # the round-up rows


def test_weight_transposed_view(interpreter, poisoned_scales):
    """A transposed weight is read as it lies: q and qᵀ, s_fwd and s_bwd swap roles in the kernel."""
    _check_weight(interpreter, _rand(512, 256, dtype=torch.bfloat16).t(), "transposed")


def test_weight_nan_inf_zero_blocks(interpreter):
    """A NaN makes only its 128 × 128 block's scale and values NaN; inf, only its block's."""
    w = _rand(256, 384)
    w[130, 5], w[10, 300] = float("nan"), float("inf")
    w[128:256, 256:384] = 0.0
    q, s_fwd, qt, s_bwd = (x.cpu() for x in _check_weight(interpreter, w))
    assert s_fwd.isnan().nonzero().tolist() == [[0, 1]] and s_bwd.isnan().nonzero().tolist() == [[1, 0]]
    nan_q = q.float().isnan()
    assert nan_q[128:, :128].all() and nan_q[128:, :128].sum() + nan_q[:128, 256:].sum() == nan_q.sum()
    assert torch.equal(qt.float().isnan(), nan_q.t())


def test_one_launch_a_call(interpreter, monkeypatch):
    """Each call is one kernel launch, whatever is asked (no amax pass, no fill)."""
    from torchfuser.backends.triton import _common

    launched = []
    real = _common.Launcher.__call__
    monkeypatch.setattr(_common.Launcher, "__call__", lambda self, *a, **k: launched.append(self.fn.__name__)
                        or real(self, *a, **k))
    t = _rand(256, 384).to(DEVICE)
    for ways in WAYS.values():
        interpreter.fp8_quantize_blocks(t, *ways)
    interpreter.fp8_quantize_weight_blocks(t)
    assert launched == ["_fp8_quant_blocks_kernel"] * 3 + ["_fp8_quant_weight_blocks_kernel"]


def test_empty_sides(interpreter):
    """0 is a multiple of 128: empty tensors of the reference's shapes (their strides say nothing: the
    reference's qt of a (0, K) input keeps a transpose's, the kernels' and the fake impl's are fresh)."""
    for shape in ((0, 256), (256, 0)):
        t = torch.zeros(shape)
        _assert_same(interpreter.fp8_quantize_blocks(t.to(DEVICE), True, True),
                     R.fp8_quantize_blocks(t, True, True), f"{shape}", strides=False)
        _assert_same(interpreter.fp8_quantize_weight_blocks(t.to(DEVICE)), R.fp8_quantize_weight_blocks(t),
                     f"weight {shape}", strides=False)


def test_fake_impls_match_the_kernels(interpreter):
    """The op layer's fake layouts (torchfuser::fp8_quantize_blocks / _weight_blocks) are the kernels'."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    import torchfuser.ops.fp8_quant  # noqa: F401  (registers the ops)

    ops = torch.ops.torchfuser
    for t in (_rand(256, 384, dtype=torch.bfloat16).to(DEVICE), _rand(384, 256).to(DEVICE).t()):
        calls = [(ops.fp8_quantize_blocks, (*ways, "triton")) for ways in WAYS.values()]
        calls.append((ops.fp8_quantize_weight_blocks, ("triton",)))
        for op, args in calls:
            real = op(t, *args)
            with FakeTensorMode() as mode:
                fake = op(mode.from_tensor(t), *args)
            for r, f in zip(real, fake):
                assert (r.shape, r.dtype, r.stride()) == (f.shape, f.dtype, f.stride()), op


@pytest.mark.parametrize("shape", [(100, 128), (128, 100), (128,), (2, 128, 128)])
def test_the_reference_errors(interpreter, shape):
    t = torch.zeros(shape)
    for kernel, ref, args in ((interpreter.fp8_quantize_blocks, R.fp8_quantize_blocks, (True, True)),
                              (interpreter.fp8_quantize_weight_blocks, R.fp8_quantize_weight_blocks, ())):
        with pytest.raises(ValueError) as want:
            ref(t, *args)
        with pytest.raises(ValueError) as got:
            kernel(t.to(DEVICE), *args)
        assert str(got.value) == str(want.value)


def test_rejects_other_dtypes(interpreter):
    with pytest.raises(TypeError, match="triton backend supports"):
        interpreter.fp8_quantize_blocks(torch.zeros(128, 128, dtype=torch.float64, device=DEVICE), True, True)
    with pytest.raises(TypeError, match="triton backend supports"):
        interpreter.fp8_quantize_weight_blocks(torch.zeros(128, 128, dtype=torch.float64, device=DEVICE))
