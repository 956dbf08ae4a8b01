"""The GEMM that dequantises its 4-bit weight tile by tile (backends/triton/dequant_matmul_4bit.py; interpreted on the
CPU under TRITON_INTERPRET=1, compiled on a GPU): forward x·Ŵᵀ and backward dy·Ŵ against float64 on the same
dequantised Ŵ (DESIGN.md's rule, PyTorch's own same-dtype dequantise-then-matmul as the yardstick) and against
the reference backend's dequantise-then-matmul: fp32 / bf16 / fp16, one row, partial tiles in every dimension,
blocks that straddle rows (cols not a multiple of 64), more than one tile of rows, a row-strided operand."""
from __future__ import annotations

import pytest
import torch

from numerics import assert_within_rule
from test_triton_ops import DEVICE, interpreter  # noqa: F401  (module fixture: the interpreted backend)
from torchfuser.backends.reference import dequant_4bit as R
from torchfuser.backends.reference import dequant_matmul_4bit as RM

pytest.importorskip("triton")

# NF4's code table (QLoRA, Dettmers et al. 2023), as fp32.
NF4 = torch.tensor([-1.0, -0.6961928009986877, -0.5250730514526367, -0.39491748809814453, -0.28444138169288635,
                    -0.18477343022823334, -0.09105003625154495, 0.0, 0.07958029955625534, 0.16093020141124725,
                    0.24611230850219727, 0.33791524171829224, 0.44070982933044434, 0.5626170039176941,
                    0.7229568362236023, 1.0])
# (tokens, rows, cols): one row; partial tiles everywhere; cols 96 (64-element blocks straddle rows); 130 tokens
# (two row tiles); a joint q/k/v-like weight of 320 rows.
SHAPES = [(1, 64, 128), (37, 96, 192), (130, 70, 96), (5, 320, 64)]
ATOL = {torch.float32: 1e-5, torch.bfloat16: 1e-2, torch.float16: 1e-3}


def _weight(rows, cols, seed):
    g = torch.Generator().manual_seed(seed)
    packed = torch.randint(0, 256, (rows * cols // 2,), generator=g, dtype=torch.uint8)
    absmax = torch.rand(-(-rows * cols // 64), generator=g) * 0.1 + 0.01
    return packed, absmax


@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "x".join(map(str, s)))
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16], ids=str)
def test_forward_and_backward_within_the_rule(interpreter, shape, dtype):  # noqa: F811
    tokens, rows, cols = shape
    packed, absmax = _weight(rows, cols, sum(shape))
    w = R.dequantize_4bit_fwd(packed, absmax, NF4, 64, rows, cols, dtype)
    g = torch.Generator().manual_seed(7)
    x = torch.randn(tokens, 2 * cols, generator=g).to(dtype)[:, ::2]  # row-strided and non-contiguous columns
    dy = torch.randn(tokens, rows, generator=g).to(dtype)
    args = (packed.to(DEVICE), absmax.to(DEVICE), NF4.to(DEVICE), 64, rows, cols, dtype)
    y = interpreter.dequant_matmul_4bit_fwd(x.to(DEVICE), *args).cpu()
    dx = interpreter.dequant_matmul_4bit_bwd(dy.to(DEVICE), *args).cpu()
    assert y.shape == (tokens, rows) and dx.shape == (tokens, cols) and y.dtype == dx.dtype == dtype
    y64, dx64 = x.double() @ w.double().t(), dy.double() @ w.double()
    assert_within_rule(y, x @ w.t(), y64, ATOL[dtype], "x·Ŵᵀ")
    assert_within_rule(dx, dy @ w, dx64, ATOL[dtype], "dy·Ŵ")
    ref = (RM.dequant_matmul_4bit_fwd(x, packed, absmax, NF4, 64, rows, cols, dtype),
           RM.dequant_matmul_4bit_bwd(dy, packed, absmax, NF4, 64, rows, cols, dtype))
    tol = dict(rtol=1e-5, atol=1e-5) if dtype == torch.float32 else dict(rtol=2e-2, atol=2e-2)
    torch.testing.assert_close(y, ref[0], **tol)
    torch.testing.assert_close(dx, ref[1], **tol)


def test_batched_operand_keeps_its_leading_dims(interpreter):  # noqa: F811
    packed, absmax = _weight(64, 128, 3)
    x = torch.randn(2, 3, 128).to(torch.bfloat16)
    y = interpreter.dequant_matmul_4bit_fwd(x.to(DEVICE), packed.to(DEVICE), absmax.to(DEVICE), NF4.to(DEVICE), 64, 64,
                                            128, torch.bfloat16).cpu()
    w = R.dequantize_4bit_fwd(packed, absmax, NF4, 64, 64, 128, torch.bfloat16)
    assert y.shape == (2, 3, 64)
    assert_within_rule(y, x @ w.t(), x.double() @ w.double().t(), 1e-2, "batched")


def test_a_wrong_code_table_is_caught(interpreter):  # noqa: F811
    """The comparison has teeth: the kernel run with a code table whose halves are swapped fails the rule."""
    packed, absmax = _weight(64, 128, 5)
    x = torch.randn(9, 128)
    w = R.dequantize_4bit_fwd(packed, absmax, NF4, 64, 64, 128, torch.float32)
    bad = torch.cat([NF4[8:], NF4[:8]])
    y = interpreter.dequant_matmul_4bit_fwd(x.to(DEVICE), packed.to(DEVICE), absmax.to(DEVICE), bad.to(DEVICE), 64, 64,
                                            128, torch.float32).cpu()
    with pytest.raises(AssertionError):
        assert_within_rule(y, x @ w.t(), x.double() @ w.double().t(), 1e-5, "swapped table")


def test_unsupported_layouts_raise(interpreter):  # noqa: F811
    packed, absmax = _weight(8, 66, 1)
    with pytest.raises(ValueError, match="even"):
        interpreter.dequant_matmul_4bit_fwd(torch.randn(2, 65).to(DEVICE), packed.to(DEVICE), absmax.to(DEVICE),
                                            NF4.to(DEVICE), 64, 8, 65, torch.float32)
    with pytest.raises(TypeError, match="differ"):
        interpreter.dequant_matmul_4bit_fwd(torch.randn(2, 66).to(DEVICE), packed.to(DEVICE), absmax.to(DEVICE),
                                            NF4.to(DEVICE), 64, 8, 66, torch.bfloat16)


def _bnb_linears(shapes, compute, seed=0):
    """bitsandbytes NF4 Linear4bit layers (no double quantisation) holding quantised random weights."""
    bnb = pytest.importorskip("bitsandbytes")
    out = []
    for rows, cols in shapes:
        w = torch.randn(rows, cols, generator=torch.Generator().manual_seed(seed + rows)) * 0.05
        packed, qs = bnb.functional.quantize_4bit(w, blocksize=64, compress_statistics=False, quant_type="nf4")
        m = bnb.nn.Linear4bit(cols, rows, bias=False, compute_dtype=compute, quant_type="nf4")
        m.weight = bnb.nn.Params4bit(packed, requires_grad=False, quant_state=qs, quant_type="nf4", bnb_quantized=True)
        out.append(m)
    return out


@pytest.mark.parametrize("compute", [torch.float32, torch.bfloat16], ids=str)
def test_the_switch_runs_the_fused_gemm_in_the_lora_node_path(interpreter, compute, monkeypatch):  # noqa: F811
    """quantized_base.linear / grad_input (the LoRA node's base products) with the switch qlora_dequant_gemm on and
    the Triton backend: a joint q/k/v-like group of bitsandbytes NF4 bases runs the fused kernel (once a direction),
    within the rule against float64 on the same Ŵ; off, the dequantise-then-GEMM path runs (the kernel is not
    called)."""
    from torchfuser import switches
    from torchfuser.modules.adapters import quantized_base as qb

    if DEVICE != "cpu":  # its bitsandbytes layers are quantised on the CPU; the GPU path waits for the probe's verdict
        pytest.skip("the interpreted path (the switch is off on GPUs until benchmarks/probes/dequant_gemm_probe.py decides)")
    layers = _bnb_linears([(64, 128), (32, 128), (32, 128)], compute)
    calls, real = [], qb.dequant_matmul_4bit
    monkeypatch.setattr(qb, "dequant_matmul_4bit", lambda *a: calls.append(a[-2]) or real(*a))
    quant = (tuple(layers), compute, compute, "triton")
    x, dy = torch.randn(2, 5, 128, dtype=compute), torch.randn(10, 128, dtype=compute)
    w64 = torch.cat([qb.dequantize(m, torch.float64, "reference") for m in layers])
    with switches.switched(qlora_dequant_gemm=True):
        y, dx = qb.linear(x.to(DEVICE), quant, []).cpu(), qb.grad_input(dy.to(DEVICE), quant, torch.float32).cpu()
    assert calls == [True, False]  # forward x·Ŵᵀ, backward dy·Ŵ, each one fused launch for the joint group
    y_off, dx_off = qb.linear(x, (tuple(layers), compute, compute, "reference"), []), qb.grad_input(
        dy, (tuple(layers), compute, compute, "reference"), torch.float32)
    assert len(calls) == 2 and y.shape == y_off.shape == (2, 5, 128) and dx.dtype == dx_off.dtype == torch.float32
    assert_within_rule(y, y_off, x.double() @ w64.t(), ATOL[compute], "x·Ŵᵀ")
    assert_within_rule(dx, dx_off, dy.double() @ w64, ATOL[compute], "dy·Ŵ")


def test_the_fused_gemm_is_off_by_default():
    """Off until benchmarks/probes/dequant_gemm_probe.py shows it faster on the H200 (NOTES-qlora.md)."""
    from torchfuser.switches import Switches

    assert Switches().qlora_dequant_gemm is False


def test_the_switch_takes_a_torchao_nf4_base(interpreter, monkeypatch):  # noqa: F811
    """A torchao NF4 base (bf16, scalers in blocks of 16) through the switched path: the fused kernel, within the
    rule."""
    import warnings

    from torchfuser import switches
    from torchfuser.modules.adapters import quantized_base as qb

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        ao = pytest.importorskip("torchao.quantization")
    to_nf4 = getattr(ao, "to_nf4", None) or pytest.importorskip("torchao.dtypes").to_nf4
    layer = torch.nn.Linear(128, 96, bias=False, dtype=torch.bfloat16)
    layer.weight = torch.nn.Parameter(to_nf4(layer.weight.detach(), 64, 16), requires_grad=False)
    calls, real = [], qb.dequant_matmul_4bit
    monkeypatch.setattr(qb, "dequant_matmul_4bit", lambda *a: calls.append(a[-2]) or real(*a))
    x, dy = torch.randn(7, 128, dtype=torch.bfloat16), torch.randn(7, 96, dtype=torch.bfloat16)
    quant = ((layer,), torch.bfloat16, torch.bfloat16, "triton")
    with switches.switched(qlora_dequant_gemm=True):
        y, dx = qb.linear(x.to(DEVICE), quant, []).cpu(), qb.grad_input(dy.to(DEVICE), quant, torch.bfloat16).cpu()
    assert calls == [True, False]
    w = layer.weight.get_original_weight()
    assert_within_rule(y, x @ w.t(), x.double() @ w.double().t(), 1e-2, "x·Ŵᵀ")
    assert_within_rule(dx, dy @ w, dy.double() @ w.double(), 1e-2, "dy·Ŵ")
