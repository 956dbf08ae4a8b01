"""The FP8 quantisation kernels (backends/triton/fp8_quant.py) against PyTorch's quantisation
(backends/reference/fp8_quant.py, run on the CPU: the formula with true divisions), bit for bit in
the e4m3 values and the fp32 scales: rowwise, rowwise of the transpose (dW's operands), tensorwise
both ways; fp32 / bf16 / fp16; a single row, 123×123, rows of 8192 and 20000 (the looped kernel),
row-strided and transposed inputs; NaN and inf; values on every e4m3 rounding tie. The pair that
quantises a tensor both ways from two reads (``fp8_quantize_both``) against the two reference calls
it replaces, bit for bit, on the same cases, rowwise by each of its paths (the switch fp8_rowwise_both: the rows
kernel writing column partials + the tiles kernel, the default; the atomic both-ways kernels), with
row programs of one and of several steps, one-pass and looped rows. Run by Triton's
interpreter on the CPU (TRITON_INTERPRET=1, with its e4m3 cast fixed to round as the GPU does:
_interpret.py), compiled on a GPU where there is one.
"""
from __future__ import annotations

import numpy as np
import pytest
import torch

from test_triton_ops import DEVICE, interpreter  # noqa: F401  (module fixture: the interpreted backend)
from torchfuser.backends.reference import fp8_quant as R
from torchfuser.switches import SWITCHES

pytest.importorskip("triton")

E4M3 = torch.float8_e4m3fn
MODES = [(False, False), (False, True), (True, False), (True, True)]  # (tensorwise, transpose)
MODE_IDS = ["rowwise", "rowwise-t", "tensorwise", "tensorwise-t"]


def _assert_same(got, want, what):
    """Equal bit patterns; NaN only as NaN (its sign bit is not specified)."""
    (q, s), (qr, sr) = got, want
    assert (q.shape, q.dtype, s.shape, s.dtype) == (qr.shape, qr.dtype, sr.shape, sr.dtype), what
    assert q.is_contiguous(), what
    q, s = q.cpu(), s.cpu()
    qn, qrn = q.float().isnan(), qr.float().isnan()
    assert torch.equal(qn, qrn), f"{what}: NaN values differ"
    bad = (q.view(torch.uint8) != qr.view(torch.uint8)) & ~qn
    assert not bad.any(), f"{what}: {bad.sum().item()} e4m3 values differ, first at {bad.nonzero()[0].tolist()}"
    assert torch.equal(s.isnan(), sr.isnan()) and torch.equal(s.nan_to_num().view(torch.int32),
                                                             sr.nan_to_num().view(torch.int32)), f"{what}: scales differ"


def _check(interpreter, t, tensorwise, transpose, what=""):
    want = R.fp8_quantize(t.cpu(), tensorwise, transpose)  # on the CPU: true divisions (see the kernel's doc)
    got = interpreter.fp8_quantize(t.to(DEVICE), tensorwise, transpose)
    _assert_same(got, want, f"{what} {tuple(t.shape)} {t.dtype} tensorwise={tensorwise} transpose={transpose}")


def _rand(*shape, dtype=torch.float32, seed=0):
    g = torch.Generator().manual_seed(seed)
    # Rows (and columns) of very different magnitudes: each scale matters.
    t = torch.randn(*shape, generator=g) * torch.exp(2 * torch.randn(shape[0], 1, generator=g))
    return (t * torch.exp(torch.randn(1, shape[1], generator=g))).to(dtype)


@pytest.mark.parametrize("mode", MODES, ids=MODE_IDS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("shape", [(1, 64), (123, 123), (37, 200), (2, 8192)])
def test_bit_for_bit(interpreter, shape, dtype, mode):
    _check(interpreter, _rand(*shape, dtype=dtype), *mode)


@pytest.mark.parametrize("mode", MODES, ids=MODE_IDS)
def test_long_rows_looped(interpreter, mode):
    """Rows past MAX_FUSED: the rowwise kernel walks them twice in chunks."""
    _check(interpreter, _rand(3, 20000, dtype=torch.bfloat16), *mode)


@pytest.mark.parametrize("mode", MODES, ids=MODE_IDS)
def test_many_rows_in_row_chunks(interpreter, mode):
    """More rows than one program's chunk: the transposed and tensorwise partials span programs."""
    _check(interpreter, _rand(1000, 48, dtype=torch.bfloat16), *mode)


@pytest.mark.parametrize("mode", MODES, ids=MODE_IDS)
@pytest.mark.parametrize("view", ["row_strided", "transposed", "both_strided"])
def test_non_contiguous(interpreter, mode, view):
    base = _rand(70, 300, dtype=torch.bfloat16)
    t = {"row_strided": lambda: base[:, 7:200],  # a slice of a wider buffer
         "transposed": lambda: base[:, :90].t(),  # read as the other orientation, no copy
         "both_strided": lambda: base[::2, ::3]}[view]()
    _check(interpreter, t, *mode, what=view)


@pytest.mark.parametrize("mode", MODES, ids=MODE_IDS)
def test_nan_inf_zero_rows(interpreter, mode):
    t = _rand(40, 96)
    t[3, 5], t[7, 1], t[9, 2] = float("nan"), float("inf"), -float("inf")
    t[11] = 0.0  # amax 0: the 1e-12 floor
    t[12] = 1e-30  # a tiny row is scaled up to ±448 like any other
    t[13, :5] = 1e-30  # next to normal values these round to 0
    _check(interpreter, t, *mode)


def test_rounding_ties_and_subnormals(interpreter):
    """Each row holds 448 (so its scale is exactly 1) and values on, just above and just below every
    e4m3 rounding midpoint, subnormal ones included: the cast itself, tie by tie."""
    t = R.rounding_cases()
    _check(interpreter, t, False, False, "ties")


def test_interpreter_e4m3_cast_rounds_as_pytorch():
    """_interpret.fp32_to_e4m3_bits (the interpreter's fp32 → e4m3 cast, as cvt.rn.satfinite rounds)
    equals PyTorch's cast on every bf16 value, random fp32 values and every tie, within ±448."""
    from torchfuser.backends.triton._interpret import fp32_to_e4m3_bits

    every_bf16 = torch.arange(-32768, 32768, dtype=torch.int32).to(torch.int16).view(torch.bfloat16).float()
    g = torch.Generator().manual_seed(0)
    wide = torch.randn(200_000, generator=g) * torch.exp(4 * torch.randn(200_000, generator=g))
    v = torch.arange(256, dtype=torch.int32).to(torch.uint8).view(E4M3).float()
    v = v[torch.isfinite(v)].unique()
    mids = (v[1:] + v[:-1]) / 2
    inf = torch.tensor(float("inf"))
    x = torch.cat([every_bf16, wide, mids, mids.nextafter(inf), mids.nextafter(-inf)])
    x = torch.cat([x, -x]).clamp(-448, 448)
    x = x[~x.isnan()]
    got = torch.from_numpy(fp32_to_e4m3_bits(x.numpy()))
    assert torch.equal(got, x.to(E4M3).view(torch.uint8))
    special = fp32_to_e4m3_bits(np.array([np.nan, np.inf, -np.inf, 500.0, -1e9], dtype=np.float32))
    assert special[0] & 0x7F == 0x7F and list(special[1:]) == [0x7E, 0xFE, 0x7E, 0xFE]  # NaN; satfinite


def _check_both(interpreter, t, tensorwise, what=""):
    """``fp8_quantize_both`` equals ``fp8_quantize(t, tw, False)`` and ``fp8_quantize(t, tw, True)``."""
    tc = t.cpu()
    got = interpreter.fp8_quantize_both(t.to(DEVICE), tensorwise)
    for transpose, g in zip((False, True), got):
        want = R.fp8_quantize(tc, tensorwise, transpose)
        _assert_same(g, want, f"both {what} {tuple(t.shape)} {t.dtype} tensorwise={tensorwise} transpose={transpose}")


def _set_rowwise_path(k, path, monkeypatch):
    """fp8_quantize_both's rowwise path set to ``path``; off "atomic" the atomic kernels must not run."""
    monkeypatch.setattr(SWITCHES, "fp8_rowwise_both", path)
    if path != "atomic":
        def refuse(*args, **kwargs):
            raise AssertionError(f"the atomic both-ways kernels ran on the {path} path")
        monkeypatch.setattr(k, "_amax_both", refuse)
        monkeypatch.setattr(k, "_tiles_both", refuse)


@pytest.fixture(params=["pair", "rows+tiles", "atomic"])
def rowwise_both(request, interpreter, monkeypatch):
    """fp8_quantize_both's rowwise path: the two calls, rows kernel + tiles kernel, or atomic (the default)."""
    _set_rowwise_path(interpreter.fp8_quant, request.param, monkeypatch)
    return request.param


@pytest.fixture(params=["rowwise", "rowwise-rows+tiles", "rowwise-atomic", "tensorwise"])
def tensorwise(request, interpreter, monkeypatch):
    """The recipe of fp8_quantize_both, rowwise by each of its paths."""
    if request.param != "tensorwise":
        path = request.param.removeprefix("rowwise-") if "-" in request.param else "pair"
        _set_rowwise_path(interpreter.fp8_quant, path, monkeypatch)
    return request.param == "tensorwise"


def test_both_rowwise_default_path(interpreter):
    assert SWITCHES.fp8_rowwise_both == "atomic"  # the faster whole steps measured (see fp8_quant.py)


@pytest.mark.parametrize("shape", [(1, 64), (16, 16), (64, 128)])
def test_both_tensorwise_fp32_keeps_off_the_both_ways_writer(interpreter, monkeypatch, shape):
    """fp32 input tensorwise takes the amax kernel and two tiles passes, bit for bit: the both-ways
    writer got a quarter of qᵀ wrong from fp32 input on an H200 (Triton 3.6; the interpreter is right)."""
    def refuse(*args, **kwargs):
        raise AssertionError("the both-ways writer ran on fp32 input")
    monkeypatch.setattr(interpreter.fp8_quant, "_tiles_both", refuse)
    _check_both(interpreter, _rand(*shape, dtype=torch.float32), True)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("shape", [(1, 64), (16, 16), (123, 123), (2, 8192)])
def test_both_bit_for_bit(interpreter, shape, dtype, tensorwise):
    _check_both(interpreter, _rand(*shape, dtype=dtype), tensorwise)


def test_both_many_rows_in_row_chunks(interpreter, tensorwise):
    """Several programs along the rows: every column's amax is maxed in from all of them."""
    _check_both(interpreter, _rand(1000, 48, dtype=torch.bfloat16), tensorwise)


def test_both_long_rows_looped(interpreter, tensorwise):
    """Rows past MAX_FUSED: the rows kernel walks them twice in chunks, its partials chunk by chunk."""
    _check_both(interpreter, _rand(2, 20000, dtype=torch.bfloat16), tensorwise)


@pytest.mark.parametrize("shape", [(1000, 48), (5, 20000)], ids=["one-pass", "looped"])
def test_both_row_programs_of_several_steps(interpreter, monkeypatch, shape):
    """The rows+tiles path on one SM: two row programs, each walking several row steps (one-pass: its
    partials held in registers across steps; looped: read back from its own partial row), reduced."""
    _set_rowwise_path(interpreter.fp8_quant, "rows+tiles", monkeypatch)
    monkeypatch.setattr(interpreter.fp8_quant, "_sms", lambda t: 1)
    cfg = interpreter.fp8_quant.rows_partials_config(*shape, 1)
    assert cfg[-1] == 2 and cfg[-2] > cfg[1], cfg  # two programs, more than one step each
    t = _rand(*shape, dtype=torch.bfloat16)
    t[shape[0] - 1, 7] = float("nan")  # in the last step of the last program
    t[1, 9] = float("inf")
    _check_both(interpreter, t, False)


@pytest.mark.parametrize("view", ["row_strided", "transposed", "both_strided"])
def test_both_non_contiguous(interpreter, tensorwise, view):
    base = _rand(70, 300, dtype=torch.bfloat16)
    t = {"row_strided": lambda: base[:, 7:200], "transposed": lambda: base[:, :90].t(),
         "both_strided": lambda: base[::2, ::3]}[view]()
    _check_both(interpreter, t, tensorwise, view)


def test_both_nan_inf_zero_rows_and_columns(interpreter, tensorwise):
    t = _rand(40, 96)
    t[3, 5], t[7, 1], t[9, 2] = float("nan"), float("inf"), -float("inf")
    t[11], t[:, 20] = 0.0, 0.0  # amax 0 of a row and of a column: the 1e-12 floor
    t[12], t[:, 30] = 1e-30, 1e-30
    t[13, :5] = 1e-30
    _check_both(interpreter, t, tensorwise)


def test_both_rounding_ties_and_subnormals(interpreter, rowwise_both):
    """The tie table as rows (q's scales exactly 1) and as columns (qt's scales exactly 1)."""
    t = R.rounding_cases()
    _check_both(interpreter, t, False, "ties")
    _check_both(interpreter, t.t().contiguous(), False, "ties as columns")


def test_fake_impl_matches_the_kernels(interpreter):
    from torch._subclasses.fake_tensor import FakeTensorMode

    import torchfuser.ops.fp8_quant  # noqa: F401  (registers torchfuser::fp8_quantize)

    t = _rand(37, 96, dtype=torch.bfloat16).to(DEVICE)
    for tensorwise, transpose in MODES:
        real = torch.ops.torchfuser.fp8_quantize(t, tensorwise, transpose, "triton")
        with FakeTensorMode() as mode:
            fake = torch.ops.torchfuser.fp8_quantize(mode.from_tensor(t), tensorwise, transpose, "triton")
        for r, f in zip(real, fake):
            assert (r.shape, r.dtype, r.stride()) == (f.shape, f.dtype, f.stride())
    for tensorwise in (False, True):
        real = torch.ops.torchfuser.fp8_quantize_both(t, tensorwise, "triton")
        with FakeTensorMode() as mode:
            fake = torch.ops.torchfuser.fp8_quantize_both(mode.from_tensor(t), tensorwise, "triton")
        assert len(real) == len(fake) == 4
        for r, f in zip(real, fake):
            assert (r.shape, r.dtype, r.stride()) == (f.shape, f.dtype, f.stride())


def test_rejects_other_dtypes_and_shapes(interpreter):
    with pytest.raises(TypeError, match="triton backend supports"):
        interpreter.fp8_quantize(torch.zeros(4, 8, dtype=torch.float64, device=DEVICE), False, False)
    with pytest.raises(ValueError, match="2-D"):
        interpreter.fp8_quantize(torch.zeros(2, 4, 8, device=DEVICE), False, False)
    with pytest.raises(TypeError, match="triton backend supports"):
        interpreter.fp8_quantize_both(torch.zeros(4, 8, dtype=torch.float64, device=DEVICE), False)
    with pytest.raises(ValueError, match="2-D"):
        interpreter.fp8_quantize_both(torch.zeros(2, 4, 8, device=DEVICE), True)
