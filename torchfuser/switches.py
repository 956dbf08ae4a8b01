"""Process-wide switches: which of two exact ways some fused paths compute, for the whole process.

Users leave them as they are: each default is the way measured faster (docs/performance/ says where),
and the other way computes the same result (bit for bit, or within the repository's accuracy rule, as
each says). They exist so that a benchmark can time both ways in one process and a test can check the
other way, without flipping module privates:

    from torchfuser import switches

    with switches.switched(lora_split_bf16=False):   # the old values come back at the end
        ...

``switches.SWITCHES`` holds the values in use (read at each call, not at ``optimize``). Unlike
``optimize``'s options they belong to no model: set them around the calls they are for. This module
imports nothing of torchfuser, so any layer may read it.
"""
from __future__ import annotations

import contextlib
import dataclasses
from typing import Iterator

ROWWISE_BOTH_PATHS = ("atomic", "pair", "rows+tiles")


@dataclasses.dataclass
class Switches:
    # LoRA on a bf16 base with fp32 adapters, no autocast (modules/adapters/lora.py): the adapter products as bf16
    # hi/lo GEMMs, no [tokens × out_features] fp32 tensor (True); False runs PEFT's fp32 products literally.
    # Both within the accuracy rule (tests/test_lora_fused.py); why the split: NOTES-lora.md.
    lora_split_bf16: bool = True
    # FP8 (rowwise): our SwiGLU / GeGLU kernels hand the maxima of the operands they write on to the FP8
    # GEMMs (modules/fp8/__init__.py, producer_maxima), so no separate pass reads them again; False: every operand
    # by the separate passes. Bit for bit the same (tests/test_fp8_producers.py); NOTES-fp8.md.
    fp8_producers: bool = True
    # FP8 (rowwise): a fused decoder layer's norms as producers too (modules/residual_norm.py,
    # backends/triton/norm_fp8.py). Off: measured slower than the pass they replace (NOTES-fp8.md, the
    # norm producers); bit for bit the same when on (tests/test_fp8_producers.py).
    fp8_norm_producers: bool = False
    # FP8 rowwise, both ways on CUDA (backends/triton/fp8_quant.py): which kernels make an operand's two
    # quantised copies, "atomic" (one pass, column maxima by atomics), "pair" (two kernels) or
    # "rows+tiles"; bit for bit the same (tests/backends/); timed in NOTES-fp8.md.
    fp8_rowwise_both: str = "atomic"
    # QLoRA 4-bit bases on CUDA with the Triton backend (modules/adapters/quantized_base.py): the base GEMMs (x·Ŵᵀ and
    # dy·Ŵ) as one Triton kernel that dequantises Ŵ tile by tile (backends/triton/dequant_matmul_4bit.py), no
    # transient Ŵ. Off: not measured faster than dequantise-then-cuBLAS yet (benchmarks/probes/dequant_gemm_probe.py,
    # NOTES-qlora.md). Within the accuracy rule when on (tests/backends/test_dequant_matmul_4bit.py).
    qlora_dequant_gemm: bool = False
    # MLIR backend (CPU): a no-grad call of at most ops._call.MLIR_SMALL elements (a decode step's rows) runs the
    # reference kernel, measured cheaper per call there (NOTES-trl.md, rollouts). Off: the MLIR kernel always
    # (the MLIR kernel tests). Within the accuracy rule either way (the reference backend is the oracle).
    mlir_small_to_reference: bool = True
    # A decode-shaped call under no grad (at most modules.decode.DECODE_POSITIONS positions a row: a rollout's decode
    # step) runs the original modules the fused ones replaced: the step is host-bound there and the unfused modules'
    # Python is the cheaper (NOTES-trl.md, rollouts). Off: the fused kernels always. On, such a call gives the unfused
    # model's bits by construction (tests/test_decode_dispatch.py).
    decode_to_original: bool = True

    def __setattr__(self, name: str, value) -> None:
        if name not in {f.name for f in dataclasses.fields(self)}:
            raise AttributeError(f"torchfuser.switches has no switch {name!r}; they are: {', '.join(_names())}")
        if name == "fp8_rowwise_both" and value not in ROWWISE_BOTH_PATHS:
            raise ValueError(f"fp8_rowwise_both must be one of {ROWWISE_BOTH_PATHS}, got {value!r}")
        if name != "fp8_rowwise_both" and not isinstance(value, bool):
            raise TypeError(f"switch {name} takes True or False, got {value!r}")
        super().__setattr__(name, value)


def _names() -> list[str]:
    return [f.name for f in dataclasses.fields(Switches)]


SWITCHES = Switches()


@contextlib.contextmanager
def switched(**values) -> Iterator[Switches]:
    """The switches named set to ``values`` inside the block, back to what they were after it (an
    unknown name or a bad value raises before any is changed)."""
    Switches(**{**dataclasses.asdict(SWITCHES), **values})  # checks every name and value first
    old = {name: getattr(SWITCHES, name) for name in values}
    try:
        for name, value in values.items():
            setattr(SWITCHES, name, value)
        yield SWITCHES
    finally:
        for name, value in old.items():
            setattr(SWITCHES, name, value)
