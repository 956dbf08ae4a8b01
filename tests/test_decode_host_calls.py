"""A decode step of a fused model (greedy ``generate`` with a KV cache, a batch of left-padded prompts, no_grad,
training mode as TRL's rollouts keep it) does no more host work than the unfused model's: its ATen calls are
counted (torch.profiler, top-level calls), not timed, and so are its Python calls (cProfile). By default the step
runs the original modules (``modules.decode``); the fused kernels' decode path (the switch
``decode_to_original`` off) is held to bounds of its own, checked to fail on the path they replaced (the ops'
full forward kernels under no_grad). The logits must be equal to the unfused model's, bit for bit, either way.
Timed: benchmarks/probes/generate_rollouts.py (NOTES-trl.md).
"""
from __future__ import annotations

import cProfile
import copy
import pstats

import pytest
import torch
from torch.profiler import ProfilerActivity, profile
from transformers import AutoConfig, AutoModelForCausalLM, DynamicCache

import torchfuser
from torchfuser import ops, switches
from torchfuser.ops import _call

from tiny_lm import left_padded_prompts

# Python calls a fused decode step may add to the unfused one (tiny Llama, 2 layers, batch 4), the step handed to
# the original modules (the default): +35 with transformers 5.25 (a check a layer and for the final norm, the
# layers' children swapped for their originals, the LM head's wrapper).
PYTHON_CALLS_EXTRA = 80
# The same with the fused kernels' decode path (switch decode_to_original off): +301 with transformers 5.25 (23633a5,
# before the switch: +295; at 6e3fafb +270, +354 with 5.17; 1dfe1cd: +472 / +554; main before the no-grad kernel
# path and the call-path cuts, 17988d2: +1011).
# ATen calls there: fused 157 against 171 unfused (5.25); at 17988d2, 233 against 171.
PYTHON_CALLS_EXTRA_FUSED = 420


@pytest.fixture(params=[True, False], ids=["to-original", "fused-kernels"])
def to_original(request):
    with switches.switched(decode_to_original=request.param):
        yield request.param


@pytest.fixture
def fused_kernels():
    with switches.switched(decode_to_original=False):
        yield


def _pair(backend: str):
    cfg = AutoConfig.for_model("llama", hidden_size=128, intermediate_size=352, num_hidden_layers=2,
                               num_attention_heads=4, num_key_value_heads=2, vocab_size=1024, tie_word_embeddings=True)
    cfg._attn_implementation = "sdpa"
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        base = AutoModelForCausalLM.from_config(cfg)
    fused = torchfuser.optimize(copy.deepcopy(base), backend=backend)
    for m in (base, fused):
        m.train()  # TRL's rollouts: the trainer's mode, under no_grad
    return base, fused


def _prompts():
    return left_padded_prompts(4, 12, 3, 4, 1024)  # left padding of 0, 3, 6, 9 tokens


class _Decode:
    """One decode step of ``model`` after a prefill, repeatable: the cache is cut back after each step."""

    def __init__(self, model):
        self.model, (ids, mask) = model, _prompts()
        self.cache = DynamicCache(config=model.config)
        with torch.no_grad():
            out = model(input_ids=ids, attention_mask=mask, past_key_values=self.cache, use_cache=True)
        self.next = out.logits[:, -1:].argmax(-1)
        self.mask = torch.cat([mask, torch.ones_like(self.next)], dim=1)

    def __call__(self):
        with torch.no_grad():
            logits = self.model(input_ids=self.next, attention_mask=self.mask, past_key_values=self.cache,
                                use_cache=True).logits
        self.cache.crop(-1)
        return logits


def _aten_calls(step) -> int:
    step()  # warm (decisions made once per call signature)
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        step()
    return sum(1 for e in prof.events() if e.name.startswith("aten::")
               and (e.cpu_parent is None or not e.cpu_parent.name.startswith("aten::")))


def _python_calls(step) -> int:
    step()
    prof = cProfile.Profile()
    prof.enable()
    step()
    prof.disable()
    return pstats.Stats(prof).total_calls


@pytest.mark.parametrize("backend", ["reference", "auto"])
def test_a_fused_decode_step_makes_no_more_aten_calls_and_equal_logits(backend, to_original):
    base, fused = _pair(backend)
    plain, step = _Decode(base), _Decode(fused)
    assert torch.equal(step(), plain())
    assert _aten_calls(step) <= _aten_calls(plain)


def test_the_aten_bound_fails_on_the_full_forward_kernels(monkeypatch, fused_kernels):
    """The bound can fail: the ops' ``_fwd`` kernels (rope's copies into its backward's layout, the norms'
    statistics) in place of the ``_infer`` ones under no_grad make more ATen calls than the unfused model."""
    base, fused = _pair("reference")
    monkeypatch.setattr(_call, "_RAW", {})
    monkeypatch.setattr(_call, "_inference_kernel", _call.kernel)
    plain, step = _Decode(base), _Decode(fused)
    assert torch.equal(step(), plain())
    assert _aten_calls(step) > _aten_calls(plain)


def test_a_fused_decode_step_adds_a_bounded_number_of_python_calls(to_original):
    base, fused = _pair("reference")
    plain, step = _Decode(base), _Decode(fused)
    extra = _python_calls(step) - _python_calls(plain)
    bound = PYTHON_CALLS_EXTRA if to_original else PYTHON_CALLS_EXTRA_FUSED
    assert extra <= bound, f"a fused decode step makes {extra} Python calls more than the unfused one"


def _asked(monkeypatch):
    """The backends nograd_forward resolves kernels for (each served by the reference kernel: nothing compiles)."""
    asked = []

    def spy(backend, fwd_name):
        asked.append(backend)
        return _call.kernel("reference", fwd_name)

    monkeypatch.setattr(_call, "_RAW", {})
    monkeypatch.setattr(_call, "_inference_kernel", spy)
    return asked


def test_small_no_grad_mlir_calls_take_the_reference_kernel_and_the_switch_turns_it_off(monkeypatch):
    asked = _asked(monkeypatch)
    w = torch.randn(128)
    small, large = torch.randn(4, 128), torch.randn(_call.MLIR_SMALL // 128 + 1, 128)
    with torch.no_grad():
        ops.rms_norm(small, w, 1e-6, 0.0, "mlir")
        ops.rms_norm(large, w, 1e-6, 0.0, "mlir")
        ops.swiglu(small, small, "mlir")
        with switches.switched(mlir_small_to_reference=False):
            _call._RAW.clear()
            ops.rms_norm(small, w, 1e-6, 0.0, "mlir")
    assert asked == ["reference", "mlir", "reference", "mlir"]
    asked.clear()
    ops.rms_norm(small.requires_grad_(), w, 1e-6, 0.0, "reference")  # grad mode: the autograd Function's path
    assert asked == []


def test_the_report_says_small_mlir_calls_run_the_reference_kernels():
    _, fused = _pair("reference")
    assert not any(n.startswith(_call.SMALL_NOTE) for n in torchfuser.report(fused).notes)
    assert _call.small_calls_note({"mlir"}) and not _call.small_calls_note({"reference", "triton"})
    with switches.switched(mlir_small_to_reference=False):
        assert not _call.small_calls_note({"mlir"})


@pytest.mark.parametrize("offset", [0.0, 1.0])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_inference_kernels_equal_the_forward_kernels_bit_for_bit(dtype, offset):
    from torchfuser.backends import reference as ref

    gen = torch.Generator().manual_seed(2)
    x, r = (torch.randn(3, 5, 64, generator=gen).to(dtype) for _ in range(2))
    w = torch.randn(64, generator=gen).to(dtype)
    for out_dtype in (None, torch.float32):
        assert torch.equal(ref.rms_norm_infer(x, w, 1e-6, offset, out_dtype)[0], ref.rms_norm_fwd(x, w, 1e-6, offset, out_dtype)[0])
        got, want = ref.add_rms_norm_infer(x, r, w, 1e-6, offset, out_dtype), ref.add_rms_norm_fwd(x, r, w, 1e-6, offset, out_dtype)
        assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])
    q, k = torch.randn(2, 4, 5, 32, generator=gen).to(dtype), torch.randn(2, 2, 5, 32, generator=gen).to(dtype)
    cos, sin = torch.randn(2, 5, 32, generator=gen).to(dtype), torch.randn(2, 5, 32, generator=gen).to(dtype)
    for got, want in zip(ref.rope_infer(q, k, cos, sin), ref.rope_fwd(q, k, cos, sin)):
        assert torch.equal(got, want) and not got._is_view()  # (called unwrapped: never views)
    g, u = torch.randn(3, 5, 96, generator=gen).to(dtype), torch.randn(3, 5, 96, generator=gen).to(dtype)
    assert torch.equal(ref.swiglu_infer(g, u), ref.swiglu_fwd(g, u)) and not ref.swiglu_infer(g, u)._is_view()
    for out_dtype in (None, torch.float32):
        assert not ref.rms_norm_infer(x, w, 1e-6, offset, out_dtype)[0]._is_view()
        assert not any(t._is_view() for t in ref.add_rms_norm_infer(x, r, w, 1e-6, offset, out_dtype)[:2])
