"""``optimize(model, fp8="blockwise")``: a scale per 128 elements along each GEMM's inner dimension
(128 × 128 blocks for weights), DeepSeek-V3's recipe; the reference quantisation against float64, the
emulated blockwise product against its definition, training close to bf16 under the lossy FP8 rule of
tests/test_fp8.py (loss within 1 %, every gradient at a cosine similarity above 0.99), the fallbacks
and errors. The Triton kernels' bits are tests/backends/test_fp8_blocks.py's."""
from __future__ import annotations

import copy

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM

import torchfuser
from torchfuser.backends import _fp8_gemm
from torchfuser.backends.reference import fp8_blocks as B
from torchfuser.modules import fp8

# Every GEMM side a multiple of 128: q/k/v 128 → 256, o 128 → 128, gate/up 128 → 512, down 256 → 128.
CFG = dict(vocab_size=128, hidden_size=128, intermediate_size=256, num_hidden_layers=2, num_attention_heads=4,
           num_key_value_heads=2)


def _model():
    torch.manual_seed(0)
    return LlamaForCausalLM(LlamaConfig(**CFG))


def _ids(rows=2, seq=64, seed=1):
    return torch.randint(0, 128, (rows, seq), generator=torch.Generator().manual_seed(seed))


def _step(model, ids):
    model.zero_grad(set_to_none=True)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        loss = model(input_ids=ids, labels=ids).loss
    loss.backward()
    return loss.item(), {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


def test_block_scales_against_float64():
    """Each 1 × 128 block's scale is its amax / 448 and its values round to within e4m3's half-ulp
    (2⁻⁴ relative, the subnormals aside), both ways; a weight's 128 × 128 blocks likewise."""
    t = torch.randn(256, 384, dtype=torch.float64) * torch.logspace(-3, 3, 384, dtype=torch.float64)
    q, s, qt, st = B.fp8_quantize_blocks(t.float(), True, True)
    assert s.stride() == (1, 256) and st.stride() == (1, 384)
    want = t.view(256, 3, 128).abs().amax(-1) / 448
    torch.testing.assert_close(s.double(), want, rtol=1e-6, atol=0)
    want_t = t.view(2, 128, 384).abs().amax(1).t() / 448
    torch.testing.assert_close(st.double(), want_t, rtol=1e-6, atol=0)
    for got, ref in ((B.dequantize_blocks(q, s, False), t), (B.dequantize_blocks(qt, st, False), t.t())):
        err = (got.double() - ref).abs()
        scale = ref.abs().view(ref.shape[0], -1, 128).amax(-1, keepdim=True).expand(-1, -1, 128).reshape(ref.shape) / 448
        assert (err <= 2.0 ** -4 * ref.abs() + scale * 2.0 ** -9).all()
    w = torch.randn(256, 384)
    wq, s_fwd, wqt, s_bwd = B.fp8_quantize_weight_blocks(w)
    assert torch.equal(wqt.view(torch.uint8), wq.t().contiguous().view(torch.uint8))
    assert s_fwd.shape == (4, 2) and s_fwd.stride() == (1, 4) and s_bwd.shape == (4, 3) and s_bwd.stride() == (1, 4)
    blocks = w.view(2, 128, 3, 128).abs().amax(dim=(1, 3)) / 448
    assert torch.equal(s_fwd[:3].t(), blocks) and torch.equal(s_bwd[:2].t(), blocks.t())
    assert (s_fwd[3:] == 1).all()  # the round-up row


def test_nan_stays_in_its_block():
    t = torch.randn(128, 256)
    t[5, 200] = float("nan")
    q, s, qt, st = B.fp8_quantize_blocks(t, True, True)
    assert s[5, 1].isnan() and s.isnan().sum() == 1
    assert st[200, 0].isnan() and st.isnan().sum() == 1
    assert q.float()[5, 128:].isnan().all() and not q.float()[:, :128].isnan().any()


def test_the_emulated_product_is_the_dequantised_product():
    a = torch.randn(256, 384)
    w = torch.randn(512, 384)
    q, s, _, _ = B.fp8_quantize_blocks(a, True, False)
    wq, s_fwd, wqt, s_bwd = B.fp8_quantize_weight_blocks(w)
    got = _fp8_gemm.mm((q, s, "1x128"), (wq, s_fwd, "128x128"), torch.float32)
    want = B.dequantize_blocks(q, s, False) @ B.dequantize_blocks(wq, s_fwd, True).t()
    torch.testing.assert_close(got, want)
    dy = torch.randn(256, 512)
    dq, ds, _, _ = B.fp8_quantize_blocks(dy, True, False)
    got = _fp8_gemm.mm((dq, ds, "1x128"), (wqt, s_bwd, "128x128"), torch.float32)  # dx = dy·W
    torch.testing.assert_close(got, B.dequantize_blocks(dq, ds, False) @ B.dequantize_blocks(wqt, s_bwd, True).t())
    exact = dy.double() @ w.double()
    assert ((got.double() - exact).norm() / exact.norm()) < 2 * 2.0 ** -4


def test_blockwise_trains_close_to_bf16(monkeypatch):
    base = _model()
    bf16 = torchfuser.optimize(copy.deepcopy(base), backend="reference")
    model = torchfuser.optimize(copy.deepcopy(base), backend="reference", fp8="blockwise")
    assert any(n.startswith("fp8: blockwise") for n in torchfuser.report(model).notes)
    calls = []
    real = _fp8_gemm.mm_blocks
    monkeypatch.setattr(_fp8_gemm, "mm_blocks", lambda *a, **k: calls.append(a[1][2]) or real(*a, **k))
    ids = _ids()
    want, want_g = _step(bf16, ids)
    got, got_g = _step(model, ids)
    # 4 projections a layer × 2 layers, each one GEMM forward and two backward: the forward's and dx's
    # second operand the weights' 128 × 128 copies, dW's the activation's 1 × 128 one
    assert sorted(calls) == sorted(["128x128", "128x128", "1x128"] * 8)
    assert not torchfuser.report(model).fallbacks
    assert abs(got - want) < 1e-2 * abs(want)
    assert list(got_g) == list(want_g)
    for name, g in want_g.items():
        cos = torch.nn.functional.cosine_similarity(got_g[name].flatten(), g.flatten(), dim=0)
        assert cos > 0.99, (name, cos.item())


def test_tokens_not_in_whole_blocks_run_bf16_counted():
    model = torchfuser.optimize(_model(), backend="reference", fp8="blockwise")
    _step(model, _ids(rows=1, seq=48))  # 48 tokens: a multiple of 16, not of 128
    said = " ".join(torchfuser.report(model).notes)
    assert "not in multiples of 128, blockwise's blocks" in said and "fp8='rowwise'" in said


def test_blockwise_is_refused_where_it_cannot_run():
    with pytest.raises(ValueError, match="'rowwise', 'tensorwise' or 'blockwise'"):
        torchfuser.optimize(_model(), fp8="block")
    with pytest.raises(ValueError, match="not blockwise"):
        torchfuser.optimize(_model(), fp8="blockwise", fp8_lm_head=True)
    with pytest.raises(ValueError, match="multiples of 128"):
        B.fp8_quantize_blocks(torch.randn(100, 128), True, True)


def test_blockwise_needs_hopper(monkeypatch):
    """An Ada GPU (FP8 GEMMs, but no blockwise ones in cuBLASLt) is refused with the reason, before
    anything changes; rowwise is accepted there."""
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (8, 9))
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: "NVIDIA L40S")
    checked = []
    monkeypatch.setattr(fp8._selfcheck, "ensure", lambda recipe, device: checked.append(recipe))
    with pytest.raises(ValueError, match="needs a Hopper GPU.*L40S is 8.9.*fp8='rowwise'"):
        fp8.check("blockwise", torch.device("cuda"))
    assert fp8.check("rowwise", torch.device("cuda")) == "rowwise"
    assert checked == ["rowwise"]  # the GPU's quantisers are checked once it is accepted


def test_blockwise_per_step_weights_and_lora(monkeypatch):
    """The weights' blockwise copies are kept per optimizer step like the others; a LoRA layer's frozen
    base runs its products blockwise too."""
    from peft import LoraConfig, get_peft_model

    model = get_peft_model(_model(), LoraConfig(r=8, target_modules=["q_proj", "v_proj", "gate_proj"]))
    torchfuser.optimize(model, backend="reference", fp8="blockwise")
    calls = []
    real = _fp8_gemm.mm_blocks
    monkeypatch.setattr(_fp8_gemm, "mm_blocks", lambda *a, **k: calls.append(a[1][2]) or real(*a, **k))
    loss, grads = _step(model, _ids())
    assert calls and set(calls) == {"128x128"}  # every base frozen under PEFT: forward and dx GEMMs, no dW
    assert torch.isfinite(torch.tensor(loss))
    assert grads and all(torch.isfinite(g).all() for g in grads.values())
    assert fp8.recipe_of(next(m for m in model.modules() if "_fp8" in m.__dict__)) == "blockwise"
