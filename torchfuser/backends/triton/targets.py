"""What the launch heuristics know about each GPU: one row per target, no per-vendor ``if`` chains.

A launcher asks ``target_of(tensor)`` and reads fields: the warp (wavefront) size decides how many
warps a tile needs for ~16 fp32 values a thread; ``staged_bytes`` caps the shared memory (LDS on
AMD) the norm backwards' software pipeline may hold; ``sms`` sizes the persistent grids when no
device is there to ask (simulation). ``sm_90`` is the H200 the timings in benchmarks/results/ were
measured on: its row reproduces the launch choices made before this table existed
(tests/backends/test_triton_targets.py holds them to a recording), and ``cuda`` (any other NVIDIA
GPU) keeps them too. None of the kernels uses a Hopper-only feature (TMA descriptors, wgmma,
warp specialisation, thread-block clusters); ``hopper`` records where one would be allowed.

On the CPU (``TRITON_INTERPRET=1``, or meta tensors) there is no device: ``target_of`` gives the
``cpu`` row, unless ``simulate(target)`` is active (the cross-compile tests and
benchmarks/triton_resources.py use that to make the launchers choose for a GPU that is not here).
"""
from __future__ import annotations

import contextlib
from dataclasses import dataclass

import torch

KiB = 1 << 10


@dataclass(frozen=True, eq=False)  # eq=False: hashed by identity, cheap as an lru_cache key
class Target:
    name: str
    gpu: str  # the part this row was written for
    backend: str  # Triton's backend: "cuda" or "hip"
    arch: int | str  # 90 (compute capability 9.0) or "gfx942"
    warp_size: int  # threads per warp / wavefront
    shared_bytes: int  # shared memory (LDS) one program may use
    staged_bytes: int  # at most this much of it for the norm backwards' pipelined tiles
    sms: int  # SMs / CUs of the part (only read when simulating: a live device is asked)
    hopper: bool  # TMA, wgmma, clusters allowed (none is used today)
    direct_launch: bool  # Launcher's C-launch path is checked for this target (see _common.Launcher)
    # Per SM (NVIDIA) / CU (AMD), for the occupancy estimate of benchmarks/triton_resources.py:
    smem_per_sm: int = 0  # shared memory / LDS
    max_warps_per_sm: int = 0  # resident warps (AMD: 8 waves per SIMD × 4 SIMDs)

    def gpu_target(self):
        from triton.backends.compiler import GPUTarget

        return GPUTarget(self.backend, self.arch, self.warp_size)


_NV = dict(backend="cuda", warp_size=32, staged_bytes=96 * KiB, direct_launch=True, max_warps_per_sm=64)
_AMD = dict(backend="hip", warp_size=64, shared_bytes=64 * KiB, hopper=False, direct_launch=False,
            smem_per_sm=64 * KiB, max_warps_per_sm=32)
# AMD: the 64 KiB LDS also holds the reductions' scratch and the layout conversions; 32 KiB of
# staged tiles keeps the fp32 backward's 3-stage pipeline at hidden ≤ 2048 (bf16: ≤ 4096).
TARGETS: dict[str, Target] = {t.name: t for t in (
    Target("sm_90", "H200", arch=90, shared_bytes=227 * KiB, sms=132, hopper=True, smem_per_sm=228 * KiB, **_NV),
    Target("sm_80", "A100", arch=80, shared_bytes=163 * KiB, sms=108, hopper=False, smem_per_sm=164 * KiB, **_NV),
    Target("cuda", "other NVIDIA", arch=80, shared_bytes=99 * KiB, sms=132, hopper=False, smem_per_sm=100 * KiB, **_NV),
    Target("gfx942", "MI300X", arch="gfx942", staged_bytes=32 * KiB, sms=304, **_AMD),
    Target("gfx90a", "MI250X (one GCD)", arch="gfx90a", staged_bytes=32 * KiB, sms=110, **_AMD),
    Target("hip", "other AMD CDNA", arch="gfx942", staged_bytes=32 * KiB, sms=304, **_AMD),
    # RDNA (gfx10+): Triton compiles for 32-wide wavefronts there; never run, only a row to fall into.
    Target("hip-rdna", "other AMD RDNA", arch="gfx1100", staged_bytes=32 * KiB, sms=96,
           **{**_AMD, "warp_size": 32, "max_warps_per_sm": 64}),
    # No device (TRITON_INTERPRET=1 on the CPU): the H200's choices at a tiny grid.
    Target("cpu", "interpreter", backend="cuda", arch=90, warp_size=32, shared_bytes=227 * KiB,
           staged_bytes=96 * KiB, sms=2, hopper=False, direct_launch=False),
)}
CPU = TARGETS["cpu"]
_simulated: Target | None = None
_BY_INDEX: dict[int, Target] = {}


def _row_for_device(index: int) -> Target:
    props = torch.cuda.get_device_properties(index)
    if torch.version.hip:
        arch = getattr(props, "gcnArchName", "").split(":")[0]  # "gfx942:sramecc+:xnack-" -> "gfx942"
        return TARGETS.get(arch) or TARGETS["hip-rdna" if arch.startswith("gfx1") else "hip"]
    return TARGETS.get(f"sm_{props.major}{props.minor}", TARGETS["cuda"])


def target_of_index(index: int | None) -> Target:
    """The row for CUDA/ROCm device ``index`` (None: no device, the ``cpu`` row), or the simulated one."""
    if _simulated is not None:
        return _simulated
    if index is None:
        return CPU
    t = _BY_INDEX.get(index)
    if t is None:
        t = _BY_INDEX[index] = _row_for_device(index)
    return t


def target_of(t: torch.Tensor) -> Target:
    if _simulated is not None:
        return _simulated
    return target_of_index(t.device.index if t.device.type == "cuda" else None)


@contextlib.contextmanager
def simulate(target: Target | str):
    """Within: launchers choose as on ``target`` whatever the tensors' device (meta, CPU)."""
    global _simulated
    old, _simulated = _simulated, TARGETS[target] if isinstance(target, str) else target
    try:
        yield _simulated
    finally:
        _simulated = old


def sms_of_index(index: int | None) -> int:
    """SMs (CUs) for the persistent grids: the device's own count, the table's when simulating."""
    if _simulated is not None or index is None:
        return target_of_index(index).sms
    return torch.cuda.get_device_properties(index).multi_processor_count
