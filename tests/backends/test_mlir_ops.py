"""The mlir backend (CPU): every op forward and every gradient against float64, odd shapes,
non-contiguous inputs, cache behaviour, memory, and the error without torch-mlir."""
from __future__ import annotations

import gc
import importlib
import os
import resource

import pytest
import torch

pytest.importorskip("torch_mlir")

from numerics import ATOL, assert_within_rule  # noqa: E402

import torchfuser.functional as F  # noqa: E402
from torchfuser.backends import BackendUnavailable, resolve  # noqa: E402


pytestmark = pytest.mark.usefixtures("mlir_tmp_cache")


def _run(fn, tensors, backend, dtype, grads_seed=1):
    """fn(*tensors) forward and gradients w.r.t. every float tensor, inputs cast to dtype."""
    xs = [t.detach().to(dtype).requires_grad_(True) for t in tensors]
    out = fn(*xs, backend=backend)
    outs = out if isinstance(out, tuple) else (out,)
    g = torch.Generator().manual_seed(grads_seed)
    cots = [torch.randn(o.shape, generator=g, dtype=torch.float64).to(o.dtype) for o in outs]
    torch.autograd.backward(outs, cots)
    return [o.detach() for o in outs], [x.grad for x in xs]


def _heads_inner(t):
    """B×H×S×D over B×S×H×D memory: the layout of rope's outputs (torchfuser/ops/rope.py)."""
    return t.transpose(1, 2).is_contiguous()


def _check(fn, tensors, dtype, what, laid_out=torch.Tensor.is_contiguous):
    fused_o, fused_g = _run(fn, tensors, "mlir", dtype)
    same_o, same_g = _run(fn, tensors, "reference", dtype)
    ref_o, ref_g = _run(fn, tensors, "reference", torch.float64)
    for i, (a, b, r) in enumerate(zip(fused_o, same_o, ref_o)):
        assert a.dtype == b.dtype and a.shape == b.shape and laid_out(a), f"{what} out{i}: strides {a.stride()}"
        assert_within_rule(a, b, r, ATOL[dtype], f"{what} out{i} {dtype}")
    for i, (a, b, r) in enumerate(zip(fused_g, same_g, ref_g)):
        if r is None:
            continue
        assert a.dtype == b.dtype and a.shape == b.shape
        assert_within_rule(a, b, r, ATOL[dtype], f"{what} grad{i} {dtype}")


SHAPES = [(1, 64), (37, 123), (2, 5, 64)]
DTYPES = [torch.float32, torch.bfloat16]


def _ln(x, w, b, backend):
    return F.layer_norm(x, w, b, 1e-5, backend=backend)


def _rms(x, w, backend):
    return F.rms_norm(x, w, 1e-6, backend=backend)


def _rms_gemma(x, w, backend):
    return F.rms_norm(x, w, 1e-6, offset=1.0, backend=backend)


def _ln_nobias(x, w, backend):
    return F.layer_norm(x, w, None, 1e-5, backend=backend)


def _gelu_none(x, backend):
    return F.gelu(x, "none", backend=backend)


def _gelu_tanh(x, backend):
    return F.gelu(x, "tanh", backend=backend)


OPS = {
    "rms_norm": (_rms, "xw"),
    "rms_norm_gemma": (_rms_gemma, "xw"),
    "layer_norm": (_ln, "xwb"),
    "layer_norm_nobias": (_ln_nobias, "xw"),
    "swiglu": (F.swiglu, "xx"),
    "geglu": (F.geglu, "xx"),
    "geglu_erf": (lambda g, u, backend: F.geglu(g, u, approximate="none", backend=backend), "xx"),
    # one [gate | up] tensor: x's leading even number of channels
    "swiglu_packed": (lambda x, backend: F.swiglu(x[..., : x.shape[-1] // 2 * 2], backend=backend), "x"),
    "gelu": (_gelu_none, "x"),
    "gelu_tanh": (_gelu_tanh, "x"),
    "relu": (lambda x, backend: F.activation(x, "relu", backend=backend), "x"),
    "relu2": (lambda x, backend: F.activation(x, "relu2", backend=backend), "x"),
}


def _inputs(kinds, shape):
    h = shape[-1]
    return [torch.randn(shape, dtype=torch.float64) * (2 if k == "x" else 1) if k == "x" else torch.randn(h, dtype=torch.float64) for k in kinds]


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("shape", SHAPES, ids=str)
@pytest.mark.parametrize("op", list(OPS))
def test_op_forward_and_grads(op, shape, dtype):
    fn, kinds = OPS[op]
    _check(fn, _inputs(kinds, shape), dtype, op)


@pytest.mark.parametrize("op", ["rms_norm", "layer_norm", "swiglu", "gelu_tanh"])
def test_fp16(op):
    fn, kinds = OPS[op]
    _check(fn, _inputs(kinds, (37, 123)), torch.float16, op)


@pytest.mark.parametrize("op", ["rms_norm", "swiglu", "layer_norm"])
def test_non_contiguous_inputs(op):
    fn, kinds = OPS[op]
    h = 96
    base = torch.randn(41, 2 * h, dtype=torch.float64)
    # row-strided (a half of a fused projection) and a transposed (inner-strided) input
    xs = [base[:, :h] if k == "x" else torch.randn(h, dtype=torch.float64) for k in kinds]
    if kinds.count("x") > 1:
        xs[1] = torch.randn(h, 41, dtype=torch.float64).t()
    _check(fn, xs, torch.float32, f"{op} non-contiguous")


def test_hidden_8192():
    _check(_rms, _inputs("xw", (3, 8192)), torch.float32, "rms_norm 8192")


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("cos_batch", [1, 2])
def test_rope(dtype, cos_batch):
    b, hq, hk, s, d = 2, 4, 2, 7, 16
    q, k = torch.randn(b, hq, s, d, dtype=torch.float64), torch.randn(b, hk, s, d, dtype=torch.float64)
    ang = torch.randn(cos_batch, s, d // 2, dtype=torch.float64).repeat(1, 1, 2)
    cos, sin = ang.cos(), ang.sin()

    def fn(q_, k_, backend):
        return F.rope(q_, k_, cos.to(q_.dtype), sin.to(q_.dtype), backend=backend)

    _check(fn, [q, k], dtype, "rope", _heads_inner)


def test_rope_non_contiguous_q():
    b, h, s, d = 1, 3, 5, 8
    qkv = torch.randn(b, s, 3, h, d, dtype=torch.float64)
    q, k = qkv[:, :, 0].transpose(1, 2), qkv[:, :, 1].transpose(1, 2)
    ang = torch.randn(1, s, d // 2, dtype=torch.float64).repeat(1, 1, 2)

    def fn(q_, k_, backend):
        return F.rope(q_, k_, ang.cos().to(q_.dtype), ang.sin().to(q_.dtype), backend=backend)

    _check(fn, [q, k], torch.float32, "rope strided", _heads_inner)


def test_linear_cross_entropy_runs_on_mlir():
    h, w = torch.randn(9, 16, requires_grad=True), torch.randn(33, 16, requires_grad=True)
    y = torch.randint(0, 33, (9,))
    a = F.linear_cross_entropy(h, w, y, backend="mlir")
    b = F.linear_cross_entropy(h, w, y, backend="reference")
    assert torch.allclose(a, b)


def test_float64_rejected():
    import torchfuser.backends.mlir as M

    with pytest.raises(TypeError, match="float64"):
        M.rms_norm_fwd(torch.randn(2, 8, dtype=torch.float64), torch.randn(8, dtype=torch.float64), 1e-6, 0.0)


def test_cache_hit_and_new_batch_without_recompiling(tmp_path, monkeypatch):
    from torchfuser.backends.mlir import cache

    monkeypatch.setenv("TORCHFUSER_CACHE_DIR", str(tmp_path))
    cache.clear_memory()
    w = torch.randn(80)
    F.rms_norm(torch.randn(4, 80), w, backend="mlir")
    compiles = cache.stats.compiles
    for n in (1, 7, 300):  # new batch sizes: same kernel
        F.rms_norm(torch.randn(n, 3, 80), w, backend="mlir")
    assert cache.stats.compiles == compiles
    # a fresh process-level cache: the kernel comes from disk, no recompiling
    cache.clear_memory()
    hits = cache.stats.hits_disk
    F.rms_norm(torch.randn(5, 80), w, backend="mlir")
    assert cache.stats.compiles == compiles and cache.stats.hits_disk == hits + 1
    assert any(f.endswith(".json") for f in os.listdir(os.path.join(str(tmp_path), "mlir")))


def test_cache_concurrent_threads(tmp_path, monkeypatch):
    from concurrent.futures import ThreadPoolExecutor

    from torchfuser.backends.mlir import cache

    monkeypatch.setenv("TORCHFUSER_CACHE_DIR", str(tmp_path))
    cache.clear_memory()
    before = cache.stats.compiles
    x, w = torch.randn(6, 72), torch.randn(72)
    with ThreadPoolExecutor(4) as pool:
        ys = list(pool.map(lambda _: F.rms_norm(x, w, backend="mlir"), range(4)))
    assert cache.stats.compiles == before + 1
    assert all(torch.equal(y, ys[0]) for y in ys)


def _rss_mb() -> float:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * resource.getpagesize() / 2**20


@pytest.mark.skipif(not os.path.exists("/proc/self/statm"), reason="needs /proc")
def test_memory_steady_over_1000_calls():
    x = torch.randn(64, 256, requires_grad=True)
    w = torch.randn(256, requires_grad=True)
    for _ in range(50):
        F.rms_norm(x, w, backend="mlir").sum().backward()
    gc.collect()
    start = _rss_mb()
    for _ in range(1000):
        F.rms_norm(x, w, backend="mlir").sum().backward()
    gc.collect()
    assert _rss_mb() - start < 20


def test_clear_error_without_torch_mlir(monkeypatch):
    import torchfuser.backends as backends

    monkeypatch.setattr(backends, "_has_module", lambda name: False if name == "torch_mlir" else importlib.util.find_spec(name) is not None)
    with pytest.raises(BackendUnavailable, match="torch-mlir is not installed"):
        resolve("mlir", "cpu")
    assert resolve("auto", "cpu") == "reference"
    assert "torch-mlir" in backends.auto_fallback_reason("cpu")


def test_stage_ir_is_printable():
    from torchfuser.backends.mlir import pipeline
    from torchfuser.backends.mlir.capture import ROW, ArgSpec, capture
    from torchfuser.backends.reference.gated import swiglu

    cap = capture("swiglu_fwd", swiglu, [ArgSpec(ROW, (32,), torch.float32)] * 2, 4)
    art = pipeline.compile_captured(cap, dump={"all"}, out=None)
    assert set(art.ir) >= {"capture", "import", "linalg", "fuse", "wrapper", "bufferize", "loops", "llvm"}
    assert "linalg.generic" in art.ir["linalg"] and "llvm.func @kernel" in art.ir["llvm"]


def test_compile_graph_dynamic_rows():
    from torch.fx.experimental.proxy_tensor import make_fx

    from torchfuser.backends.mlir import compile_graph

    def f(x, w):
        y = torch.sigmoid(x) * w
        return y, (x * y).sum(0)

    x, w = torch.randn(10, 32), torch.randn(32)
    run = compile_graph(make_fx(f)(x, w), [x, w], dynamic=True)
    for n in (1, 37):
        xn = torch.randn(n, 32)
        for a, b in zip(run(xn, w), f(xn, w)):
            assert a.shape == b.shape and torch.allclose(a, b, atol=1e-5)


@pytest.mark.parametrize("op", ["rms_norm", "layer_norm", "swiglu"])
def test_many_blocks_on_threads(op, monkeypatch):
    """Dynamic row blocks on 3 workers (tiny blocks): row outputs and summed weight gradients."""
    from torchfuser.backends.mlir import runner

    monkeypatch.setenv("TORCHFUSER_MLIR_THREADS", "3")
    monkeypatch.setattr(runner, "MIN_BLOCK_ELEMS", 64)
    monkeypatch.setattr(runner, "BLOCK_ELEMS", 7 * 96)
    plan = runner.plan(301, 96)
    assert plan.threads == 3 and plan.blocks == 3 * runner.MAX_BLOCKS_PER_THREAD
    fn, kinds = OPS[op]
    _check(fn, _inputs(kinds, (301, 96)), torch.float32, f"{op} threads")


def test_huge_page_outputs_are_plain_tensors():
    from torchfuser.backends.mlir import memory

    t = memory.empty((1024, 4096), torch.float32)
    assert t.is_contiguous() and t.shape == (1024, 4096) and t.storage_offset() == 0
    t.fill_(1.5)
    assert float(t.sum()) == 1.5 * t.numel()


def test_compile_graph_refuses_outputs_that_are_neither_per_row_nor_sums():
    """A broadcast input scaled (dim 0 ≠ rows, not a sum over rows) must raise, not come out wrong."""
    from torch.fx.experimental.proxy_tensor import make_fx

    from torchfuser.backends.mlir import compile_graph

    def f(a, b, s):
        return a * s, b * s

    args = (torch.randn(10, 16), torch.randn(40, 16), torch.randn(()))
    with pytest.raises(NotImplementedError, match="neither per-row nor a sum"):
        compile_graph(make_fx(f)(*args), args, dynamic=False)


def test_compile_graph_refuses_outputs_that_do_not_depend_on_the_rows():
    """Positions cast to float beside a per-row output (the graph transformers 5.17's Llama gives
    torch.compile): from zero examples the cast looked like a sum over rows, and the kernel then
    added it up once per row chunk (16× the positions). It must raise, not come out wrong."""
    from torch.fx.experimental.proxy_tensor import make_fx

    from torchfuser.backends.mlir import compile_graph

    def f(positions, ids):
        return positions + 0, ids.to(torch.float32)

    zeros = (torch.zeros(16, dtype=torch.long), torch.zeros(1, 1, 16, dtype=torch.long))
    with pytest.raises(NotImplementedError, match="neither per-row nor a sum"):
        compile_graph(make_fx(f)(*zeros), zeros, dynamic=False)


def _ulps(got: torch.Tensor, ref: torch.Tensor) -> torch.Tensor:
    """|got − ref| in f32 ulps of the float64 reference (of 2⁻¹²⁶ for results below that)."""
    scale = ref.abs().clamp_min(2.0**-126) * torch.finfo(torch.float32).eps
    return (got.double() - ref).abs() / scale


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_compile_graph_sin_cos_vectorised_polynomial(dtype):
    """sin/cos are compiled to mathlib's polynomial (not libm): within 2 ulps of float64 at every
    magnitude up to the bound, next to multiples of π/2 too; bf16 held to the docs/numerics.md rule."""
    import math

    from torch.fx.experimental.proxy_tensor import make_fx

    from torchfuser.backends.mlir import compile_graph
    from torchfuser.backends.mlir.mathlib import TRIG_BOUND

    def f(x, y):
        return torch.sin(x) * y, torch.cos(x) + y

    g = torch.Generator().manual_seed(0)
    cols = 256
    rows = [torch.randn(64, cols, generator=g)]
    for e in (2, 8, 16, 24, 29):
        rows.append((torch.rand(16, cols, generator=g) * 2 - 1) * 2.0**e)
    k = (torch.rand(64, cols, generator=g, dtype=torch.float64) * (TRIG_BOUND / 2)).floor() + 1
    rows.append((k * math.pi / 2).float())
    rows.append((torch.arange(1, 16 * cols + 1, dtype=torch.float64).view(16, cols) * math.pi / 2).float())
    x = torch.cat(rows).to(dtype)
    y = torch.randn(x.shape, generator=g).to(dtype)
    run = compile_graph(make_fx(f)(x, y), [x, y], dynamic=True)
    got = run(x, y)
    ref = f(x.double(), y.double())
    if dtype == torch.float32:
        sin_g, cos_g = run(x, torch.ones_like(y))[0], run(x, torch.zeros_like(y))[1]
        assert _ulps(sin_g, torch.sin(x.double())).max() <= 2
        assert _ulps(cos_g, torch.cos(x.double())).max() <= 2
    same = f(x, y)
    for a, b, r in zip(got, same, ref):
        assert_within_rule(a, b, r, ATOL[dtype], f"sin/cos {dtype}")


def test_compile_graph_sin_cos_beyond_the_bound_are_exact():
    """Arguments the polynomial's reduction cannot take (|x| ≥ TRIG_BOUND, inf, NaN) make the
    call fall back to ATen: the same values as torch, NaN where torch gives NaN, −0 kept."""
    from torch.fx.experimental.proxy_tensor import make_fx

    from torchfuser.backends.mlir import compile_graph
    from torchfuser.backends.mlir.mathlib import TRIG_BOUND

    def f(x):
        return torch.sin(x), torch.cos(2 * x)

    x = torch.randn(40, 64)
    run = compile_graph(make_fx(f)(x), [x], dynamic=True)
    x[0, :4] = torch.tensor([-0.0, float("nan"), float("inf"), -float("inf")])
    small = run(x)
    assert torch.signbit(small[0][0, 0]) and small[0][0, 1:4].isnan().all() and small[1][0, 1:4].isnan().all()
    for big in (TRIG_BOUND, 3e38, -2.0**40):
        xb = x.clone()
        xb[17, 5] = big
        for a, b in zip(run(xb), f(xb)):
            assert torch.equal(a.isnan(), b.isnan())
            assert torch.equal(torch.nan_to_num(a), torch.nan_to_num(b))
    # the cos argument 2x crosses the bound first: the count is per sin/cos argument
    xb = x.clone()
    xb[3, 3] = TRIG_BOUND * 0.75
    for a, b in zip(run(xb), f(xb)):
        assert torch.allclose(torch.nan_to_num(a), torch.nan_to_num(b), atol=1e-6)
        assert a[3, 3] == b[3, 3]
