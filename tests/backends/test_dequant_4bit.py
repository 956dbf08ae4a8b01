"""4-bit dequantisation (bitsandbytes' NF4 / FP4 layout; ops/dequant_4bit.py): the reference backend and
the Triton kernel (interpreted on the CPU: TRITON_INTERPRET=1; compiled on a GPU where there is one)
against bitsandbytes' own ``dequantize_4bit``, bit for bit: NF4 and FP4, double quantisation on and off,
fp32 / bf16 / fp16 out, one row, a row of 8192, 123 × 128 and odd sizes (a last half-filled byte)."""
from __future__ import annotations

import pytest
import torch

from test_triton_ops import DEVICE, interpreter  # noqa: F401  (module fixture: the interpreted backend)
from torchfuser.backends.reference import dequant_4bit as R

bnb = pytest.importorskip("bitsandbytes")
pytest.importorskip("triton")
BF = bnb.functional

# Rows of whole 64-element blocks, or of an odd length (bitsandbytes' CPU kernel reads blocks per row and
# takes its flat PyTorch path only for odd rows: other partial blocks differ there, test_qlora_fused.py).
SHAPES = [(1, 64), (1, 8192), (123, 128), (7, 33), (3, 1)]


def _quantised(shape, quant_type, nested, dtype):
    w = torch.randn(*shape, generator=torch.Generator().manual_seed(sum(shape)))
    packed, qs = BF.quantize_4bit(w, blocksize=64, compress_statistics=nested, quant_type=quant_type)
    qs.dtype = dtype
    absmax = qs.absmax
    if nested:
        absmax = R.dequantize_blockwise_8bit_fwd(absmax, qs.state2.absmax, qs.state2.code, qs.state2.blocksize) + qs.offset
    return packed, qs, absmax


@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "x".join(map(str, s)))
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16], ids=str)
@pytest.mark.parametrize("quant_type,nested", [("nf4", False), ("nf4", True), ("fp4", False), ("fp4", True)])
def test_bit_exact_against_bitsandbytes(interpreter, shape, dtype, quant_type, nested):  # noqa: F811
    packed, qs, absmax = _quantised(shape, quant_type, nested, dtype)
    want = BF.dequantize_4bit(packed, qs)
    got_ref = R.dequantize_4bit_fwd(packed, absmax, qs.code, 64, *shape, dtype)
    got = interpreter.dequantize_4bit_fwd(packed.to(DEVICE), absmax.to(DEVICE), qs.code.to(DEVICE), 64, *shape, dtype)
    for name, out in (("reference", got_ref), ("triton", got.cpu())):
        assert out.shape == want.shape and out.dtype == dtype, name
        assert torch.equal(out, want), f"{name}: {(out.float() - want.float()).abs().max():.3e} off"


def test_a_wrong_table_is_caught(interpreter):  # noqa: F811
    packed, qs, absmax = _quantised((4, 64), "nf4", False, torch.float32)
    fp4 = BF.get_4bit_type("fp4", device="cpu")
    assert not torch.equal(R.dequantize_4bit_fwd(packed, absmax, fp4, 64, 4, 64, torch.float32),
                           BF.dequantize_4bit(packed, qs))
