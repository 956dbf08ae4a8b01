"""The RMSNorms as producers of FP8 GEMM operands (issue 23, backends/triton/norm_fp8.py): the norm
forward (with and without the residual add) and the backward (with the residual's gradient, and its copy
for the residual branch) write what rms_norm.py's kernels write, bit for bit, and the maxima of the
operand a GEMM takes, bit for bit the reference's. Whole models: test_fp8_producers.py. The kernels run
under Triton's interpreter on the CPU (compiled on a GPU where there is one)."""
from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

from torchfuser.backends.reference import fp8_quant as R

triton = pytest.importorskip("triton")
sys.path.insert(0, str(Path(__file__).parent))
sys.path.insert(0, str(Path(__file__).parent / "backends"))

from test_fp8_producers import _same_bits  # noqa: E402
from test_triton_ops import DEVICE, interpreter  # noqa: E402,F401  (module fixture)

SHAPES = [(1, 64), (123, 96), (37, 200), (300, 64)]  # (rows, N)
# (x, the residual branch r, the norm's output): an fp32 residual stream under autocast; a bf16 model
DTYPES = [(torch.float32, torch.bfloat16, torch.bfloat16), (torch.bfloat16, torch.bfloat16, None)]


def _rand(rows, n, dtype, seed, strided=False):
    g = torch.Generator().manual_seed(seed)
    t = torch.randn(rows, n + (5 if strided else 0), generator=g) * 3
    t = t[:, 2:2 + n] if strided else t
    return t.to(dtype).to(DEVICE)


def _weight(n, seed=7):
    return (1 + 0.1 * torch.randn(n, generator=torch.Generator().manual_seed(seed))).to(DEVICE)


def _maxima_are_the_references(amax, t, what):
    _same_bits(amax, R.fp8_amax_both(t.cpu().reshape(-1, t.shape[-1])), what)


@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("dtypes", DTYPES, ids=["fp32-residual", "bf16"])
@pytest.mark.parametrize("strided", [False, True], ids=["dense", "row-strided"])
def test_norm_forwards_write_the_plain_kernels_bits_and_their_maxima(interpreter, shape, dtypes, strided):
    x_dtype, r_dtype, out = dtypes
    x, r, w = _rand(*shape, x_dtype, 0, strided), _rand(*shape, r_dtype, 1), _weight(shape[1])
    y, rstd, amax = interpreter.rms_norm_fp8_fwd(x, w, 1e-6, 1.0, out)
    want = interpreter.rms_norm_fwd(x, w, 1e-6, 1.0, out)
    for got, exp, what in zip((y, rstd), want, ("y", "rstd")):
        _same_bits(got, exp, f"rms_norm {what} {shape}")
    _maxima_are_the_references(amax, y, f"rms_norm maxima {shape}")
    *got, amax = interpreter.add_rms_norm_fp8_fwd(x, r, w, 1e-5, 0.0, out)
    for g, exp, what in zip(got, interpreter.add_rms_norm_fwd(x, r, w, 1e-5, 0.0, out), ("s", "y", "rstd")):
        _same_bits(g, exp, f"add_rms_norm {what} {shape}")
    _maxima_are_the_references(amax, got[1], f"add_rms_norm maxima {shape}")


@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("dtypes", DTYPES, ids=["fp32-residual", "bf16"])
def test_norm_backwards_write_the_plain_kernels_bits_and_their_maxima(interpreter, shape, dtypes):
    s_dtype, r_dtype, out = dtypes
    s, w = _rand(*shape, s_dtype, 0), _weight(shape[1])
    dy, ds = _rand(*shape, out or s_dtype, 2), _rand(*shape, s_dtype, 3)
    _, rstd = interpreter.rms_norm_fwd(s, w, 1e-6, 0.0)
    for dres in (ds, None):
        dx, dw, amax = interpreter.rms_norm_fp8_bwd(dy, s, w, rstd, 1e-6, 0.0, dres)
        for got, exp, what in zip((dx, dw), interpreter.rms_norm_bwd(dy, s, w, rstd, 1e-6, 0.0, dres), ("dx", "dw")):
            _same_bits(got, exp, f"rms_norm_bwd {what} {shape}, dres {dres is not None}")
        _maxima_are_the_references(amax, dx, f"rms_norm_bwd maxima {shape}")
        *got, amax = interpreter.add_rms_norm_fp8_bwd(dy, s, w, rstd, 1e-6, 0.0, dres, r_dtype)
        want = interpreter.add_rms_norm_bwd(dy, s, w, rstd, 1e-6, 0.0, dres, r_dtype)
        for g, exp, what in zip(got, want, ("dx", "dr", "dw")):
            _same_bits(g, exp, f"add_rms_norm_bwd {what} {shape}, ds {dres is not None}")
        _maxima_are_the_references(amax, got[1], f"add_rms_norm_bwd maxima of dr {shape}")


def test_norm_producer_programs_of_several_tiles(interpreter, monkeypatch):
    """On one SM: a few persistent programs, each walking many row tiles, their column maxima maxed in."""
    nf = interpreter.norm_fp8
    monkeypatch.setattr(nf, "_sms", lambda t: 1)
    for module in (nf, interpreter.rms_norm):  # the same grid for both: dw's partials summed alike
        monkeypatch.setattr(module, "num_programs_cap", lambda key: 3)
    x, r, w = _rand(300, 1024, torch.float32, 0), _rand(300, 1024, torch.bfloat16, 1), _weight(1024)
    assert nf.cdiv(300, nf.norm_config(1024)[1]) > 4 * nf._FWD_PER_SM  # several tiles a program, forward
    s, y, rstd, amax = interpreter.add_rms_norm_fp8_fwd(x, r, w, 1e-6, 0.0, torch.bfloat16)
    _same_bits(y, interpreter.add_rms_norm_fwd(x, r, w, 1e-6, 0.0, torch.bfloat16)[1], "y")
    _maxima_are_the_references(amax, y, "forward maxima")
    dx, dr, dw, amax = interpreter.add_rms_norm_fp8_bwd(y, s, w, rstd, 1e-6, 0.0, s, torch.bfloat16)
    for got, exp, what in zip((dx, dr, dw), interpreter.add_rms_norm_bwd(y, s, w, rstd, 1e-6, 0.0, s, torch.bfloat16),
                              ("dx", "dr", "dw")):
        _same_bits(got, exp, what)
    _maxima_are_the_references(amax, dr, "backward maxima")


def test_norm_producer_maxima_propagate_nan_and_take_inf(interpreter):
    x, w = _rand(64, 96, torch.bfloat16, 0), _weight(96)
    x[5, 7] = float("inf")  # row 5's rstd is 0 and inf · 0 NaN: that row's y is NaN where finite x·0 is 0
    x[9, 11] = float("nan")
    y, _, amax = interpreter.rms_norm_fp8_fwd(x, w, 1e-6, 0.0)
    want = R.fp8_amax_both(y.cpu())
    got = amax.cpu().view(torch.float32)
    assert torch.equal(got.isnan(), want.view(torch.float32).isnan()) and got.isnan().any()
    assert torch.equal(got.nan_to_num(), want.view(torch.float32).nan_to_num())


def test_wider_rows_take_no_maxima(interpreter):
    """Rows past the producers' widths (the forward's _MAX_FWD, the backward's one-pass rows with a residual
    gradient): the plain kernels run and no maxima come back (the GEMM takes its own)."""
    n = interpreter.norm_fp8._MAX_FWD + 16
    assert not interpreter.norm_fp8.norm_config(n, True, dres=True)[2]  # the backward walks it in chunks
    x, w = _rand(2, n, torch.bfloat16, 0), _weight(n)
    y, rstd, amax = interpreter.rms_norm_fp8_fwd(x, w, 1e-6, 0.0)
    assert amax is None
    _same_bits(y, interpreter.rms_norm_fwd(x, w, 1e-6, 0.0)[0], "looped y")
    dx, dw, amax = interpreter.rms_norm_fp8_bwd(y, x, w, rstd, 1e-6, 0.0, x)
    assert amax is None
    _same_bits(dx, interpreter.rms_norm_bwd(y, x, w, rstd, 1e-6, 0.0, x)[0], "looped dx")
