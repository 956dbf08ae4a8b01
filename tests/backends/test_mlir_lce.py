"""linear_cross_entropy on the mlir backend (chunked matmuls + MLIR-fused head) against float64."""
from __future__ import annotations


import pytest
import torch

pytest.importorskip("torch_mlir")

from numerics import ATOL, assert_within_rule  # noqa: E402

import torchfuser.functional as F  # noqa: E402


pytestmark = pytest.mark.usefixtures("mlir_tmp_cache")


def _run(h, w, b, y, dtype, backend, **kw):
    xs = [None if t is None else t.detach().to(dtype).requires_grad_(True) for t in (h, w, b)]
    loss = F.linear_cross_entropy(xs[0], xs[1], y, bias=xs[2], backend=backend, **kw)
    loss.backward(torch.tensor(1.5))   # a non-unit upstream gradient: the backward is a scale
    return loss.detach(), [None if x is None else x.grad for x in xs]


def _check(h, w, b, y, dtype, **kw):
    got, got_g = _run(h, w, b, y, dtype, "mlir", **kw)
    same, same_g = _run(h, w, b, y, dtype, "reference", **kw)
    ref, ref_g = _run(h, w, b, y, torch.float64, "reference", **kw)
    assert got.dtype == torch.float32 and got.shape == ()
    assert_within_rule(got, same, ref, ATOL[dtype], f"loss {dtype} {kw}")
    for i, (a, s, r) in enumerate(zip(got_g, same_g, ref_g)):
        if r is None:
            continue
        assert a.dtype == s.dtype and a.shape == s.shape
        assert_within_rule(a, s, r, ATOL[dtype], f"grad{i} {dtype} {kw}")


def _data(n, hid, vocab, bias, seed=0):
    g = torch.Generator().manual_seed(seed)
    h = torch.randn(n, hid, generator=g, dtype=torch.float64)
    w = torch.randn(vocab, hid, generator=g, dtype=torch.float64) / hid**0.5
    b = torch.randn(vocab, generator=g, dtype=torch.float64) if bias else None
    y = torch.randint(0, vocab, (n,), generator=g)
    return h, w, b, y


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize(
    "bias,softcap,reduction",
    [(False, None, "mean"), (True, None, "sum"), (False, 30.0, "mean"), (True, 5.0, "sum")],
)
def test_lce_forward_and_grads(dtype, bias, softcap, reduction):
    h, w, b, y = _data(45, 24, 77, bias)
    y[::5] = -100
    _check(h, w, b, y, dtype, softcap=softcap, reduction=reduction)


def test_lce_custom_ignore_index_and_single_row():
    h, w, b, y = _data(19, 16, 33, False, seed=1)
    y[::3] = 7
    _check(h, w, b, y, torch.float32, ignore_index=7)
    _check(h[:1], w, b, y[:1].clamp(max=6), torch.float32)


def test_lce_several_chunks(monkeypatch):
    from torchfuser.backends.mlir import lce

    monkeypatch.setattr(lce, "CHUNK_BYTES", 4 * 64 * 16)   # 16-row chunks: several chunks and a tail
    monkeypatch.setattr(lce, "MIN_CHUNK_ROWS", 1)
    assert lce.chunk_rows(70, 64) == 16
    h, w, b, y = _data(70, 32, 64, True, seed=2)
    y[3::7] = -100
    _check(h, w, b, y, torch.float32, softcap=10.0)


def test_lce_3d_hidden_and_no_grad():
    h, w, _, y = _data(2 * 9, 16, 40, False, seed=3)
    h3, y3 = h.view(2, 9, 16).float(), y.view(2, 9)
    with torch.no_grad():
        a = F.linear_cross_entropy(h3, w.float(), y3, backend="mlir")
    # the reference with gradients on (its need_grad=False path returns one empty tensor thrice)
    b = F.linear_cross_entropy(h3, w.float().requires_grad_(True), y3, backend="reference")
    assert not a.requires_grad
    assert torch.allclose(a, b.detach(), atol=1e-5, rtol=1e-5)


def test_lce_need_grad_false_returns_empties():
    from torchfuser.backends.mlir.lce import linear_cross_entropy_fwd

    h, w, _, y = _data(8, 16, 20, False, seed=4)
    loss, dh, dw, db = linear_cross_entropy_fwd(h.float(), w.float(), None, y, -100, None, "mean", False)
    assert loss.shape == () and dh.numel() == dw.numel() == db.numel() == 0
    assert len({dh.data_ptr(), dw.data_ptr(), db.data_ptr()}) >= 1 and dh is not dw and dw is not db


@pytest.mark.parametrize("backend", ["mlir", "reference"])
@pytest.mark.parametrize("bad", [40, 1000, -1, -7])
def test_lce_label_outside_the_vocabulary_raises(backend, bad):
    """PyTorch's cross_entropy raises for such a label; on the CPU the check is free, so do we
    (a finite loss from a label that picks no logit would be silently wrong). A custom
    ignore_index is not such a label; the default -100 is one once ignore_index is changed."""
    h, w, _, y = _data(6, 16, 40, False)
    y[3] = bad
    with pytest.raises(IndexError, match=f"label {bad} is outside the vocabulary \\[0, 40\\)"):
        F.linear_cross_entropy(h.float(), w.float(), y, backend=backend)
    with pytest.raises(IndexError, match="outside the vocabulary"):  # compiled: still raised, at run time
        torch.compile(lambda a, b: F.linear_cross_entropy(a, b, y, backend=backend))(h.float(), w.float())


@pytest.mark.parametrize("backend", ["mlir", "reference"])
def test_lce_custom_ignore_index_is_no_outside_label_but_minus_100_then_is(backend):
    h, w, _, y = _data(6, 16, 40, False)
    y[1] = -1
    assert torch.isfinite(F.linear_cross_entropy(h.float(), w.float(), y, ignore_index=-1, backend=backend))
    y[4] = -100
    with pytest.raises(IndexError, match="label -100 .* not ignore_index \\(-1\\)"):
        F.linear_cross_entropy(h.float(), w.float(), y, ignore_index=-1, backend=backend)


def test_lce_kernel_gives_nan_for_an_outside_label_without_the_host_check(monkeypatch):
    """Behind the host check, the loss's one definition (``token_loss``, which the MLIR kernel is
    derived from) gives such a row NaN: no path returns a finite loss for it."""
    import torchfuser.backends.mlir.lce as lce
    monkeypatch.setattr(lce, "check_labels", lambda *a: None)
    h, w, _, y = _data(6, 16, 40, False)
    y[3] = 45
    loss, dh, dw, _ = lce.linear_cross_entropy_fwd(h.float(), w.float(), None, y, -100, None, "mean", True)
    assert torch.isnan(loss) and torch.isnan(dh).any()
    y[3] = 4
    assert torch.isfinite(lce.linear_cross_entropy_fwd(h.float(), w.float(), None, y, -100, None, "mean", False)[0])
