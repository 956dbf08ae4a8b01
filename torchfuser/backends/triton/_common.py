"""Helpers shared by the Triton launchers: dtype checks, 2-D row views, cached launch configs, and
the direct launcher."""
from __future__ import annotations

from functools import lru_cache

import torch
import triton

SUPPORTED = (torch.float32, torch.bfloat16, torch.float16)


def check_dtypes(op: str, **tensors: torch.Tensor | None) -> None:
    for name, t in tensors.items():
        if t is not None and t.dtype not in SUPPORTED:
            raise TypeError(
                f"{op}: the triton backend supports float32, bfloat16 and float16, but {name} is {t.dtype}; "
                "use backend='reference' for other dtypes (float64 is the test oracle's dtype, not a kernel's)"
            )


def check_same_shape(op: str, **tensors: torch.Tensor) -> None:
    """The tensors are added elementwise without broadcasting: their shapes must be equal."""
    shapes = {name: tuple(t.shape) for name, t in tensors.items()}
    if len(set(shapes.values())) > 1:
        listed = ", ".join(f"{name} {s}" for name, s in shapes.items())
        raise ValueError(f"{op}: these tensors must have the same shape (no broadcasting), got {listed}")


def rows_view(t: torch.Tensor, n: int) -> torch.Tensor:
    """``t`` as an M×n matrix whose rows may be strided but whose last dim is dense.

    A view when possible (a transposed or sliced activation keeps its row stride), a copy only
    when the last dim itself is strided (e.g. an expanded gradient of stride 0). Rows that alias
    (row stride 0) are fine: kernels only read their inputs.
    """
    t2 = t.reshape(-1, n)
    if t2.stride(-1) != 1:
        t2 = t2.contiguous()
    return t2


def rows_of(t: torch.Tensor, n: int) -> tuple[torch.Tensor, int, int]:
    """(tensor, M, row stride) for ``t`` read as M×n rows with a dense last dim. A contiguous
    ``t`` is passed as it is (a kernel only needs its pointer): no reshape, no new tensor."""
    if n > 0 and t.is_contiguous():
        return t, t.numel() // n, n
    t2 = rows_view(t, n)
    return t2, t2.shape[0], t2.stride(0)


def next_pow2(n: int) -> int:
    return 1 << max(0, int(n) - 1).bit_length()


def cdiv(a: int, b: int) -> int:
    """⌈a / b⌉. Not ``triton.cdiv``: in Triton 3.6 that is a ``ConstexprFunction`` costing ≈ 2 µs a
    call on the host (a norm's forward and backward called it five times)."""
    return -(-a // b)


PROGRAMS_PER_SM = 2
# Software pipelining of the norm backwards' loop over row tiles: loads of the next tiles are in
# flight while this one is reduced. Measured on an H200 (benchmarks/probes/norm_bwd_probe.py,
# NOTES-triton.md): at 32768×4096 bf16, 3 stages take rms_norm's backward from 78% to 90% of the
# copy bandwidth and layer_norm's from 61% to 91%; with 2-row tiles it pays at ~16 tiles per
# program too (bf16 rms_norm at 8192×896: 35 → 28 µs; 8192×2048: 47 → 42 µs). The staged tiles
# live in shared memory: capped below.
BWD_STAGES = 3
_MIN_TILES_TO_PIPELINE = 8
_STAGED_BYTES = 96 << 10


def bwd_stages(tiles_per_program: int, rows: int, block: int, itemsize: int, extra_itemsize: int = 0) -> int:
    """num_stages for a norm backward's row-tile loop (x and dy tiles are staged, and a third tile of
    ``extra_itemsize`` bytes an element when non-zero, e.g. the residual's gradient)."""
    staged = BWD_STAGES * rows * block * (2 * itemsize + extra_itemsize)
    return BWD_STAGES if tiles_per_program >= _MIN_TILES_TO_PIPELINE and staged <= _STAGED_BYTES else 1


@lru_cache(maxsize=None)
def num_programs_cap(device_index: int | None) -> int:
    """Persistent-grid size for the norm backwards: 2 programs per SM. Measured on an H200
    (docs/performance/NOTES-triton.md): 8 per SM sped up rms_norm's backward at 32768×4096
    by 12% but slowed layer_norm's by 30% (4× the fp32 partial dw/db rows to write and sum)
    and both at 8192×2048 under CUDA graphs, so 2 stays."""
    if device_index is None:  # CPU under TRITON_INTERPRET: each program runs in Python, keep it few
        return 4
    return PROGRAMS_PER_SM * torch.cuda.get_device_properties(device_index).multi_processor_count


def device_key(t: torch.Tensor) -> int | None:
    return t.device.index if t.device.type == "cuda" else None


def warps_for(elements: int, lo: int = 1, hi: int = 16) -> int:
    """About 8–16 fp32 values in registers per thread: enough loads in flight, no spills."""
    w = next_pow2(max(1, elements // 512))
    return max(lo, min(hi, w))


class Launcher:
    """``kernel[grid](*args, **constexprs)`` for one ``@triton.jit`` kernel, with less host work.

    Triton's ``JITFunction.run`` costs tens of µs a call on a loaded host (options dict, a
    string cache key, the current device and stream through ``torch.cuda``, a launch-metadata
    dict and two empty launch-hook chains called from C). Our launches are short kernels, so
    that cost decides the training step on small models (NOTES-train-step.md). Here the first
    launch of each specialization goes through ``JITFunction.run`` (which compiles and returns
    the compiled kernel); later launches bind the arguments with Triton's own binder (so the
    specialization key — dtypes, 16-byte alignment, ints equal to 1 or divisible by 16 — is
    exactly Triton's) and call the compiled kernel's launcher directly. Anything unexpected
    (the CPU interpreter, another Triton version's internals, launch hooks installed by a
    profiler such as proton) takes the ordinary path.
    """

    __slots__ = ("fn", "binder", "cache")

    def __init__(self, fn):
        self.fn = fn
        self.binder = None  # Triton's per-kernel argument binder, once Triton has built it
        self.cache = {}  # (device, specialization, options) -> (C launch function, its leading args)

    def __call__(self, grid, *args, **kwargs):
        if _DIRECT and self.binder is not None and not _hooks_installed():
            bound, spec, options = self.binder(*args, **kwargs)
            device = _current_device()
            entry = self.cache.get((device, tuple(spec), tuple(options.items())))
            if entry is not None:
                launch, head = entry
                launch(grid[0], grid[1] if len(grid) > 1 else 1, grid[2] if len(grid) > 2 else 1,
                       _raw_stream(device), *head, *bound.values())
                return
        self._slow(grid, args, kwargs)

    def _slow(self, grid, args, kwargs):
        compiled = self.fn[grid](*args, **kwargs)
        if not _DIRECT or compiled is None or hasattr(compiled, "result"):
            return
        try:
            device = _current_device()
            caches = self.fn.device_caches[device]
            binder = caches[4]
            _, spec, options = binder(*args, **kwargs)
            run = compiled.run  # the launcher object (handles loaded by the launch above)
            scratch_free = (getattr(run, "global_scratch_size", 1) == 0 and getattr(run, "profile_scratch_size", 1) == 0
                            and hasattr(run, "launch"))
            if scratch_free:
                # CudaLauncher.__call__ only adds scratch buffers, none here: call its C launch directly.
                head = (compiled.function, run.launch_cooperative_grid, run.launch_pdl, None, None,
                        compiled.packed_metadata, None, None, None)
                entry = (run.launch, head)
            else:
                entry = (run, (compiled.function, compiled.packed_metadata, None, None, None))
            self.binder = binder
            self.cache[(device, tuple(spec), tuple(options.items()))] = entry
        except Exception:  # other Triton internals: keep the ordinary path for this kernel
            self.binder = None


def _direct_supported() -> bool:
    try:
        from triton import knobs
        from triton.runtime.jit import JITFunction
    except Exception:
        return False
    if knobs.runtime.interpret or not torch.cuda.is_available():
        return False
    ok_version = triton.__version__.split(".")[:2] == ["3", "6"]  # the launcher layout read from 3.6's source
    return ok_version and hasattr(JITFunction, "create_binder") and hasattr(torch._C, "_cuda_getCurrentRawStream")


def _hooks_installed() -> bool:
    """Whether Triton would do more than launch: launch hooks, debug or instrumentation modes
    (part of its compile options, so a kernel cached without them must not be reused)."""
    rt = _knobs.runtime
    return bool(rt.launch_enter_hook.calls or rt.launch_exit_hook.calls or rt.debug
                or _knobs.compilation.instrumentation_mode)


_DIRECT = _direct_supported()
if _DIRECT:
    from triton import knobs as _knobs

    _current_device = torch._C._cuda_getDevice
    _raw_stream = torch._C._cuda_getCurrentRawStream
