"""Before FP8 trains on a GPU: that GPU's Triton quantisers checked once per recipe against the reference
formula, bit for bit, on fixed values (fp32 and bf16, 256 × 2048).

A kernel can be miscompiled for one target and be right everywhere else. Triton 3.6 wrote a quarter of
qᵀ wrong on an H200 when a tile stored both ways came from fp32 input; the interpreter was right there.
Training would then run on wrong weight copies until the loss went NaN (run 125). So ``optimize`` (a
model already on the GPU) or the first FP8 call on a device runs this first, and raises with what
differs instead of training on it. The values come from ``sin`` and powers of two, not a random
generator, so no generator moves. The reference runs on the CPU, where its divisions are true ones.
On CUDA, PyTorch's ``amax / 448`` multiplies by fp32(1/448) instead, which the kernels do not do.
"""
from __future__ import annotations

import torch

from torchfuser.ops import fp8_quant as _quant

_CHECKED: set = set()  # (recipe, device index) checked and right


def _values(device, dtype) -> torch.Tensor:
    i = torch.arange(256 * 2048, device=device, dtype=torch.float32).view(256, 2048)
    return (torch.sin(i * 0.37) * torch.exp2(torch.remainder(i, 23.0) - 11.0)).to(dtype)


def _cases(recipe: str, t: torch.Tensor):
    """(what, the kernels' outputs, the reference's on the CPU) for each quantiser ``recipe`` calls."""
    cpu = t.cpu()
    if recipe == "blockwise":
        yield "fp8_quantize_blocks", _quant.quantize_blocks(t, True, True), _quant.fp8_quantize_blocks(cpu, True, True, "reference")
        yield "fp8_quantize_weight_blocks", _quant.quantize_weight_blocks(t), _quant.fp8_quantize_weight_blocks(cpu, "reference")
        return
    tw = recipe == "tensorwise"
    for transpose in (False, True):
        yield (f"fp8_quantize(transpose={transpose})", _quant.quantize(t, tw, transpose),
               _quant.fp8_quantize(cpu, tw, transpose, "reference"))
    (q, s), (qt, st) = _quant.quantize_both(t, tw)
    yield "fp8_quantize_both", (q, s, qt, st), _quant.fp8_quantize_both(cpu, tw, "reference")


def _differing(got, want) -> int:
    n = 0
    for g, w in zip(got, want):
        g = g.cpu()
        if g.dtype == torch.float8_e4m3fn:
            g, w = g.view(torch.uint8), w.view(torch.uint8)
        n += int((g != w).sum()) if g.shape == w.shape else max(g.numel(), w.numel())
    return n


def mismatches(recipe: str, device: torch.device) -> list[str]:
    """What differs from the reference, per quantiser and dtype, on ``device`` (empty: all bit-exact)."""
    out = []
    with torch.no_grad():
        for dtype in (torch.bfloat16, torch.float32):
            for what, got, want in _cases(recipe, _values(device, dtype)):
                if n := _differing(got, want):
                    out.append(f"{what} on {str(dtype).removeprefix('torch.')}: {n} values")
    return out


def ensure(recipe: str, device: torch.device) -> None:
    """Raise where ``device``'s FP8 quantisers for ``recipe`` are not bit-exact; once per device and recipe."""
    if device.type != "cuda" or not _quant._TRITON:  # elsewhere the reference code itself runs
        return
    index = device.index if device.index is not None else torch.cuda.current_device()
    if (recipe, index) in _CHECKED:
        return
    bad = mismatches(recipe, torch.device("cuda", index))
    if bad:
        import triton

        raise RuntimeError(
            f"fp8={recipe!r}: the Triton quantisation kernels on {torch.cuda.get_device_name(index)} (Triton "
            f"{triton.__version__}) do not give the reference's bits ({'; '.join(bad)}), so FP8 would train on wrong "
            "values. Use another recipe or fp8=None, and report it with this message.")
    _CHECKED.add((recipe, index))


def checked(recipe: str, device: torch.device) -> bool:
    return device.type != "cuda" or (recipe, device.index) in _CHECKED
