"""The functional API on the reference backend: forward and every gradient against float64
(plain PyTorch formulas), in fp32 / bf16 / fp16, and the input checks."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as TF

import torchfuser.functional as F
from numerics import ATOL, assert_within_rule, needs_mlir

DTYPES = [torch.float32, torch.bfloat16, torch.float16]
SHAPES = [(1, 64), (37, 123), (2, 3, 96), (4, 8192)]


def _grads(fn, inputs, seed=1):
    """Output and gradients of sum(out · g) for a fixed random g, for every input that requires grad."""
    out = fn(*inputs)
    outs = out if isinstance(out, tuple) else (out,)
    gen = torch.Generator().manual_seed(seed)
    cot = [torch.randn(o.shape, generator=gen).to(o.dtype) for o in outs]
    leaves = [t for t in inputs if isinstance(t, torch.Tensor) and t.requires_grad]
    grads = torch.autograd.grad(outs, leaves, cot)
    return list(outs) + list(grads)


def _leaf(t, dtype):
    return t.detach().to(dtype).requires_grad_()


def _check(fused_fn, torch_fn, inputs, dtype, what):
    ref = _grads(torch_fn, [_leaf(t, torch.float64) if t.is_floating_point() else t for t in inputs])
    same = _grads(torch_fn, [_leaf(t, dtype) if t.is_floating_point() else t for t in inputs])
    got = _grads(fused_fn, [_leaf(t, dtype) if t.is_floating_point() else t for t in inputs])
    for i, (g, s, r) in enumerate(zip(got, same, ref)):
        assert g.dtype == s.dtype, f"{what} output {i}: dtype {g.dtype} != {s.dtype}"
        assert_within_rule(g, s, r, ATOL[dtype] * max(1.0, r.abs().max().item()), f"{what} output {i}")


def _torch_rms(x, w, eps=1e-6, offset=0.0):
    xf = x.float() if x.dtype != torch.float64 else x
    y = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps) * (offset + w.to(xf.dtype))
    return y.to(x.dtype)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("offset", [0.0, 1.0])
def test_rms_norm(shape, dtype, offset):
    x, w = torch.randn(shape), torch.randn(shape[-1])
    fused = lambda x, w: F.rms_norm(x, w, 1e-6, offset=offset, backend="reference")
    _check(fused, lambda x, w: _torch_rms(x, w, 1e-6, offset), [x, w], dtype, f"rms_norm{shape}")


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("bias", [True, False])
def test_layer_norm(shape, dtype, bias):
    x, w, b = torch.randn(shape) + 0.3, torch.randn(shape[-1]), torch.randn(shape[-1]) if bias else None
    inputs = [x, w] + ([b] if bias else [])
    fused = lambda x, w, b=None: F.layer_norm(x, w, b, 1e-5, backend="reference")
    plain = lambda x, w, b=None: TF.layer_norm(x, x.shape[-1:], w, b, 1e-5)
    _check(fused, plain, inputs, dtype, f"layer_norm{shape}")


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("op", ["swiglu", "geglu"])
def test_gated(shape, dtype, op):
    gate, up = torch.randn(shape) * 2, torch.randn(shape)
    act = TF.silu if op == "swiglu" else (lambda t: TF.gelu(t, approximate="tanh"))
    fused = lambda g, u: getattr(F, op)(g, u, backend="reference")
    _check(fused, lambda g, u: act(g) * u, [gate, up], dtype, f"{op}{shape}")


@pytest.mark.parametrize("op", ["swiglu", "geglu"])
def test_gated_packed_is_the_halves(op):
    gu = (torch.randn(3, 5, 64) * 2).requires_grad_()
    packed = getattr(F, op)(gu, backend="reference")
    gu2 = gu.detach().clone().requires_grad_()
    halves = getattr(F, op)(*gu2.chunk(2, dim=-1), backend="reference")
    torch.testing.assert_close(packed, halves)
    cot = torch.randn_like(packed)
    packed.backward(cot)
    halves.backward(cot)
    torch.testing.assert_close(gu.grad, gu2.grad)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("approximate", ["none", "tanh"])
def test_gelu(dtype, approximate):
    x = torch.randn(37, 123) * 3
    fused = lambda t: F.gelu(t, approximate, backend="reference")
    _check(fused, lambda t: TF.gelu(t, approximate=approximate), [x], dtype, "gelu")


def _torch_rope(q, k, cos, sin):
    rot = lambda t: torch.cat((-t[..., t.shape[-1] // 2:], t[..., : t.shape[-1] // 2]), -1)
    c, s = cos.unsqueeze(1).to(q.dtype), sin.unsqueeze(1).to(q.dtype)
    return q * c + rot(q) * s, k * c + rot(k) * s


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("b,hq,hk,s,d,cos_batch", [(1, 1, 1, 1, 2, 1), (2, 4, 2, 7, 16, 2), (2, 6, 2, 37, 64, 1)])
def test_rope(dtype, b, hq, hk, s, d, cos_batch):
    q, k = torch.randn(b, hq, s, d), torch.randn(b, hk, s, d)
    angle = torch.rand(cos_batch, s, d // 2) * 6
    angle = torch.cat((angle, angle), -1)
    cos, sin = angle.cos().to(dtype), angle.sin().to(dtype)
    fused = lambda q, k: F.rope(q, k, cos, sin, backend="reference")
    _check(fused, lambda q, k: _torch_rope(q, k, cos.double(), sin.double()), [q, k], dtype, "rope")


def test_rope_non_contiguous():
    qkv = torch.randn(2, 5, 3, 4, 8)  # B×S×3×H×D, as a fused projection would give
    q, k = qkv[:, :, 0].transpose(1, 2), qkv[:, :, 1].transpose(1, 2)
    angle = torch.rand(1, 5, 8)
    got = F.rope(q, k, angle.cos(), angle.sin(), backend="reference")
    want = _torch_rope(q, k, angle.cos(), angle.sin())
    for g, w in zip(got, want):
        torch.testing.assert_close(g, w)


def _torch_lce(h, w, labels, b=None, softcap=None, reduction="mean", ignore_index=-100):
    logits = (h @ w.T + (0 if b is None else b)).float() if h.dtype != torch.float64 else h @ w.T + (0 if b is None else b)
    if softcap is not None:
        logits = torch.tanh(logits / softcap) * softcap
    return TF.cross_entropy(logits, labels, ignore_index=ignore_index, reduction=reduction)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("bias,softcap,reduction", [(False, None, "mean"), (True, 5.0, "sum"), (False, 30.0, "mean")])
def test_linear_cross_entropy(dtype, bias, softcap, reduction):
    n, h, v = 37, 48, 123
    hid, w = torch.randn(n, h), torch.randn(v, h) / h**0.5
    labels = torch.randint(0, v, (n,))
    labels[::5] = -100
    b = torch.randn(v) if bias else None
    inputs = [hid, w] + ([b] if bias else [])

    def fused(hid, w, b=None):
        return F.linear_cross_entropy(hid, w, labels, bias=b, softcap=softcap, reduction=reduction, backend="reference")

    def plain(hid, w, b=None):
        return _torch_lce(hid, w, labels, b, softcap, reduction)

    _check(fused, plain, inputs, dtype, "linear_cross_entropy")


@pytest.mark.parametrize("backend", ["reference", pytest.param("mlir", marks=needs_mlir)])
def test_implementations_do_not_see_autocast(backend):
    """Under autocast an op casts its inputs as its functional says, and its implementation then
    runs on those dtypes with autocast off (as in compiled graphs): the same result as the call on
    pre-cast inputs outside autocast, to the bit, forward and gradients."""
    hid, w = torch.randn(37, 48), torch.randn(123, 48) / 48**0.5
    labels = torch.randint(0, 123, (37,))
    results = []
    for under_autocast in (True, False):
        h = hid.clone().requires_grad_() if under_autocast else hid.bfloat16().requires_grad_()
        ww = w.clone().requires_grad_() if under_autocast else w.bfloat16().requires_grad_()
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=under_autocast):
            loss = F.linear_cross_entropy(h, ww, labels, backend=backend)
            y = F.rms_norm(h.bfloat16(), ww[0].bfloat16(), backend=backend)
        (loss + y.float().square().mean()).backward()
        results.append([loss, y, h.grad.bfloat16(), ww.grad.bfloat16()])
    for a, b in zip(*results):
        assert torch.equal(a, b)


def test_linear_cross_entropy_leading_dims_and_autocast():
    hid, w = torch.randn(2, 5, 16, requires_grad=True), torch.randn(30, 16, requires_grad=True)
    labels = torch.randint(0, 30, (2, 5))
    with torch.autocast("cpu", dtype=torch.bfloat16):
        loss = F.linear_cross_entropy(hid, w, labels, backend="reference")
        ref = TF.cross_entropy((hid @ w.T).reshape(10, 30).float(), labels.reshape(10))
    assert loss.dtype == torch.float32
    torch.testing.assert_close(loss, ref, rtol=2e-2, atol=2e-2)
    loss.backward()
    assert hid.grad.dtype == torch.float32 and w.grad.dtype == torch.float32


def test_nan_propagates():
    x = torch.randn(3, 8)
    x[1, 2] = float("nan")
    y = F.rms_norm(x, torch.ones(8), backend="reference")
    assert torch.isnan(y[1]).all() and torch.isfinite(y[[0, 2]]).all()


@pytest.mark.parametrize(
    "call, error, words",
    [
        (lambda: F.rms_norm(torch.randn(2, 8), torch.randn(7)), ValueError, "shape (8,)"),
        (lambda: F.rms_norm(torch.randint(0, 3, (2, 8)), torch.randn(8)), TypeError, "int64"),
        (lambda: F.rms_norm([1.0], torch.randn(8)), TypeError, "torch.Tensor"),
        (lambda: F.swiglu(torch.randn(2, 8), torch.randn(2, 9)), ValueError, "same shape"),
        (lambda: F.geglu(torch.randn(2, 7)), ValueError, "must be even"),
        (lambda: F.swiglu(torch.randn(2, 8), torch.randn(2, 8).half()), TypeError, "same dtype"),
        (lambda: F.rope(torch.randn(1, 2, 3, 4), torch.randn(1, 2, 3, 4), torch.randn(1, 3, 6), torch.randn(1, 3, 6)), ValueError, "cos and sin"),
        (lambda: F.rope(torch.randn(2, 3, 4), torch.randn(1, 2, 3, 4), torch.randn(1, 3, 4), torch.randn(1, 3, 4)), ValueError, "4-D"),
        (lambda: F.linear_cross_entropy(torch.randn(4, 8), torch.randn(10, 8), torch.randint(0, 10, (5,))), ValueError, "labels must have shape"),
        (lambda: F.linear_cross_entropy(torch.randn(4, 8), torch.randn(10, 8), torch.randn(4)), TypeError, "int64"),
        (lambda: F.linear_cross_entropy(torch.randn(4, 8), torch.randn(10, 8), torch.randint(0, 10, (4,)), reduction="none"), ValueError, "'mean' or 'sum'"),
        (lambda: F.gelu(torch.randn(3), "fast"), ValueError, "approximate"),
        (lambda: F.rms_norm(torch.randn(2, 8), torch.randn(8), backend="cuda"), ValueError, "valid backends"),
    ],
)
def test_bad_input_says_what_and_why(call, error, words):
    with pytest.raises(error, match=None) as info:
        call()
    assert words in str(info.value)


def test_rope_refuses_differentiable_cos():
    q = torch.randn(1, 1, 2, 4)
    cos = torch.randn(1, 2, 4, requires_grad=True)
    with pytest.raises(ValueError, match="detach"):
        F.rope(q, q, cos, cos)


def test_compile_fullgraph_reference_ops():
    def block(x, w, gate, up):
        return F.rms_norm(x, w, backend="reference") * F.swiglu(gate, up, backend="reference")

    args = [torch.randn(4, 16, requires_grad=True) for _ in range(4)]
    args[1] = torch.randn(16, requires_grad=True)
    compiled = torch.compile(block, fullgraph=True, backend="aot_eager")
    out = compiled(*args)
    torch.testing.assert_close(out, block(*args))
    (g,) = torch.autograd.grad(out.sum(), args[0])
    (g_ref,) = torch.autograd.grad(block(*args).sum(), args[0])
    torch.testing.assert_close(g, g_ref)


def test_works_under_saved_tensor_hooks():
    """Activation offloading and memory accounting register saved-tensor hooks; the ops still run."""
    x, w = torch.randn(4, 16, requires_grad=True), torch.randn(16, requires_grad=True)
    h, W, labels = torch.randn(6, 16, requires_grad=True), torch.randn(20, 16, requires_grad=True), torch.randint(0, 20, (6,))
    packed = []
    with torch.autograd.graph.saved_tensors_hooks(lambda t: packed.append(t) or t, lambda t: t):
        y = F.rms_norm(x, w, backend="reference")
        loss = F.linear_cross_entropy(h, W, labels, backend="reference") + y.square().mean()
    loss.backward()
    assert packed and x.grad is not None and W.grad is not None
    (g,) = torch.autograd.grad(_torch_rms(x, w).square().mean(), x)
    torch.testing.assert_close(x.grad, g)


@pytest.mark.parametrize("bias", [False, True])
def test_linear_cross_entropy_second_backward_with_retain_graph_is_exact(bias):
    """retain_graph=True: that backward scales copies of the gradients saved in the forward, so a
    second backward reads them unchanged (gradients of 2·loss + loss)."""
    g = torch.Generator().manual_seed(5)
    hid, w = torch.randn(5, 8, generator=g, requires_grad=True), torch.randn(11, 8, generator=g, requires_grad=True)
    b = torch.randn(11, generator=g, requires_grad=True) if bias else None
    labels = torch.randint(0, 11, (5,), generator=g)
    loss = F.linear_cross_entropy(hid, w, labels, bias=b, backend="reference")
    (2 * loss).backward(retain_graph=True)
    loss.backward()
    params = [hid, w] + ([b] if bias else [])
    ref = [p.detach().double().requires_grad_() for p in params]
    logits = ref[0] @ ref[1].T + (ref[2] if bias else 0)
    want = torch.autograd.grad(3 * torch.nn.functional.cross_entropy(logits, labels), ref)
    for p, r in zip(params, want):
        torch.testing.assert_close(p.grad.double(), r, rtol=1e-5, atol=1e-6)


def test_linear_cross_entropy_second_backward_without_retain_graph_says_why():
    hid, w = torch.randn(5, 8, requires_grad=True), torch.randn(11, 8, requires_grad=True)
    loss = F.linear_cross_entropy(hid, w, torch.randint(0, 11, (5,)), backend="reference")
    loss.backward()
    with pytest.raises(RuntimeError, match=r"fused LM head \+ loss.*retain_graph=True.*exclude=\['lm_head_loss'\]"):
        loss.backward()
