"""A fused norm returns what the norm it replaced returns, dtype included, for every input and weight
dtype and under autocast; its values and gradients within the numerics rule against float64.

The families differ: Llama's ``weight * x.to(input_dtype)`` promotes (bf16 x, fp32 weight: fp32 out), Gemma's
``(…).type_as(x)`` and ``nn.LayerNorm`` / ``nn.RMSNorm`` keep x's dtype, T5's casts to a half weight's
dtype. Each pattern probes which at match time (``patterns/_dtype_probe.py``)."""
from __future__ import annotations

import copy

import pytest
import torch
from torch import nn
from transformers.models.gemma.modeling_gemma import GemmaRMSNorm
from transformers.models.gemma3.modeling_gemma3 import Gemma3RMSNorm
from transformers.models.llama.modeling_llama import LlamaRMSNorm
from transformers.models.nemotron.modeling_nemotron import NemotronLayerNorm1P
from transformers.models.qwen3.modeling_qwen3 import Qwen3RMSNorm
from transformers.models.t5.modeling_t5 import T5LayerNorm

import torchfuser
from torchfuser.modules.norms import FusedLayerNorm, FusedRMSNorm

from numerics import ATOL, assert_within_rule

H = 48
BF16, F16, F32 = torch.bfloat16, torch.float16, torch.float32

# name: (constructor, offset of the weight, LayerNorm?, the input's shape)
FAMILIES = {
    "llama": (lambda: LlamaRMSNorm(H, eps=1e-6), 0.0, False, (3, 5, H)),
    "qwen3-qk": (lambda: Qwen3RMSNorm(16, eps=1e-6), 0.0, False, (2, 5, 3, 16)),  # per head: (B, S, heads, head_dim)
    "gemma": (lambda: GemmaRMSNorm(H, eps=1e-6), 1.0, False, (3, 5, H)),
    "gemma3": (lambda: Gemma3RMSNorm(H, eps=1e-6), 1.0, False, (3, 5, H)),
    "t5": (lambda: T5LayerNorm(H, eps=1e-6), 0.0, False, (3, 5, H)),
    "torch-rmsnorm": (lambda: nn.RMSNorm(H, eps=1e-6), 0.0, False, (3, 5, H)),
    "layernorm": (lambda: nn.LayerNorm(H), None, True, (3, 5, H)),
    "layernorm-nobias": (lambda: nn.LayerNorm(H, bias=False), None, True, (3, 5, H)),
    "nemotron": (lambda: NemotronLayerNorm1P(H), 1.0, True, (3, 5, H)),  # w + 1; under autocast: autocast's dtype
}


class Block(nn.Module):
    def __init__(self, norm):
        super().__init__()
        self.norm = norm

    def forward(self, x):
        return self.norm(x)


def _norm(family, w_dtype):
    make, *_ = FAMILIES[family]
    g = torch.Generator().manual_seed(1)
    norm = make()
    with torch.no_grad():
        norm.weight.copy_(torch.randn(norm.weight.shape, generator=g) * 0.3 + (0.0 if FAMILIES[family][1] else 1.0))
        if getattr(norm, "bias", None) is not None:
            norm.bias.copy_(torch.randn(norm.bias.shape, generator=g) * 0.3)
    return norm.to(w_dtype)


def _ref64(family, x, norm):
    """The norm's math in float64 (the originals upcast to fp32 inside, so are no float64 oracle)."""
    _, offset, ln, _ = FAMILIES[family]
    x = x.double()
    w = norm.weight.double()
    if ln:
        b = None if norm.bias is None else norm.bias.double()
        return nn.functional.layer_norm(x, x.shape[-1:], (offset or 0.0) + w, b, norm.eps)
    eps = getattr(norm, "variance_epsilon", None) or norm.eps
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * (offset + w)


def _run(module, x, dy, autocast=None):
    """(y, dx, the parameters' gradients) of ``module`` at x for the output gradient dy."""
    x = x.detach().requires_grad_()
    module.zero_grad(set_to_none=True)
    with torch.autocast("cpu", dtype=autocast, enabled=autocast is not None):
        y = module(x)
    y.backward(dy.to(y.dtype) if dy.dtype != y.dtype else dy)
    return y, x.grad, [p.grad for p in module.parameters()]


def _fused(norm):
    block = Block(copy.deepcopy(norm))
    torchfuser.optimize(block, backend="reference")
    assert isinstance(block.norm, (FusedRMSNorm, FusedLayerNorm)), torchfuser.report(block)
    return block


def _raises(norm, x) -> bool:
    try:
        norm(x)
    except RuntimeError:  # nn.LayerNorm takes no weight of another dtype than x but fp32
        return True
    return False


@pytest.mark.parametrize("autocast", [None, BF16], ids=["plain", "cpu-autocast"])
@pytest.mark.parametrize("w_dtype", [F32, BF16, F16], ids=["w32", "wbf16", "wf16"])
@pytest.mark.parametrize("x_dtype", [BF16, F16, F32], ids=["xbf16", "xf16", "xf32"])
@pytest.mark.parametrize("family", list(FAMILIES))
def test_fused_norm_returns_the_originals_dtype_and_values(family, x_dtype, w_dtype, autocast):
    norm = _norm(family, w_dtype)
    x = (torch.randn(FAMILIES[family][3], generator=torch.Generator().manual_seed(2)) + 0.3).to(x_dtype)
    if _raises(norm, x):
        pytest.skip(f"the original raises on {x_dtype} input with {w_dtype} weights")
    fused = _fused(norm)
    with torch.no_grad(), torch.autocast("cpu", dtype=autocast, enabled=autocast is not None):
        want = norm(x)
    dy = torch.randn(want.shape, generator=torch.Generator().manual_seed(3)).to(want.dtype)
    want, want_dx, want_dw = _run(Block(norm), x, dy, autocast)
    got, got_dx, got_dw = _run(fused, x, dy, autocast)
    assert got.dtype == want.dtype, f"{family}: {got.dtype} returned, the original returns {want.dtype}"
    assert got_dx.dtype == want_dx.dtype and [g.dtype for g in got_dw] == [g.dtype for g in want_dw]
    # float64 reference, forward and every gradient
    x64 = x.double().requires_grad_()
    ref_norm = copy.deepcopy(norm).double()
    y64 = _ref64(family, x64, ref_norm)
    y64.backward(dy.double())
    atol = ATOL[min((x_dtype, w_dtype, want.dtype), key=lambda d: torch.finfo(d).bits)]
    assert_within_rule(got, want, y64, atol, f"{family} y")
    assert_within_rule(got_dx, want_dx, x64.grad, atol, f"{family} dx")
    for name, g, w, r in zip(("dw", "db"), got_dw, want_dw, [p.grad for p in ref_norm.parameters()]):
        assert_within_rule(g, w, r, atol * H, f"{family} {name}")  # a sum over the rows


def test_the_fast_path_is_the_plain_kernel(monkeypatch):
    """bf16 in, bf16 weights (and the original returning bf16): one rms_norm call on x itself, no cast."""
    from torchfuser import ops

    block = _fused(_norm("llama", BF16))
    seen = []
    real = ops.rms_norm
    monkeypatch.setattr(ops, "rms_norm", lambda x, *a, **k: seen.append(x) or real(x, *a, **k))
    x = torch.randn(3, H, dtype=BF16)
    assert block(x).dtype == BF16
    assert len(seen) == 1 and seen[0] is x


def test_gpu_autocast_output_dtype_is_probed():
    """On CUDA, autocast runs layer_norm (and rms_norm from PyTorch 2.12) in fp32 (AT_FORALL_FP32):
    nn.LayerNorm and nn.RMSNorm then return fp32 whatever their input; the Python norms upcast first and
    are unchanged. The probe emulates that policy on the CPU."""
    assert _fused(_norm("layernorm", F32)).norm.spec.autocast_out_dtype == "float32"
    rms_fp32 = torch.torch_version.TorchVersion(torch.__version__) >= (2, 12)
    assert _fused(_norm("torch-rmsnorm", F32)).norm.spec.autocast_out_dtype == ("float32" if rms_fp32 else None)
    for family in ("llama", "gemma", "t5"):
        assert _fused(_norm(family, F32)).norm.spec.autocast_out_dtype is None, family
    # Nemotron's LayerNorm1P reads autocast's state: its inputs cast to autocast's dtype, the norm run with it off
    assert _fused(_norm("nemotron", F32)).norm.spec.autocast_out_dtype == "autocast"
    assert _fused(_norm("llama", F32)).norm.spec.out_dtype == "promote"
    assert _fused(_norm("gemma", F32)).norm.spec.out_dtype == "input"
    assert _fused(_norm("t5", F32)).norm.spec.out_dtype == "weight"


@pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA autocast's own policy needs a GPU")
@pytest.mark.parametrize("w_dtype", [F32, BF16], ids=["w32", "wbf16"])
@pytest.mark.parametrize("family", list(FAMILIES))
def test_cuda_autocast_dtype_and_values(family, w_dtype):
    """The same under CUDA autocast, on the GPU's default backend (triton)."""
    norm = _norm(family, w_dtype).cuda()
    x = (torch.randn(FAMILIES[family][3], generator=torch.Generator().manual_seed(2)) + 0.3).to("cuda", BF16)
    block = Block(copy.deepcopy(norm))
    torchfuser.optimize(block)
    for enabled in (False, True):
        with torch.autocast("cuda", dtype=BF16, enabled=enabled):
            try:
                want = norm(x)
            except RuntimeError:  # a combination the original refuses
                continue
            got = block(x)
        assert got.dtype == want.dtype, (family, enabled, got.dtype, want.dtype)
        y64 = _ref64(family, x.double(), copy.deepcopy(norm).double())
        assert_within_rule(got, want, y64, ATOL[BF16], f"{family} autocast={enabled}")


@pytest.mark.parametrize("family", ["llama", "t5", "gemma", "layernorm"])
def test_mlir_backend_too(family):
    """The CPU's default backend, on the combinations whose output dtype is not x's."""
    from numerics import needs_mlir  # noqa: F401  (skip reason below)
    from torchfuser.backends import unavailable_reason

    if unavailable_reason("mlir", "cpu"):
        pytest.skip(unavailable_reason("mlir", "cpu"))
    x_dtype, w_dtype = (F32, BF16) if family == "t5" else (BF16, F32)
    norm = _norm(family, w_dtype)
    x = (torch.randn(FAMILIES[family][3], generator=torch.Generator().manual_seed(2)) + 0.3).to(x_dtype)
    block = Block(copy.deepcopy(norm))
    torchfuser.optimize(block, backend="mlir")
    want, got = norm(x), block(x)
    assert got.dtype == want.dtype
    assert_within_rule(got, want, _ref64(family, x, copy.deepcopy(norm).double()), ATOL[BF16], family)


@pytest.mark.parametrize("autocast", [False, True], ids=["plain", "autocast"])
def test_decoder_layers_with_fp32_norms_in_a_bf16_model(autocast):
    """A bf16 Llama whose norms stay fp32 (as ``_keep_in_fp32_modules`` keeps them): Llama's norms then
    return fp32, inside the fused decoder layers (residual_norm) as well. Under autocast every hidden state
    has the original's dtype and the logits are within the rule against the float64 model; without it the
    fp32 norm output meets a bf16 projection, and the fused model raises PyTorch's error as the original does."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=128, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
                      num_key_value_heads=2)
    base = LlamaForCausalLM(cfg)
    with torch.no_grad():
        for n, p in base.named_parameters():
            if "norm" in n:
                p.copy_(1 + 0.3 * torch.randn(p.shape))
    ref64 = copy.deepcopy(base).double()
    plain = copy.deepcopy(base).to(BF16)
    for n, m in plain.named_modules():
        if n.endswith("norm"):
            m.float()
    fused = torchfuser.optimize(copy.deepcopy(plain), backend="reference")
    assert {e.pattern for e in torchfuser.report(fused).fused} >= {"rms_norm", "residual_norm"}
    ids = torch.randint(0, 128, (2, 8), generator=torch.Generator().manual_seed(1))
    if not autocast:  # the fp32 norm output meets a bf16 projection: PyTorch's error, fused as unfused
        for model in (plain, fused):
            with pytest.raises(RuntimeError, match="same dtype"):
                model(input_ids=ids)
        return
    outs = []
    for model in (plain, fused):
        with torch.autocast("cpu", dtype=BF16):
            outs.append(model(input_ids=ids, output_hidden_states=True))
    want, got = outs
    assert [h.dtype for h in got.hidden_states] == [h.dtype for h in want.hidden_states]
    assert got.logits.dtype == want.logits.dtype
    with torch.no_grad():
        logits64 = ref64(input_ids=ids).logits
    assert_within_rule(got.logits.detach(), want.logits.detach(), logits64, ATOL[BF16], "logits")
