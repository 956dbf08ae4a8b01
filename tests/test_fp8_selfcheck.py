"""The once-per-GPU check of the FP8 quantisers (modules/fp8/selfcheck.py): bit-exact kernels pass, a kernel
off by one bit is found and named, and the check draws from no random generator. On the CPU the reference
code runs on both sides, so a wrong kernel is stood in for by a patched quantiser."""
from __future__ import annotations

import pytest
import torch

from torchfuser.modules import fp8
from torchfuser.modules.fp8 import selfcheck as check
from torchfuser.ops import fp8_quant

CPU = torch.device("cpu")


@pytest.mark.parametrize("recipe", fp8.RECIPES)
def test_right_kernels_pass(recipe):
    before = torch.get_rng_state()
    assert check.mismatches(recipe, CPU) == []
    assert torch.equal(torch.get_rng_state(), before)


def test_a_wrong_bit_is_found_and_named(monkeypatch):
    real = fp8_quant.quantize_both

    def one_bit_off(t, tensorwise):
        (q, s), (qt, st) = real(t, tensorwise)
        if t.dtype == torch.float32:  # as the H200's fault: fp32 input, the transposed copy
            qt = qt.clone()
            qt.view(torch.uint8)[1, 0] ^= 1
        return (q, s), (qt, st)

    monkeypatch.setattr(fp8_quant, "quantize_both", one_bit_off)
    assert check.mismatches("tensorwise", CPU) == ["fp8_quantize_both on float32: 1 values"]


def test_the_cpu_needs_no_check():
    check.ensure("rowwise", CPU)  # returns: the reference code itself runs there
    assert check.checked("rowwise", CPU)


_FP8_GPU = torch.cuda.is_available() and torch.cuda.get_device_capability() >= (8, 9)


@pytest.mark.skipif(not _FP8_GPU, reason="needs a GPU with e4m3 (compute capability 8.9 or newer)")
@pytest.mark.parametrize("recipe", fp8.RECIPES)
def test_this_gpus_kernels_are_bit_exact(recipe):
    """What optimize checks before FP8 trains here (the H200's fp32 fault of run 124 fails this)."""
    assert check.mismatches(recipe, torch.device("cuda")) == []


def test_a_wrong_gemm_is_found_and_named(monkeypatch):
    """A GEMM that reads its scales wrong (here: the second operand's ignored) is off its dequantised product."""
    from torchfuser.backends import _fp8_gemm

    real = _fp8_gemm.mm_blocks
    monkeypatch.setattr(_fp8_gemm, "mm_blocks", lambda a, b, out, bias=None: real(a, (b[0], b[1].mul(2), b[2]), out, bias))
    bad = check.mismatches("blockwise", CPU)
    assert len(bad) == 3 and all("GEMM: off its dequantised product" in b for b in bad)
