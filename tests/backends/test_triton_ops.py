"""The Triton backend's kernels, run on the CPU by Triton's interpreter (TRITON_INTERPRET=1).

Every op, forward and every gradient, through the public API and the custom ops, in fp32 and
bf16 (fp16 where cheap), against the reference backend run on float64 inputs, with the
docs/numerics.md rule: max|fused − ref64| ≤ 2·max|torch_same_dtype − ref64| + atol.
Shapes stay small: the interpreter runs each Triton program as Python.
"""
from __future__ import annotations

import importlib
import os
import sys

import pytest
import torch
import torch.nn.functional as TF

import torchfuser.functional as F
from numerics import ATOL, assert_within_rule
from torchfuser.backends import BackendUnavailable

pytest.importorskip("triton")

_BACKEND = "torchfuser.backends.triton"
# On a CUDA machine the kernels are compiled and run on the GPU; elsewhere Triton interprets them.
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def _pop_modules(is_ours):
    return {m: sys.modules.pop(m) for m in [m for m in sys.modules if is_ours(m)]}


def _is_backend(m):
    return m == _BACKEND or m.startswith(_BACKEND + ".")


def _is_triton_python(m):
    # The C extension (triton._C) stays loaded: it cannot be imported twice, and does not care.
    return (m == "triton" or m.startswith("triton.")) and not m.startswith("triton._C")


@pytest.fixture(scope="module", autouse=True)
def interpreter():
    """The Triton backend module, interpreted on the CPU (TRITON_INTERPRET=1 for this module only).

    Triton picks interpreted vs compiled when a function is decorated, at import, and that
    includes its own library (tl.sum, ...). torch._dynamo imports triton, so triton may already
    be loaded in compiled mode: this module gets a fresh interpreted import of triton's Python
    modules and of the backend, and the originals are put back afterwards, so other tests (and
    the TRITON_INTERPRET check of the dispatch) see the process as it was.
    """
    import torchfuser.backends as backends

    if DEVICE == "cuda":
        yield importlib.import_module(_BACKEND)
        return
    old_env = os.environ.get("TRITON_INTERPRET")
    os.environ["TRITON_INTERPRET"] = "1"
    saved = {**_pop_modules(_is_triton_python), **_pop_modules(_is_backend)}
    saved_attr = backends.__dict__.pop("triton", None)
    try:
        yield importlib.import_module(_BACKEND)
    finally:
        _pop_modules(_is_triton_python)
        _pop_modules(_is_backend)
        sys.modules.update(saved)
        backends.__dict__.pop("triton", None)
        if saved_attr is not None:
            backends.triton = saved_attr
        if old_env is None:
            del os.environ["TRITON_INTERPRET"]
        else:
            os.environ["TRITON_INTERPRET"] = old_env


# ---------------------------------------------------------------- helpers

def _leaf(t, dtype, make=None):
    """t in dtype as a leaf; ``make`` turns it into the (possibly non-contiguous) tensor used."""
    leaf = t.detach().to(dtype).requires_grad_()
    return leaf if make is None else make(leaf)


def _check(op_fn, inputs, dtype, what, torch_fn=None, make=None, laid_out=torch.Tensor.is_contiguous):
    """Compare op_fn(backend='triton') with op_fn(backend='reference') in float64 (the oracle)
    and torch_fn (default: the reference backend) in ``dtype`` (the baseline). The op's outputs
    must satisfy ``laid_out`` (the layout its custom op's fake impl promises)."""
    make = make or {}

    def run(fn, dt):
        leaves = [_leaf(t, dt) if t.is_floating_point() else t for t in inputs]
        used = [make[i](t) if i in make else t for i, t in enumerate(leaves)]
        outs = fn(*used)  # gradients are taken w.r.t. the leaves, through the views
        outs = outs if isinstance(outs, tuple) else (outs,)
        gen = torch.Generator().manual_seed(1)
        cot = [torch.randn(o.shape, generator=gen).to(o.device, o.dtype) for o in outs]
        req = [t for t in leaves if isinstance(t, torch.Tensor) and t.requires_grad]
        return list(outs) + list(torch.autograd.grad(outs, req, cot)), len(outs)

    ref, _ = run(lambda *a: op_fn(*a, backend="reference"), torch.float64)
    same, _ = run(torch_fn or (lambda *a: op_fn(*a, backend="reference")), dtype)
    got, n_out = run(lambda *a: op_fn(*a, backend="triton"), dtype)
    for i, (g, s, r) in enumerate(zip(got, same, ref)):
        assert g.dtype == s.dtype, f"{what} output {i}: dtype {g.dtype} != {s.dtype}"
        # (gradients reach the leaves through autograd's view backward, in its layout)
        assert i >= n_out or laid_out(g), f"{what} output {i}: strides {g.stride()} not the promised layout"
        assert_within_rule(g, s, r, ATOL[g.dtype] * max(1.0, r.abs().max().item()), f"{what} output {i}")


def _rand(*shape, scale=1.0, shift=0.0):
    # Never zeros: zeros hide unwritten outputs and wrong indexing.
    return (torch.randn(*shape) * scale + shift).to(DEVICE)


# Non-contiguous views of a leaf of shape (M, N): a row-strided slice of a wider buffer and a
# transposed tensor (reshape copies).
def _row_strided(t):
    wide = torch.cat([t, t[..., :7].detach() * 0 + 3.0], dim=-1)
    return wide[..., : t.shape[-1]]


def _transposed(t):
    return t.transpose(0, 1).contiguous().transpose(0, 1)


LOW = [torch.float32, torch.bfloat16]
NORM_CASES = [  # (shape, dtypes, view)
    ((1, 64), LOW, None),
    ((37, 123), LOW + [torch.float16], None),
    ((2, 3, 96), LOW, None),
    ((37, 123), LOW, _row_strided),
    ((37, 123), [torch.bfloat16], _transposed),
    ((2, 8192), [torch.bfloat16], None),  # largest one-pass row
    ((3, 20000), LOW, None),  # past MAX_FUSED: the chunked two-pass path
]


def _norm_params():
    for shape, dtypes, view in NORM_CASES:
        for dt in dtypes:
            yield pytest.param(shape, dt, view, id=f"{'x'.join(map(str, shape))}-{str(dt)[6:]}-{getattr(view, '__name__', 'dense')}")


# ---------------------------------------------------------------- norms

@pytest.mark.parametrize("shape,dtype,view", list(_norm_params()))
def test_rms_norm(shape, dtype, view):
    offset = 1.0 if shape[-1] == 123 else 0.0
    fn = lambda x, w, backend: F.rms_norm(x, w, 1e-6, offset=offset, backend=backend)  # noqa: E731
    make = {0: view} if view else None
    _check(fn, [_rand(*shape), _rand(shape[-1])], dtype, f"rms_norm{shape}", make=make)


@pytest.mark.parametrize("shape,dtype,view", list(_norm_params()))
@pytest.mark.parametrize("bias", [True, False], ids=["bias", "nobias"])
def test_layer_norm(shape, dtype, view, bias):
    inputs = [_rand(*shape, shift=0.5), _rand(shape[-1])] + ([_rand(shape[-1])] if bias else [])
    fn = lambda x, w, *b, backend: F.layer_norm(x, w, b[0] if b else None, 1e-5, backend=backend)  # noqa: E731
    make = {0: view} if view else None
    _check(fn, inputs, dtype, f"layer_norm{shape}", make=make)


def test_norm_statistics(interpreter):
    """rstd / mean of the kernels (fp32, one per row) against the reference's."""
    from torchfuser.backends import reference as R

    x, w, b = _rand(37, 123).bfloat16(), _rand(123).bfloat16(), _rand(123).bfloat16()
    _, rstd = interpreter.rms_norm_fwd(x, w, 1e-6, 0.0)
    _, rstd64 = R.rms_norm_fwd(x.double(), w.double(), 1e-6, 0.0)
    assert rstd.dtype == torch.float32 and rstd.shape == (37,)
    torch.testing.assert_close(rstd.double(), rstd64, rtol=1e-5, atol=0)
    _, mean, rstd = interpreter.layer_norm_fwd(x, w, b, 1e-5)
    _, mean64, rstd64 = R.layer_norm_fwd(x.double(), w.double(), b.double(), 1e-5)
    torch.testing.assert_close(mean.double(), mean64, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(rstd.double(), rstd64, rtol=1e-5, atol=0)


@pytest.mark.parametrize("op", ["rms_norm", "layer_norm"])
def test_norm_backward_pipelined_loop(op, interpreter, monkeypatch):
    """The software-pipelined row-tile loop (taken on a GPU from 64 tiles a program on) gives the
    same results; here every shape takes it."""
    monkeypatch.setattr(interpreter._common, "_MIN_TILES_TO_PIPELINE", 1)
    assert interpreter._common.bwd_stages(1, 1, 128, 2) > 1
    if op == "rms_norm":
        fn = lambda x, w, backend: F.rms_norm(x, w, 1e-6, backend=backend)  # noqa: E731
        inputs = [_rand(37, 96), _rand(96)]
    else:
        fn = lambda x, w, b, backend: F.layer_norm(x, w, b, 1e-5, backend=backend)  # noqa: E731
        inputs = [_rand(37, 96, shift=0.5), _rand(96), _rand(96)]
    _check(fn, inputs, torch.bfloat16, f"{op} pipelined")


# ---------------------------------------------------------------- gated activations, gelu

# geglu_erf: exact (erf) GELU gating (Pixtral's vision MLP)
_GATED = {"swiglu": F.swiglu, "geglu": F.geglu,
          "geglu_erf": lambda *t, backend: F.geglu(*t, approximate="none", backend=backend)}
GATED_CASES = [((1, 64), LOW), ((37, 123), LOW + [torch.float16]), ((2, 3, 96), [torch.bfloat16])]


@pytest.mark.parametrize("op", ["swiglu", "geglu", "geglu_erf"])
@pytest.mark.parametrize("shape,dtype", [(s, d) for s, ds in GATED_CASES for d in ds])
def test_gated(op, shape, dtype):
    fn = lambda g, u, backend: _GATED[op](g, u, backend=backend)  # noqa: E731
    _check(fn, [_rand(*shape, scale=2.0), _rand(*shape)], dtype, f"{op}{shape}")


@pytest.mark.parametrize("op", ["swiglu", "geglu", "geglu_erf"])
@pytest.mark.parametrize("dtype", LOW)
def test_gated_halves_of_fused_projection(op, dtype):
    """gate and up as the two row-strided halves of one gate_up output: read without copies."""
    fn = lambda gu, backend: _GATED[op](*gu.chunk(2, dim=-1), backend=backend)  # noqa: E731
    _check(fn, [_rand(37, 246, scale=2.0)], dtype, f"{op} chunked")


# one row (walked flat), odd halves, leading dims, halves of 8192
PACKED_CASES = [((1, 128), LOW), ((37, 246), LOW + [torch.float16]), ((2, 3, 192), LOW), ((2, 16384), [torch.bfloat16])]


@pytest.mark.parametrize("op", ["swiglu", "geglu", "geglu_erf"])
@pytest.mark.parametrize("shape,dtype", [(s, d) for s, ds in PACKED_CASES for d in ds], ids=str)
def test_gated_packed(op, shape, dtype):
    """up=None: one [gate | up] tensor in, one [dgate | dup] gradient out (no concatenation)."""
    fn = lambda gu, backend: _GATED[op](gu, backend=backend)  # noqa: E731
    _check(fn, [_rand(*shape, scale=2.0)], dtype, f"{op} packed{shape}")


def test_gated_packed_of_a_strided_tensor():
    fn = lambda gu, backend: F.swiglu(gu, backend=backend)  # noqa: E731
    _check(fn, [_rand(37, 246, scale=2.0)], torch.bfloat16, "swiglu packed transposed", make={0: _transposed})


@pytest.mark.parametrize("approximate", ["none", "tanh"])
@pytest.mark.parametrize("dtype", LOW + [torch.float16])
def test_gelu(approximate, dtype):
    fn = lambda x, backend: F.gelu(x, approximate, backend=backend)  # noqa: E731
    _check(fn, [_rand(37, 123, scale=3.0)], dtype, f"gelu-{approximate}")


@pytest.mark.parametrize("approximate", ["none", "tanh"])
def test_gelu_non_contiguous(approximate):
    fn = lambda x, backend: F.gelu(x, approximate, backend=backend)  # noqa: E731
    _check(fn, [_rand(37, 123, scale=3.0)], torch.bfloat16, "gelu transposed", make={0: _transposed})


@pytest.mark.parametrize("kind", ["relu", "relu2"])
@pytest.mark.parametrize("dtype", LOW + [torch.float16])
def test_activation(kind, dtype):
    fn = lambda x, backend: F.activation(x, kind, backend=backend)  # noqa: E731
    _check(fn, [_rand(37, 123, scale=3.0)], dtype, f"activation-{kind}")


@pytest.mark.parametrize("kind", ["relu", "relu2"])
def test_activation_non_contiguous(kind):
    fn = lambda x, backend: F.activation(x, kind, backend=backend)  # noqa: E731
    _check(fn, [_rand(37, 123, scale=3.0)], torch.bfloat16, f"activation-{kind} transposed", make={0: _transposed})
    _check(fn, [_rand(5, 64, scale=3.0)], torch.float32, f"activation-{kind} row-strided", make={0: _row_strided})


# ---------------------------------------------------------------- rope

def _heads_inner(t):
    """B×H×S×D over B×S×H×D memory: the layout of rope's outputs (torchfuser/ops/rope.py)."""
    return t.transpose(1, 2).is_contiguous()


ROPE_CASES = [  # (B, Hq, Hk, S, D, cos batch, q from a transpose)
    (1, 1, 1, 1, 16, 1, False),
    (2, 4, 2, 5, 16, 1, True),
    (2, 3, 1, 7, 12, 2, True),  # head-dim half 6: not a power of two
    (1, 6, 6, 37, 32, 1, False),
]


@pytest.mark.parametrize("case", ROPE_CASES, ids=lambda c: "B{}Hq{}Hk{}S{}D{}cos{}{}".format(*c[:6], "T" if c[6] else ""))
@pytest.mark.parametrize("dtype", LOW)
def test_rope(case, dtype):
    b, hq, hk, s, d, cb, transposed = case
    cos, sin = _rand(cb, s, d), _rand(cb, s, d)
    if transposed:  # B×S×H×D projections viewed as B×H×S×D, as attention modules do
        q, k = _rand(b, s, hq, d), _rand(b, s, hk, d)
        make = {0: lambda t: t.transpose(1, 2), 1: lambda t: t.transpose(1, 2)}
    else:
        q, k, make = _rand(b, hq, s, d), _rand(b, hk, s, d), None
    fn = lambda q, k, backend: F.rope(q, k, cos.to(q.dtype), sin.to(q.dtype), backend=backend)  # noqa: E731
    _check(fn, [q, k], dtype, f"rope{case}", make=make, laid_out=_heads_inner)


@pytest.mark.parametrize("backend", ["reference", "mlir", "triton"])
def test_rope_outputs_and_grads_heads_inner(interpreter, backend, request):
    """Attention's path: B×S×H×D projections viewed as B×H×S×D → rope → gradients as SDPA gives
    them (B×H×S×D views of B×S×H×D memory) or contiguous. Outputs and the projections' gradients
    stay B×S×H×D in memory, so neither attention's output nor dq/dk is copied back."""
    if backend == "mlir":
        pytest.importorskip("torch_mlir")
        request.getfixturevalue("mlir_tmp_cache")
    device = "cpu" if backend == "mlir" else DEVICE
    dtype = torch.float64 if backend == "reference" else torch.float32
    b, s, hq, hk, d = 2, 5, 4, 2, 12
    gen = torch.Generator().manual_seed(3)
    proj = [torch.randn(b, s, h, d, generator=gen, dtype=torch.float64) for h in (hq, hk)]
    angle = torch.randn(1, s, d // 2, generator=gen, dtype=torch.float64).repeat(1, 1, 2)
    cots = [torch.randn(b, s, h, d, generator=gen, dtype=torch.float64).transpose(1, 2) for h in (hq, hk)]

    def run(backend, dtype, cots):
        q, k = (p.to(device, dtype).requires_grad_() for p in proj)
        cos, sin = angle.cos().to(device, dtype), angle.sin().to(device, dtype)
        outs = F.rope(q.transpose(1, 2), k.transpose(1, 2), cos, sin, backend=backend)
        return outs, torch.autograd.grad(outs, (q, k), [c.to(device, dtype) for c in cots])

    for given in (cots, [c.contiguous() for c in cots]):  # as SDPA gives them, then contiguous
        outs, grads = run(backend, dtype, given)
        want_outs, want_grads = run("reference", torch.float64, given)
        # The projections' gradients are B×S×H×D: contiguous exactly when rope_bwd's were heads-inner.
        for got, want, laid_out in ((outs, want_outs, _heads_inner), (grads, want_grads, torch.Tensor.is_contiguous)):
            for g, w in zip(got, want):
                assert laid_out(g), f"{backend}: strides {g.stride()}, shape {tuple(g.shape)}"
                torch.testing.assert_close(g.double(), w, rtol=1e-5, atol=1e-5)



def test_rope_backward_hands_strided_gradients_to_the_backend(monkeypatch):
    """SDPA's dq/dk reach the backend's rope_bwd as they are (no copy in the ops layer)."""
    from torchfuser import backends

    seen, real = [], backends.kernel("reference", "rope_bwd")

    def spy(dq, dk, *rest):
        seen.append((dq.stride(), dk.stride()))
        return real(dq, dk, *rest)

    monkeypatch.setitem(backends._KERNELS, ("reference", "rope_bwd"), spy)
    q, k = (torch.randn(2, 5, h, 8, requires_grad=True) for h in (4, 2))
    cos, sin = torch.randn(1, 5, 8), torch.randn(1, 5, 8)
    qo, ko = F.rope(q.transpose(1, 2), k.transpose(1, 2), cos, sin, backend="reference")
    cots = [torch.randn(2, 5, h, 8).transpose(1, 2) for h in (4, 2)]
    torch.autograd.backward([qo, ko], cots)
    assert seen == [(cots[0].stride(), cots[1].stride())]


# ---------------------------------------------------------------- linear + cross-entropy

def _plain_lce(reduction, softcap, ignore_index=-100):
    """What a PyTorch program would run in the same dtype: nn.Linear then F.cross_entropy. The
    reference backend upcasts the matrix products to fp32 (it is the oracle), so it is no
    baseline for the error of a bf16 matrix product; this is."""

    def fn(h, w, labels, bias=None):
        logits = TF.linear(h, w, bias)
        if softcap is not None:
            logits = torch.tanh(logits / softcap) * softcap
        return TF.cross_entropy(logits.float(), labels, ignore_index=ignore_index, reduction=reduction)

    return fn


LCE_CASES = [  # (N, H, V, bias, softcap, reduction, chunk rows or None, CE kernel block or None)
    (1, 64, 123, False, None, "mean", None, None),
    (37, 64, 123, False, None, "mean", None, None),
    (37, 64, 123, True, 5.0, "sum", None, None),
    (37, 48, 300, True, None, "mean", 8, None),  # several chunks: dW accumulates across them
    (37, 64, 123, False, 3.0, "mean", 16, None),
    # rows in several blocks, the last one partly masked (both passes walk them, the second backwards)
    (37, 48, 300, True, None, "mean", 8, 64),
    (37, 64, 123, False, 3.0, "sum", None, 32),
]


@pytest.mark.parametrize("case", LCE_CASES, ids=lambda c: "N{}H{}V{}-bias{}-cap{}-{}-chunk{}-block{}".format(*c))
@pytest.mark.parametrize("dtype", LOW)
def test_linear_cross_entropy(case, dtype, interpreter, monkeypatch):
    n, h, v, bias, softcap, reduction, chunk, block = case
    if block is not None:
        monkeypatch.setattr(interpreter.linear_cross_entropy, "_BLOCK_V", block)
    if chunk is not None:
        itemsize, module = torch.finfo(dtype).bits // 8, interpreter.linear_cross_entropy
        monkeypatch.setattr(module, "EXTRA_BYTES", 0)
        monkeypatch.setattr(module, "DW_CHUNK_RATIO", 0)  # chunks smaller than dW: several, to test their sum
        monkeypatch.setattr(module, "MIN_CHUNK_BYTES", chunk * (v * itemsize + (4 + itemsize) * h))
        assert module.chunk_rows(n, v, itemsize, 1 << 20, h) == chunk
    labels = torch.randint(0, v, (n,)).to(DEVICE)
    if n > 1:
        labels[::5] = -100  # ignored tokens: no loss, no gradient, not counted by 'mean'
    inputs = [_rand(n, h), _rand(v, h, scale=h**-0.5 * 2)] + ([_rand(v, scale=0.5)] if bias else [])

    def fn(hid, w, *b, backend):
        return F.linear_cross_entropy(hid, w, labels, bias=b[0] if b else None, reduction=reduction,
                                      softcap=softcap, backend=backend)

    plain = _plain_lce(reduction, softcap)
    _check(fn, inputs, dtype, f"lce{case}", torch_fn=lambda hid, w, *b: plain(hid, w, labels, *b))


@pytest.mark.parametrize("dtype", LOW + [torch.float16])
@pytest.mark.parametrize("through", ["bias", "weight"])
def test_linear_cross_entropy_row_max_far_past_the_first_block(through, dtype, interpreter, monkeypatch):
    """Column 250 of 300 sits 40–60 nats above every other logit, far past the first block's max
    (blocks of 64): the kernel raises its reference and rescales what it has written of the row.
    Some tokens have it as their label (p_y ≈ 1: dl_y ≈ 0 must not cancel), some not, some ignored.
    (fp16 runs the two-pass form, whose running max is raised the same way.)"""
    monkeypatch.setattr(interpreter.linear_cross_entropy, "_BLOCK_V", 64)
    n, h, v, far = 37, 48, 300, 250
    labels = torch.randint(0, v, (n,))
    labels[::3], labels[::7] = far, -100
    hid, w = torch.randn(n, h), torch.randn(v, h) * h**-0.5
    bias = None
    if through == "bias":
        bias = torch.randn(v) * 0.5
        bias[far] = 50.0
    else:
        hid[:, 0] = 4.0 + torch.rand(n)
        w[far, 0] = 12.0
    inputs = [hid.to(DEVICE), w.to(DEVICE)] + ([bias.to(DEVICE)] if bias is not None else [])
    labels = labels.to(DEVICE)

    def fn(x, weight, *b, backend):
        return F.linear_cross_entropy(x, weight, labels, bias=b[0] if b else None, backend=backend)

    plain = _plain_lce("mean", None)
    _check(fn, inputs, dtype, f"lce far max {through}", torch_fn=lambda x, weight, *b: plain(x, weight, labels, *b))


def test_linear_cross_entropy_fp16_with_a_sum_of_exps_past_its_range(interpreter):
    """70000 near-equal logits: Σexp(z − max) ≈ 70000 > fp16's 65504, so in fp16 the kernel writes
    softmax − onehot itself (two passes) instead of the unnormalised q and the target's q_y − S."""
    n, h, v = 3, 16, 70000
    labels = torch.tensor([5, 69999, 40000]).to(DEVICE)
    inputs = [_rand(n, h), _rand(v, h, scale=1e-3)]

    def fn(hid, w, *, backend):
        return F.linear_cross_entropy(hid, w, labels, backend=backend)

    plain = _plain_lce("mean", None)
    _check(fn, inputs, torch.float16, "lce fp16 wide", torch_fn=lambda hid, w: plain(hid, w, labels))


def test_linear_cross_entropy_without_grad(interpreter):
    """need_grad=False: the loss alone, empty gradients, in the fake impl's shapes."""
    h, w = _rand(37, 64).bfloat16(), _rand(123, 64, scale=0.25).bfloat16()
    labels = torch.randint(0, 123, (37,)).to(DEVICE)
    loss, dh, dw, db = interpreter.linear_cross_entropy_fwd(h, w, None, labels, -100, None, "mean", False)
    assert loss.dtype == torch.float32 and loss.shape == ()
    assert dh.numel() == dw.numel() == db.numel() == 0
    ref = TF.cross_entropy(h.double() @ w.double().T, labels)
    assert_within_rule(loss, _plain_lce("mean", None)(h, w, labels), ref, ATOL[torch.float32], "lce loss only")
    with torch.no_grad():
        assert torch.equal(F.linear_cross_entropy(h, w, labels, backend="triton"), loss)


@pytest.mark.parametrize("dtype", LOW)
def test_linear_cross_entropy_scale(interpreter, dtype):
    """The backward's in-place scaling by dloss: g · s in fp32 with one rounding; a dloss of exactly
    1 leaves the gradients untouched (skipped on the device); a strided gradient is scaled too."""
    scale_ = interpreter.linear_cross_entropy.linear_cross_entropy_scale_
    grads = [_rand(37, 123).to(dtype), _rand(5000).float(), _rand(8, 16).to(dtype).t()]
    before = [g.clone() for g in grads]
    scale_(grads, torch.tensor(1.0, device=DEVICE))
    assert all(torch.equal(g, b) for g, b in zip(grads, before))
    s = torch.tensor(0.3712, device=DEVICE)
    scale_(grads, s)
    for g, b in zip(grads, before):  # one rounding of the fp32 product (the interpreter truncates)
        exact = b.float() * s
        torch.testing.assert_close(g.float(), exact, rtol=torch.finfo(b.dtype).eps, atol=0)


def test_linear_cross_entropy_backward_scales_with_the_backend_kernel(interpreter, monkeypatch):
    """The ops layer's backward scales the saved gradients with the Triton backend's own pass (which
    skips dloss == 1 on the device), not with PyTorch's broadcast `mul_` (0.6 ms a call on llama1b's
    dW on an H200: the run-47 profile found the fallback taken because the backend did not export it)."""
    calls = []
    real = interpreter.linear_cross_entropy_scale_
    monkeypatch.setattr(interpreter, "linear_cross_entropy_scale_", lambda grads, s: (calls.append(len(grads)), real(grads, s)))
    h = _rand(37, 64).bfloat16().requires_grad_()
    w = _rand(123, 64, scale=0.25).bfloat16().requires_grad_()
    labels = torch.randint(0, 123, (37,)).to(DEVICE)
    (2.5 * F.linear_cross_entropy(h, w, labels, backend="triton")).backward()
    assert calls == [2]
    h2, w2 = h.detach().clone().requires_grad_(), w.detach().clone().requires_grad_()
    F.linear_cross_entropy(h2, w2, labels, backend="triton").backward()
    torch.testing.assert_close(h.grad.float(), 2.5 * h2.grad.float(), rtol=1e-2, atol=0)
    torch.testing.assert_close(w.grad.float(), 2.5 * w2.grad.float(), rtol=1e-2, atol=0)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_linear_cross_entropy_second_backward_with_retain_graph_is_exact(interpreter, dtype):
    """retain_graph=True: the backend's in-place scaling runs on copies of the saved gradients, so a
    second backward reads them unchanged. The grads of 2·loss then loss: what one backward gives
    for 2 (an exact doubling) plus what it gives for 1, taken from a backward on a fresh forward."""
    h = _rand(37, 64).to(dtype).requires_grad_()
    w = _rand(123, 64, scale=0.25).to(dtype).requires_grad_()
    labels = torch.randint(0, 123, (37,)).to(DEVICE)
    loss = F.linear_cross_entropy(h, w, labels, backend="triton")
    (2 * loss).backward(retain_graph=True)
    first = [h.grad.clone(), w.grad.clone()]
    loss.backward()
    h2, w2 = h.detach().clone().requires_grad_(), w.detach().clone().requires_grad_()
    F.linear_cross_entropy(h2, w2, labels, backend="triton").backward()
    torch.testing.assert_close(first[0], 2 * h2.grad, rtol=0, atol=0)
    torch.testing.assert_close(first[1], 2 * w2.grad, rtol=0, atol=0)
    torch.testing.assert_close(h.grad, first[0] + h2.grad, rtol=0, atol=0)
    torch.testing.assert_close(w.grad, first[1] + w2.grad, rtol=0, atol=0)


def test_linear_cross_entropy_backward_traces_with_fake_tensors(interpreter):
    """The backward traced on fake tensors (make_fx; torch 2.11's AOTAutograd traces it so without
    `is_compiling()`) scales out of place instead of launching the backend's kernel on them:
    `torch.compile(optimize(model))` failed so on the H200 (run 53). The traced graph, run on real
    tensors, gives eager's gradients (to one rounding: the interpreter's casts truncate)."""
    from torch.fx.experimental.proxy_tensor import make_fx

    def loss_grads(h, w, labels):
        return torch.autograd.grad(2.5 * F.linear_cross_entropy(h, w, labels, backend="triton"), [h, w])

    h = _rand(37, 64).bfloat16().requires_grad_()
    w = _rand(123, 64, scale=0.25).bfloat16().requires_grad_()
    labels = torch.randint(0, 123, (37,)).to(DEVICE)
    traced = make_fx(loss_grads, tracing_mode="fake")(h, w, labels)
    assert any("linear_cross_entropy_fwd" in str(n.target) for n in traced.graph.nodes)
    for got, want in zip(traced(h, w, labels), loss_grads(h, w, labels)):
        torch.testing.assert_close(got, want, rtol=2 * torch.finfo(torch.bfloat16).eps, atol=0)


@pytest.mark.parametrize("n,most,sizes", [
    (8192, 1536, [1536] * 4 + [1024] * 2),  # not 5 × 1536 + a 512-token tail
    (8192, 2048, [2048] * 4),
    (8000, 1536, [1536] * 3 + [1024] * 2 + [1344]),
    (37, 8, [8, 8, 7, 7, 7]),
    (5, 8, [5]),
])
def test_linear_cross_entropy_chunks(interpreter, n, most, sizes):
    plan = interpreter.linear_cross_entropy.chunks(n, most)
    assert [size for _, size in plan] == sizes
    assert [start for start, _ in plan] == [sum(sizes[:i]) for i in range(len(sizes))]


# ---------------------------------------------------------------- contract with the ops layer

def _fake_vs_real(op, *args):
    """The kernels' outputs have exactly the fake impl's shapes, dtypes and strides (torch.compile
    plans the graph's memory from the fake impl's)."""
    real = op(*args, "triton")
    meta = [a.to("meta") if isinstance(a, torch.Tensor) else a for a in args]
    fake = op(*meta, "triton")
    for r, f in zip(real if isinstance(real, tuple) else (real,), fake if isinstance(fake, tuple) else (fake,)):
        assert (r.shape, r.dtype, r.stride()) == (f.shape, f.dtype, f.stride())


def test_outputs_match_fake_impls():
    ops = torch.ops.torchfuser
    x, w, b = _rand(2, 5, 96).bfloat16(), _rand(96).bfloat16(), _rand(96).bfloat16()
    y, rstd = ops.rms_norm_fwd(x, w, 1e-6, 0.0, None, "triton")
    _fake_vs_real(ops.rms_norm_fwd, x, w, 1e-6, 0.0, None)
    _fake_vs_real(ops.rms_norm_fwd, x, w.float(), 1e-6, 0.0, torch.float32)  # bf16 read, fp32 written
    _fake_vs_real(ops.rms_norm_bwd, y, x, w, rstd, 1e-6, 0.0)
    y, mean, rstd = ops.layer_norm_fwd(x, w, b, 1e-5, "triton")
    _fake_vs_real(ops.layer_norm_fwd, x, w, None, 1e-5)
    _fake_vs_real(ops.layer_norm_bwd, y, x, w, None, mean, rstd, 1e-5)
    _fake_vs_real(ops.layer_norm_bwd, y, x, w, b, mean, rstd, 1e-5)
    _fake_vs_real(ops.swiglu_bwd, x, x, y)
    gu = _rand(2, 5, 192).bfloat16()
    _fake_vs_real(ops.geglu_packed_fwd, gu)
    _fake_vs_real(ops.swiglu_packed_bwd, _rand(2, 5, 96).bfloat16(), gu)
    _fake_vs_real(ops.gelu_fwd, x, "tanh")
    q, k, cos = _rand(2, 4, 3, 16), _rand(2, 2, 3, 16), _rand(1, 3, 16)
    _fake_vs_real(ops.rope_fwd, q, k, cos, cos, None)
    _fake_vs_real(ops.rope_fwd, q, k, cos, cos, torch.bfloat16)  # fp32 read, bf16 written (attention under autocast)
    _fake_vs_real(ops.rope_fwd, _rand(2, 3, 4, 16).transpose(1, 2), k, cos, cos, None)
    _fake_vs_real(ops.rope_bwd, q, k, cos, cos, None)
    _fake_vs_real(ops.rope_bwd, *ops.rope_fwd(q, k, cos, cos, None, "triton"), cos, cos, None)  # as SDPA lays out dq, dk
    _fake_vs_real(ops.rope_bwd, q.bfloat16(), k.bfloat16(), cos, cos, torch.float32)
    h, wt, labels = _rand(7, 16), _rand(11, 16), torch.randint(0, 11, (7,)).to(DEVICE)
    for bias in (None, _rand(11)):
        for need_grad in (True, False):
            _fake_vs_real(ops.linear_cross_entropy_fwd, h, wt, bias, labels, -100, None, "mean", need_grad, None)


# ---------------------------------------------------------------- errors

def test_rejects_float64(interpreter):
    x = _rand(4, 8).double()
    with pytest.raises(TypeError, match="float64.*backend='reference'"):
        interpreter.rms_norm_fwd(x, _rand(8).double(), 1e-6, 0.0)
    with pytest.raises(TypeError, match="triton backend supports"):
        F.swiglu(x, x, backend="triton")
    with pytest.raises(TypeError, match="triton backend supports"):
        interpreter.linear_cross_entropy_fwd(x, x, None, torch.zeros(4, dtype=torch.long, device=DEVICE), -100, None, "mean", True)


def test_cpu_without_interpreter_is_a_clear_error(monkeypatch):
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)  # unset already on a GPU machine
    x = torch.randn(4, 8)
    with pytest.raises(BackendUnavailable, match="TRITON_INTERPRET=1"):
        F.rms_norm(x, torch.randn(8), backend="triton")
    with pytest.raises(BackendUnavailable, match="CUDA"):
        F.linear_cross_entropy(x, torch.randn(5, 8), torch.zeros(4, dtype=torch.long), backend="triton")


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])  # one-pass and two-pass forms
@pytest.mark.parametrize("bad", [123, 5000, -1])
def test_linear_cross_entropy_label_outside_the_vocabulary_gives_nan(interpreter, dtype, bad):
    """A label ≥ V or < 0 (not ignore_index) would read outside the row and give a finite loss; a
    host check would wait for the device, so the kernel makes that row's loss and gradients NaN.
    The other rows' gradients stay finite (a NaN scale touches only its row of dh)."""
    h, w = _rand(9, 64).to(dtype), _rand(123, 64, scale=0.25).to(dtype)
    labels = torch.randint(0, 123, (9,))
    labels[2], labels[5] = -100, bad
    loss, dh, dw, db = interpreter.linear_cross_entropy_fwd(h, w, None, labels.to(DEVICE), -100, None, "mean", True)
    assert torch.isnan(loss), loss
    assert torch.isnan(dh[5]).all() and torch.isfinite(dh[[0, 1, 2, 3, 4, 6, 7, 8]]).all()
    assert torch.isnan(dw).any()
    labels[5] = 7  # the same rows with the label in range: finite
    assert torch.isfinite(interpreter.linear_cross_entropy_fwd(h, w, None, labels.to(DEVICE), -100, None, "sum", False)[0])


def test_linear_cross_entropy_gemms_see_an_aligned_vocabulary(interpreter, monkeypatch):
    """A vocabulary whose logits rows are not a multiple of 16 bytes (GPT-2's 50257 tokens; here 101) runs
    its GEMMs over zero rows padded to 104: unaligned leading dimensions leave cuBLAS only its slow align-1
    kernels (GPT-2-medium's head: 20 ms a step on an H100 against 3 ms padded). Loss and gradients are
    checked against the float64 reference by test_linear_cross_entropy (V = 123, 300)."""
    n, h, v = 24, 32, 101
    hid, w = _rand(n, h).to(torch.bfloat16).requires_grad_(), _rand(v, h).to(torch.bfloat16).requires_grad_()
    labels = torch.randint(0, v, (n,)).to(DEVICE)
    seen, real = [], torch.mm

    def spy(a, b, *args, **kwargs):  # the leading dimension of each vocabulary-wide operand and of the result
        out = real(a, b, *args, **kwargs)
        seen.append([max(t.stride()) for t in (a, b, out) if t.dim() == 2 and (v in t.shape or v + 3 in t.shape)])
        return out

    monkeypatch.setattr(torch, "mm", spy)
    F.linear_cross_entropy(hid, w, labels, backend="triton").backward()
    monkeypatch.undo()
    assert seen and all(s % 8 == 0 for strides in seen for s in strides), seen
    assert w.grad.shape == (v, h) and torch.isfinite(w.grad).all()
