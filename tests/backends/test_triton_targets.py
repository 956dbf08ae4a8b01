"""The Triton backend on GPUs that are not here: every kernel compiled for AMD (MI300X gfx942, MI250
gfx90a) and NVIDIA (H200 sm_90, A100 sm_80) with the launch choices its launchers make for that
target, the per-target table (targets.py), the H200's choices held to a recording, the direct
launch's gating and first-use check, and ROCm / MPS detection, all simulated on the CPU.

Compiles: the representative subset (bf16 at hidden 123 and 32768, plus the rope and LCE shapes:
every kernel and every constexpr variant of the launchers at least once, 107–108 variants a target,
≈ 410 compiles, ~2.5 min on 2 cores with an empty Triton cache, with the FP8 producers) runs by
default; the whole matrix (fp32/bf16/fp16 × hidden 64, 123, 896, 4096, 8192, 16384, 32768: 482–491
variants a target, 1843 compiles; 4 min 13 s on 2 cores with an empty cache before the FP8 and MoE
kernels) is the slow-marked test.
The MoE kernels are recorded at four model shapes (_crosscompile.MOE_SHAPES) whatever the hiddens.
The FP8 kernels that write e4m3 are not compiled for the A100 (sm_80): Triton has no e4m3 there,
and FP8 is refused on it anyway (no FP8 GEMMs; fp8.check); the test holds Triton to that refusal. Compiled kernels are cached for the session (and by Triton's
own on-disk cache across sessions).
"""
from __future__ import annotations

import json
import os
import types

import pytest
import torch

triton = pytest.importorskip("triton")

from torchfuser import backends  # noqa: E402
from torchfuser.backends import _gemm  # noqa: E402
from torchfuser.backends.triton import _common, _crosscompile as cc, targets  # noqa: E402

GPU_TARGETS = ("gfx942", "gfx90a", "sm_90", "sm_80")
_COMPILED: dict = {}  # (launch key, target) -> (CompiledKernel, resources): one compile a session
_DATA = os.path.join(os.path.dirname(__file__), "data", "sm90_launches.json")


def _launches(target, **kw):
    with targets.simulate(target):
        return cc.record_launches(**kw)


def _compile(launch, target):
    key = (launch.key(), target.name)
    if key not in _COMPILED:
        k = cc.compile_launch(launch, target.gpu_target())
        _COMPILED[key] = (k, cc.resources(k, target))
    return _COMPILED[key]


# --- the H200's launch choices are exactly those made before the table existed ---

def _unique_described(launches):
    out, seen = [], set()
    for launch in launches:
        d = json.dumps(launch.describe(), sort_keys=True)
        if d not in seen:
            seen.add(d)
            out.append(json.loads(d))
    return out


def test_sm90_launch_choices_unchanged():
    """Block sizes, rows, constexpr variants, num_warps, STAGES and grids of every launch the
    launchers make on an H200 (132 SMs) for the representative shapes equal the recording taken
    from the code before the per-target table (tests/backends/data/sm90_launches.json)."""
    recorded = json.load(open(_DATA))["launches"]
    now = _unique_described(_launches("sm_90", unique=False))
    assert len(now) == len(recorded)
    for a, b in zip(now, recorded):
        assert a == b, (a["op"], a["kernel"])


def test_other_cuda_gpus_keep_the_h200_choices():
    """An NVIDIA GPU without a row of its own (the ``cuda`` row) launches as the H200 does, grids aside."""
    strip = lambda ls: [{k: v for k, v in d.items() if k != "grid"} for d in _unique_described(ls)]  # noqa: E731
    assert strip(_launches("cuda", unique=False)) == strip(_launches("sm_90", unique=False))


def test_amd_choices_follow_the_wavefront():
    """On AMD the tiles are the H200's, with the threads a program counted in 64-wide wavefronts:
    never more warps than on the H200, never more than 1024 threads, and the norm backwards'
    staged tiles within the LDS budget."""
    nv, amd = _launches("sm_90", unique=False), _launches("gfx942", unique=False)
    assert len(amd) == len(nv)
    fewer = 0
    for launch, ref in zip(amd, nv):
        assert (launch.op, launch.name) == (ref.op, ref.name)
        tiles = {k: v for k, v in launch.kwargs.items() if k not in ("num_warps", "STAGES", "num_stages")}
        assert tiles == {k: v for k, v in ref.kwargs.items() if k not in ("num_warps", "STAGES", "num_stages")}
        w, w_nv = launch.kwargs["num_warps"], ref.kwargs["num_warps"]
        assert w <= w_nv and w * 64 <= 1024
        fewer += w < w_nv
        if launch.kwargs.get("STAGES", 1) > 1:  # x and dy tiles, 3 stages, within the staged budget
            rows, block, item = launch.kwargs["ROWS"], launch.kwargs["BLOCK_N"], launch.args[0].element_size()
            assert 3 * rows * block * 2 * item <= targets.TARGETS["gfx942"].staged_bytes
    assert fewer > len(amd) // 2  # the wavefront size is really read


def test_table_rows():
    t = targets.TARGETS
    assert {t[n].warp_size for n in ("gfx942", "gfx90a", "hip")} == {64}
    assert t["gfx942"].shared_bytes == t["gfx90a"].shared_bytes == 64 * 1024
    assert [n for n, r in t.items() if r.hopper] == ["sm_90"]
    assert not any(r.direct_launch for r in t.values() if r.backend == "hip")
    for r in t.values():
        assert r.staged_bytes <= r.shared_bytes


# --- every kernel compiles for every target ---

_FAST = dict(hiddens=(123, 32768), dtypes=(torch.bfloat16,))  # one-pass (pipelined bwd) and looped kernels


def _has_e4m3(target) -> bool:
    """Whether Triton has e4m3 (``tl.float8e4nv``) on ``target``: NVIDIA from sm_89 (not the A100, where
    fp8.check refuses FP8 anyway: no FP8 GEMMs), every AMD target."""
    return target.backend == "hip" or int(target.arch) >= 89


def _check_compiles(target_name, **kw):
    target = targets.TARGETS[target_name]
    launches = _launches(target_name, **kw)
    assert {l.name for l in launches} == _ALL_KERNELS
    for launch in launches:
        if launch.name in _FP8_CAST_KERNELS and not _has_e4m3(target):
            with pytest.raises(Exception, match="fp8e4nv not supported in this architecture"):
                cc.compile_launch(launch, target.gpu_target())
            continue
        k, res = _compile(launch, target)
        want = ("amdgcn", "hsaco") if target.backend == "hip" else ("ptx", "cubin")
        assert all(k.asm.get(a) for a in want), (launch.name, list(k.asm))
        assert k.metadata.num_warps == launch.kwargs["num_warps"]
        assert k.metadata.warp_size == target.warp_size
        assert res["shared"] <= target.shared_bytes, (launch.op, launch.kwargs, res)
        assert res["threads"] <= 1024
        assert (res.get("regs") or res.get("vgprs") or 0) > 0  # the artifact was really read
        assert res["occupancy"] is None or 0 < res["occupancy"] <= 1


_ALL_KERNELS = {
    "_rms_norm_fwd_kernel", "_rms_norm_bwd_kernel", "_sum_partials_kernel", "_layer_norm_fwd_kernel",
    "_layer_norm_bwd_kernel", "_gated_fwd_kernel", "_gated_bwd_kernel", "_gelu_fwd_kernel", "_gelu_bwd_kernel",
    "_rope_fwd_kernel", "_linear_cross_entropy_fwd_kernel", "_scale_kernel", "_row_scale_kernel",
    "_fp8_quant_rows_kernel", "_fp8_amax_kernel", "_fp8_quant_tiles_kernel",
    "_moe_route_fwd_kernel", "_moe_route_bwd_kernel", "_moe_act_fwd_kernel", "_moe_act_bwd_kernel",
    "_moe_combine_kernel", "_moe_gather_scale_kernel", "_fp8_amax_both_kernel", "_fp8_quant_both_kernel",
    "_fp8_quant_blocks_kernel", "_fp8_quant_weight_blocks_kernel", "_gated_fwd_amax_kernel", "_gated_bwd_amax_kernel",
    "_rms_norm_fwd_amax_kernel", "_rms_norm_bwd_amax_kernel", "_dequantize_4bit_fwd_kernel",
    "_dequant_matmul_4bit_kernel", "_hilo_split_fwd_kernel", "_activation_fwd_kernel", "_activation_bwd_kernel",
    "_dequantize_scales_kernel", "_rms_norm_add_fwd_kernel",
}
# The ones that write e4m3:
_FP8_CAST_KERNELS = {"_fp8_quant_rows_kernel", "_fp8_quant_tiles_kernel", "_fp8_quant_both_kernel",
                     "_fp8_quant_blocks_kernel", "_fp8_quant_weight_blocks_kernel"}


def test_every_kernel_of_the_backend_is_covered():
    """Every @triton.jit kernel defined in any of the backend's files is among the recorded launches."""
    import importlib
    import pkgutil

    import torchfuser.backends.triton as package

    defined = set()
    for info in pkgutil.iter_modules(package.__path__):
        m = importlib.import_module(f"{package.__name__}.{info.name}")
        defined |= {n for n, v in vars(m).items() if isinstance(v, triton.runtime.jit.JITFunction)
                    and v.module == m.__name__ and n.endswith("_kernel")}
    assert defined == _ALL_KERNELS


# The H200 and the MI300X in the quick suite; the A100 and the MI250 (same backends, other archs) in the slow step.
@pytest.mark.parametrize("target", ["sm_90", "gfx942", pytest.param("gfx90a", marks=pytest.mark.slow),
                                    pytest.param("sm_80", marks=pytest.mark.slow)])
def test_kernels_compile_for_target(target):
    """The representative subset: every kernel and constexpr variant, bf16, hidden 123 and 32768."""
    _check_compiles(target, **_FAST)


@pytest.mark.slow
@pytest.mark.parametrize("target", GPU_TARGETS)
def test_kernels_compile_for_target_full_matrix(target):
    """The whole matrix: fp32/bf16/fp16 × hidden 64, 123, 896, 4096, 8192, 16384, 32768 (+ rope, LCE shapes)."""
    _check_compiles(target)


def test_resource_parsers_read_the_artifacts():
    """The resource report's numbers come from the artifacts: a bigger tile takes more registers."""
    for name in ("sm_90", "gfx942"):
        target = targets.TARGETS[name]
        small = [l for l in _launches(name, hiddens=(64,), dtypes=(torch.float32,)) if l.op == "rms_norm_bwd"][0]
        big = [l for l in _launches(name, hiddens=(4096,), dtypes=(torch.float32,)) if l.op == "rms_norm_bwd"][0]
        reg = "vgprs" if target.backend == "hip" else "regs"
        r_small, r_big = _compile(small, target)[1], _compile(big, target)[1]
        assert r_big[reg] > r_small[reg]
        assert r_small["spills"] == 0


# --- the direct launch: gated per target, checked against kernel[grid] on first reuse ---

from triton.compiler.compiler import LazyDict  # noqa: E402
from triton.knobs import HookChain  # noqa: E402


class _FakeCudaLauncher:
    """Triton 3.6's CudaLauncher as far as Launcher relies on it (__call__ adds scratch and flags)."""

    def __init__(self, log, layout_changed=False):
        self.global_scratch_size = self.profile_scratch_size = 0
        self.launch_cooperative_grid, self.launch_pdl = False, False
        self.layout_changed = layout_changed
        self.launch = lambda *a: log.append(a)

    def __call__(self, gx, gy, gz, stream, function, *args):
        extra = ("new-flag",) if self.layout_changed else ()  # a later Triton's extra argument
        self.launch(gx, gy, gz, stream, function, self.launch_cooperative_grid, self.launch_pdl, None, None,
                    *extra, *args)


class _FakeKernel:
    """A @triton.jit kernel's launch path: ``fn[grid](*args)`` compiles once and launches through
    ``compiled.run`` with JITFunction.run's argument layout."""

    def __init__(self, layout_changed=False):
        self.launches, self.ordinary = [], 0
        self.compiled = types.SimpleNamespace(function=7, packed_metadata=(4, 1), run=_FakeCudaLauncher(
            self.launches, layout_changed))
        binder = lambda *a, **k: ({f"a{i}": v for i, v in enumerate(a)}, [("i32", None)] * len(a), dict(k))  # noqa: E731
        self.device_caches = {0: (None, None, None, None, binder)}

    def __getitem__(self, grid):
        def run(*args, **kwargs):
            self.ordinary += 1
            g = tuple(grid) + (1,) * (3 - len(grid))
            # As Triton 3.6 passes them with no hooks installed: a launch-metadata dict, empty hook chains.
            meta = LazyDict({"name": "k", "function": 7, "stream": 123})
            self.compiled.run(*g, 123, self.compiled.function, self.compiled.packed_metadata, meta, HookChain(),
                              HookChain(), *args)
            return self.compiled
        return run


@pytest.fixture
def direct(monkeypatch):
    monkeypatch.setattr(_common, "_DIRECT", True)
    monkeypatch.setattr(_common, "_current_device", lambda: 0, raising=False)
    monkeypatch.setattr(_common, "_raw_stream", lambda device: 123, raising=False)
    monkeypatch.setattr(_common, "_hooks_installed", lambda: False)

    def use(row):
        monkeypatch.setattr(targets, "_BY_INDEX", {0: targets.TARGETS[row]})
    return use


def test_direct_launch_after_it_matched_kernel_grid(direct):
    direct("sm_90")
    fn = _FakeKernel()
    launcher = _common.Launcher(fn)
    x = torch.zeros(1)
    for _ in range(4):
        launcher((5,), x, 3, BLOCK=16)
    assert fn.ordinary == 2  # compile + the checked second launch; the rest are direct
    assert len(fn.launches) == 4 and all(_common._same_launch(a, fn.launches[0]) for a in fn.launches[1:])
    assert fn.launches[-1][10:13] == (None, None, None)  # the direct call: no metadata, no hook chains
    assert fn.launches[0][:4] == (5, 1, 1, 123) and fn.launches[0][-2] is x


def test_direct_launch_refused_when_the_layout_differs(direct, caplog, monkeypatch):
    direct("sm_90")
    monkeypatch.setattr(_common, "_refused", [])
    fn = _FakeKernel(layout_changed=True)
    launcher = _common.Launcher(fn)
    for _ in range(5):
        launcher((5,), torch.zeros(1), 3)
    assert fn.ordinary == 5 and len(fn.launches) == 5
    assert [r.message.count("did not pass the arguments") for r in caplog.records] == [1]  # said once


@pytest.mark.parametrize("row", ["gfx942", "gfx90a", "hip"])
def test_no_direct_launch_on_rocm(direct, row):
    direct(row)
    fn = _FakeKernel()
    launcher = _common.Launcher(fn)
    for _ in range(4):
        launcher((5,), torch.zeros(1), 3)
    assert fn.ordinary == 4 and not launcher.pending and not launcher.cache


def test_direct_launch_needs_a_cuda_build(monkeypatch):
    from triton import knobs

    monkeypatch.setattr(knobs.runtime, "interpret", False)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch._C, "_cuda_getCurrentRawStream", lambda d: 0, raising=False)
    monkeypatch.setattr(torch.version, "cuda", "12.8")
    monkeypatch.setattr(torch.version, "hip", None)
    assert _common._direct_supported() == (triton.__version__.split(".")[:2] == ["3", "6"])
    monkeypatch.setattr(torch.version, "hip", "6.4.43482")
    assert not _common._direct_supported()


# --- device detection, simulated ---

def _props(**kw):
    base = dict(major=9, minor=0, multi_processor_count=132, gcnArchName="")
    return types.SimpleNamespace(**{**base, **kw})


@pytest.mark.parametrize("hip, props, row", [
    (None, _props(), "sm_90"),
    (None, _props(major=8, minor=0, multi_processor_count=108), "sm_80"),
    (None, _props(major=12, minor=0), "cuda"),
    ("6.4", _props(gcnArchName="gfx942:sramecc+:xnack-", multi_processor_count=304), "gfx942"),
    ("6.4", _props(gcnArchName="gfx90a:sramecc+:xnack-", multi_processor_count=110), "gfx90a"),
    ("6.4", _props(gcnArchName="gfx950"), "hip"),
    ("6.4", _props(gcnArchName="gfx1100"), "hip-rdna"),
])
def test_target_detection(monkeypatch, hip, props, row):
    monkeypatch.setattr(torch.version, "hip", hip)
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda i: props)
    monkeypatch.setattr(targets, "_BY_INDEX", {})
    assert targets.target_of_index(0) is targets.TARGETS[row]
    assert targets.sms_of_index(0) == props.multi_processor_count


def test_auto_on_rocm_is_triton(monkeypatch):
    """A ROCm build of PyTorch calls its GPUs "cuda": ``auto`` gives them the Triton backend, with
    no fallback reason, as on NVIDIA."""
    monkeypatch.setattr(torch.version, "hip", "6.4.43482")
    monkeypatch.setattr(torch.version, "cuda", None)
    monkeypatch.setitem(backends._INSTALLED, "triton", True)
    assert backends.resolve("auto", "cuda") == "triton"
    assert backends.auto_fallback_reason("cuda") is None
    monkeypatch.setitem(backends._INSTALLED, "triton", False)
    assert backends.resolve("auto", "cuda") == "reference"
    assert "not installed" in backends.auto_fallback_reason("cuda")


def test_auto_on_mps_says_reference():
    assert backends.resolve("auto", "mps") == "reference"
    why = backends.auto_fallback_reason("mps")
    assert why and "reference" in why and "mps" in why


@pytest.mark.parametrize("behaviour, ok", [
    ("fp32", True),  # cuBLAS / hipBLASLt writing the fp32 accumulator
    ("raises", False),  # no kernel for aten::mm.dtype on this device (the CPU; a ROCm build without it)
    ("bf16", False),  # the overload ignores out_dtype
])
def test_fp32_output_gemm_probe(monkeypatch, behaviour, ok):
    """The fp32-output GEMM probe of backends/_gemm.py on a simulated GPU: asked once per device,
    True only when both mm and addmm give fp32."""
    calls = []

    def mm(a, b, out_dtype=None, **kw):
        calls.append("mm")
        if behaviour == "raises" and out_dtype is not None:
            raise RuntimeError('"mm_dtype" not implemented for this device')
        return torch.ones(1, 1, dtype=out_dtype if behaviour == "fp32" and out_dtype else a.dtype)

    def addmm(c, a, b, out_dtype=None, **kw):
        return mm(a, b, out_dtype=out_dtype)

    monkeypatch.setattr(torch, "mm", mm)
    monkeypatch.setattr(torch, "addmm", addmm)
    monkeypatch.setattr(torch, "ones", lambda *s, device=None, dtype=None: torch.empty(*s, dtype=dtype))
    monkeypatch.setattr(_gemm, "_OUT_DTYPE", {})
    dev = torch.device("cuda", 3)
    assert _gemm.fp32_out_ok(dev) is ok
    n = len(calls)
    assert _gemm.fp32_out_ok(dev) is ok and len(calls) == n  # cached per device


def test_report_label_on_mps():
    """The report's backend column for a module fused on an Apple GPU: the reference backend, and why."""
    from torchfuser import walker

    label = walker._backend_label("auto", torch.device("mps"))
    assert label.startswith("reference (") and "Apple" in label
    assert walker._backend_label("reference", torch.device("mps")) == "reference"
