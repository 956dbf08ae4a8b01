"""Helpers shared by the Triton launchers: dtype checks, 2-D row views, cached launch configs, and
the direct launcher."""
from __future__ import annotations

import logging
from functools import lru_cache

import torch
import triton

from . import targets as _targets
from .targets import CPU, Target, sms_of_index, target_of, target_of_index

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
# program too. The staged tiles
# live in shared memory: capped below.
BWD_STAGES = 3
_MIN_TILES_TO_PIPELINE = 8
# The staged tiles' cap (96 KiB on NVIDIA) is the target's staged_bytes (targets.py).


def bwd_stages(tiles_per_program: int, rows: int, block: int, itemsize: int, extra_itemsize: int = 0,
               target: Target = CPU) -> int:
    """num_stages for a norm backward's row-tile loop (x and dy tiles are staged, and a third tile of
    ``extra_itemsize`` bytes an element when non-zero, e.g. the residual's gradient). The staged
    tiles are capped by the target's ``staged_bytes`` (96 KiB on NVIDIA, as measured on the H200;
    less of AMD's 64 KiB LDS)."""
    staged = BWD_STAGES * rows * block * (2 * itemsize + extra_itemsize)
    return BWD_STAGES if tiles_per_program >= _MIN_TILES_TO_PIPELINE and staged <= target.staged_bytes else 1


def num_programs_cap(device_index: int | None) -> int:
    """Persistent-grid size for the norm backwards: 2 programs per SM (CU). Measured on an H200
    (docs/performance/NOTES-triton.md): 8 per SM sped up rms_norm's backward at 32768×4096
    by 12% but slowed layer_norm's by 30% (4× the fp32 partial dw/db rows to write and sum)
    and both at 8192×2048 under CUDA graphs, so 2 stays. No device (CPU under TRITON_INTERPRET,
    each program runs in Python): 4 programs, the ``cpu`` row's 2 "SMs"."""
    live = device_index is not None and _targets._simulated is None
    return PROGRAMS_PER_SM * (_live_sms(device_index) if live else sms_of_index(device_index))


@lru_cache(maxsize=None)
def _live_sms(index: int) -> int:
    return sms_of_index(index)


# PROGRAMS_PER_SM is read on every call (benchmarks/probes/norm_bwd_probe.py sweeps it); what is cached is
# the device's SM count. Kept for callers that cleared the old lru_cache.
num_programs_cap.cache_clear = _live_sms.cache_clear


def device_key(t: torch.Tensor) -> int | None:
    return t.device.index if t.device.type == "cuda" else None


def warps_for(elements: int, lo: int = 1, hi: int = 16, warp_size: int = 32) -> int:
    """About 8–16 fp32 values in registers per thread: enough loads in flight, no spills. With
    AMD's 64-wide wavefronts the same values a thread take half the warps."""
    w = next_pow2(max(1, elements // (16 * warp_size)))
    return max(lo, min(hi, w))


def warps_as_threads(cuda_warps: int, target: Target) -> int:
    """A fixed ``num_warps`` chosen on NVIDIA (32-wide warps), as the same threads a program on ``target``."""
    return max(1, cuda_warps * 32 // target.warp_size)


_refused: list = []  # the first specialization whose direct launch failed its check (warned once)


class Launcher:
    """``kernel[grid](*args, **constexprs)`` for one ``@triton.jit`` kernel, with less host work.

    Triton's ``JITFunction.run`` costs tens of µs a call on a loaded host (options dict, a
    string cache key, the current device and stream through ``torch.cuda``, a launch-metadata
    dict and two empty launch-hook chains called from C). Our launches are short kernels, so
    that cost decides the training step on small models (NOTES-train-step.md). Here the first
    launch of each specialization goes through ``JITFunction.run`` (which compiles and returns
    the compiled kernel); later launches bind the arguments with Triton's own binder (so the
    specialization key — dtypes, 16-byte alignment, ints equal to 1 or divisible by 16 — is
    exactly Triton's) and call the compiled kernel's launcher directly.

    The direct call copies the argument layout of Triton 3.6's ``CudaLauncher``: it is used only
    where that was read and measured (CUDA builds of PyTorch, Triton 3.6: ``_DIRECT``) and on
    targets whose row says ``direct_launch`` (targets.py; not ROCm, whose launcher differs), and
    each specialization is *checked on first use*: its second launch goes through ``kernel[grid]``
    with the C launch function spied on, and the arguments Triton passed must equal the ones the
    direct call would pass (the direct call itself is only recorded, not run, so nothing
    launches twice). A mismatch keeps that specialization on ``kernel[grid]`` for good. Anything
    else unexpected (the CPU interpreter, another Triton version's internals, launch hooks
    installed by a profiler such as proton) takes the ordinary path.
    """

    __slots__ = ("fn", "binder", "cache", "pending")

    def __init__(self, fn):
        self.fn = fn
        self.binder = None  # Triton's per-kernel argument binder, once Triton has built it
        self.cache = {}  # (device, specialization, options) -> (C launch function, its leading args), checked
        self.pending = {}  # the same, built but not yet checked against kernel[grid] (None: check failed)

    def __call__(self, grid, *args, **kwargs):
        if _DIRECT and self.binder is not None and not _hooks_installed():
            bound, spec, options = self.binder(*args, **kwargs)
            device = _current_device()
            key = (device, tuple(spec), tuple(options.items()))
            entry = self.cache.get(key)
            if entry is not None:
                launch, head = entry
                launch(grid[0], grid[1] if len(grid) > 1 else 1, grid[2] if len(grid) > 2 else 1,
                       _raw_stream(device), *head, *bound.values())
                return
            if self.pending.get(key) is not None:
                self._check(key, grid, args, kwargs, bound)
                return
        self._slow(grid, args, kwargs)

    def _check(self, key, grid, args, kwargs, bound):
        """Launch through ``kernel[grid]`` once more, spying on the C launch, and keep the direct
        entry only if the direct call would have passed the same arguments."""
        launch, head, run = self.pending[key]
        calls = []
        target_launch = run.launch

        def spy(*a):
            calls.append(a)
            return target_launch(*a)

        run.launch = spy
        try:
            self.fn[grid](*args, **kwargs)  # Triton's own launch, through the spy
        finally:
            run.launch = target_launch
        g = (grid[0], grid[1] if len(grid) > 1 else 1, grid[2] if len(grid) > 2 else 1)
        would = _direct_args(launch, head, run, spy, g, _raw_stream(key[0]), bound)
        ok = len(calls) == 1 and would is not None and _same_launch(calls[0], would)
        if ok:
            self.cache[key] = (launch, head)
        elif not _refused:  # correct either way, but every launch of it now pays Triton's host path
            _refused.append(key)
            logging.getLogger("torchfuser").warning(
                "torchfuser: the direct Triton launch of %s did not pass the arguments kernel[grid] passes; it runs "
                "through kernel[grid] (slower on the host; please report this with your Triton version)",
                getattr(self.fn, "__name__", self.fn))
        self.pending[key] = None  # checked: direct from now on (ok), or kernel[grid] for good

    def _slow(self, grid, args, kwargs):
        compiled = self.fn[grid](*args, **kwargs)
        if not _DIRECT or compiled is None or hasattr(compiled, "result"):
            return
        try:
            device = _current_device()
            if not target_of_index(device).direct_launch:
                return
            caches = self.fn.device_caches[device]
            binder = caches[4]
            _, spec, options = binder(*args, **kwargs)
            key = (device, tuple(spec), tuple(options.items()))
            if key in self.pending:  # checked before (and failed): stay on kernel[grid]
                return
            run = compiled.run  # the launcher object (handles loaded by the launch above)
            scratch_free = (getattr(run, "global_scratch_size", 1) == 0 and getattr(run, "profile_scratch_size", 1) == 0
                            and hasattr(run, "launch"))
            if scratch_free:
                # CudaLauncher.__call__ only adds scratch buffers, none here: call its C launch directly.
                head = (compiled.function, run.launch_cooperative_grid, run.launch_pdl, None, None,
                        compiled.packed_metadata, None, None, None)
                entry = (run.launch, head, run)
            elif hasattr(run, "launch"):
                entry = (run, (compiled.function, compiled.packed_metadata, None, None, None), run)
            else:
                return
            self.binder = binder
            self.pending[key] = entry
        except Exception:  # other Triton internals: keep the ordinary path for this kernel
            self.binder = None


def _direct_args(launch, head, run, spy, grid, stream, bound):
    """The arguments the C launch function gets from a direct call of (launch, head): the call
    itself, recorded with ``run.launch`` replaced so nothing runs (None if it cannot be recorded)."""
    got = []
    real = run.launch
    run.launch = lambda *a: got.append(a)
    try:
        fn = run.launch if launch is real or launch is spy else launch  # the C function, or CudaLauncher
        fn(*grid, stream, *head, *bound.values())
    except Exception:
        return None
    finally:
        run.launch = real
    return got[0] if len(got) == 1 else None


def _same_launch(a: tuple, b: tuple) -> bool:
    """Equal launch arguments: the same objects (tensors), equal values; an empty launch-hook chain
    is taken as no hook, and the launch-metadata dict as none (the C launcher reads it only to pass
    it to the hooks; JITFunction.run builds one even when the chains are empty)."""
    def norm(v):
        calls = getattr(v, "calls", None)
        if isinstance(calls, list) and not calls or type(v).__name__ == "LazyDict":
            return None
        return v

    if len(a) != len(b):
        return False
    for x, y in zip(a, b):
        x, y = norm(x), norm(y)
        if x is y:
            continue
        if isinstance(x, torch.Tensor) or isinstance(y, torch.Tensor) or type(x) is not type(y) or x != y:
            return False
    return True


def _direct_supported() -> bool:
    try:
        from triton import knobs
        from triton.runtime.jit import JITFunction
    except Exception:
        return False
    if knobs.runtime.interpret or not torch.cuda.is_available() or torch.version.hip:
        return False  # ROCm: HIPLauncher's layout was never read here; per target see targets.py
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
