"""Which blocks ``backend="auto"`` fuses where the device has no compiled backend installed.

On the CPU the compiled backend is MLIR (the ``mlir`` extra). Without torch-mlir, ``auto`` would run every
fused block on the reference backend: the same PyTorch ops as the original block, plus a custom autograd
Function whose backward is derived again by ``torch.func`` (the forward recomputed, more ATen calls). Measured
on the CPU (docs/performance/NOTES-mlir.md, "Without torch-mlir"): every such block measured is slower than the block
it replaces (RMSNorm 0.4-0.55×, LayerNorm 0.15×, gated MLP 0.7-0.95×, attention 0.7-1.0×, one thread) or not
measurably faster (a Mixtral MoE block: 0.9-1.4× alone, 0.92-1.06× in the step), and the demo's whole
training step read 0.5-0.9× eager (the attention variants, varlen and relative-position, are built the same way
and were not timed). So the default leaves those blocks to PyTorch, with the reason in the report; ``backend="reference"`` passed explicitly still fuses them (the oracle, for tests).

Kept: the fused LM head + loss (``lm_head_loss``): its reference kernel on the CPU works through the tokens in
chunks (``reference/lce_chunked.py``), never holding the logits nor their gradient, and is faster than
PyTorch's head + cross-entropy as well as leaner. Where the user asked for what only fused blocks do (``fp8``
emulation, ``checkpointing``), nothing is left out: the blocks bring that, not speed.
"""
from __future__ import annotations

import torch

from . import _PREFERRED, unavailable_reason

# Patterns whose reference form is measured no slower than PyTorch on the CPU, or saves much memory.
KEPT_WITHOUT_COMPILER = frozenset({"lm_head_loss"})

LEFT_TO_PYTORCH = "left to PyTorch"  # the start of every reason given here (strict=True lets these pass)
REASON = (f"{LEFT_TO_PYTORCH}: no compiled CPU backend (torch-mlir is not installed) and the reference "
          "kernels are no faster than PyTorch for this block")


def note(device_type: str) -> str:
    """The report's note that goes with ``REASON``: what to do about it."""
    why = unavailable_reason(_PREFERRED[device_type], device_type)
    return (f"{LEFT_TO_PYTORCH}: blocks whose only fused form here is the reference backend's, no faster than "
            f"PyTorch ({why}). backend='reference' fuses them anyway (the same results; saves activation memory, "
            "costs time); the fused LM head + loss is kept (faster, and it never holds the logits)")


def held(backend: str, device: torch.device | None, *, fp8=None, checkpointing=False) -> frozenset[str] | None:
    """None where every matching block is fused; else the pattern names that are still fused (the others are
    left to PyTorch with ``REASON``): for ``auto`` on a CPU model without its compiled backend, when no option
    that needs fused blocks is on."""
    if backend != "auto" or device is None or device.type != "cpu":
        return None
    if unavailable_reason(_PREFERRED["cpu"], "cpu") is None:
        return None
    if fp8 is not None or checkpointing:
        return None
    return KEPT_WITHOUT_COMPILER
