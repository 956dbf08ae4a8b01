"""Before FP8 trains on a GPU: that GPU's Triton quantisers checked once per recipe against the reference
formula, bit for bit, on fixed values (fp32 and bf16, 256 × 2048), and its three FP8 GEMMs against the
product of their dequantised operands.

A kernel can be miscompiled for one target and be right everywhere else. Triton 3.6 wrote a quarter of
qᵀ wrong on an H200 when a tile stored both ways came from fp32 input; the interpreter was right there.
Training would then run on wrong weight copies until the loss went NaN (docs/performance/NOTES-fp8.md). So ``optimize`` (a
model already on the GPU) or the first FP8 call on a device runs this first, and raises with what
differs instead of training on it. The values come from ``sin`` and powers of two, not a random
generator, so no generator moves. The reference runs on the CPU, where its divisions are true ones.
On CUDA, PyTorch's ``amax / 448`` multiplies by fp32(1/448) instead, which the kernels do not do.
"""
from __future__ import annotations

import torch

from torchfuser.backends import _fp8_gemm
from torchfuser.backends.reference.fp8_blocks import dequantize_blocks
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


def _products(recipe: str, device: torch.device):
    """(what, the FP8 GEMM's result, the same product of the dequantised operands in fp32) for the three
    products a projection runs (y = x·Wᵀ, dx = dy·W, dW = dyᵀ·x): wrong scale layouts or a missing
    kernel show here, as a large error or an exception."""
    x = _values(device, torch.bfloat16)[:, 512:1024].contiguous()  # 256 tokens × 512 in
    w = _values(device, torch.float32)[:, :512].contiguous()  # W: 256 out × 512 in, an fp32 master
    dy = _values(device, torch.bfloat16)[:, 1024:1280].contiguous()  # 256 tokens × 256 out
    if recipe == "blockwise":
        q, s, qt, st = _quant.quantize_blocks(x, True, True)
        dq, ds, dqt, dst = _quant.quantize_blocks(dy, True, True)
        wq, s_fwd, wqt, s_bwd = _quant.quantize_weight_blocks(w)
        deq = lambda q, s, weight=False: dequantize_blocks(q, s, weight)  # noqa: E731
        cases = ((q, s, "1x128"), (wq, s_fwd, "128x128"), deq(q, s), deq(wq, s_fwd, True)), \
                ((dq, ds, "1x128"), (wqt, s_bwd, "128x128"), deq(dq, ds), deq(wqt, s_bwd, True)), \
                ((dqt, dst, "1x128"), (qt, st, "1x128"), deq(dqt, dst), deq(qt, st))
    else:
        tw = recipe == "tensorwise"
        deq = lambda qs: qs[0].float() * qs[1]  # noqa: E731
        ops = [(_quant.quantize(x, tw), _quant.quantize(w, tw)), (_quant.quantize(dy, tw), _quant.quantize(w, tw, True)),
               (_quant.quantize(dy, tw, True), _quant.quantize(x, tw, True))]
        cases = tuple((a, b, deq(a), deq(b)) for a, b in ops)
    for what, (a, b, da, db) in zip(("y = x·Wᵀ", "dx = dy·W", "dW = dyᵀ·x"), cases):
        yield what, lambda a=a, b=b: _fp8_gemm.mm(a, b, torch.float32), da @ db.t()


def mismatches(recipe: str, device: torch.device) -> list[str]:
    """What differs from the reference, per quantiser and dtype, on ``device`` (empty: all bit-exact), and
    which FP8 GEMM is off its dequantised product by more than its bf16 output rounding."""
    out = []
    with torch.no_grad():
        for dtype in (torch.bfloat16, torch.float32):
            for what, got, want in _cases(recipe, _values(device, dtype)):
                if n := _differing(got, want):
                    out.append(f"{what} on {str(dtype).removeprefix('torch.')}: {n} values")
        for what, run, want in _products(recipe, device):
            try:
                got = run()
            except (RuntimeError, ValueError, NotImplementedError) as err:
                out.append(f"the {what} GEMM: {type(err).__name__}: {str(err).splitlines()[0][:160]}")
                continue
            err = float((got.float() - want).norm() / want.norm())
            if not err <= 2.0 ** -7:  # bf16 output rounding at most, where fp32 outputs are not written
                out.append(f"the {what} GEMM: off its dequantised product by {err:.2e} in norm")
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
