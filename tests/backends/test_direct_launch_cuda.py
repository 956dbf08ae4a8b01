"""The direct Triton launch (``_common.Launcher``) on a real CUDA machine: every specialization a
fused training step uses passes its first-use check against ``kernel[grid]``, and the steps that
run through the direct path compute what the steps through ``kernel[grid]`` computed.

The CPU tests (test_triton_targets.py) check the same logic against a fake launcher; only a GPU
with Triton 3.6 has the real C launcher whose argument layout the direct call copies.
"""
from __future__ import annotations

import gc

import pytest
import torch

pytest.importorskip("triton")
if not torch.cuda.is_available():
    pytest.skip("needs a CUDA GPU (the direct launch is CUDA-only)", allow_module_level=True)

transformers = pytest.importorskip("transformers")

import torchfuser  # noqa: E402
from torchfuser.backends.triton import _common  # noqa: E402


def _launchers():
    return [o for o in gc.get_objects() if isinstance(o, _common.Launcher)]


def _keys():
    """{launcher: the specializations it has built so far, checked or not} (other tests' launches included)."""
    return {lc: set(lc.pending) | set(lc.cache) for lc in _launchers()}


def _step(model, ids):
    model.zero_grad(set_to_none=True)
    loss = model(input_ids=ids, labels=ids).loss
    loss.backward()
    return loss.detach().clone(), {n: p.grad.clone() for n, p in model.named_parameters()}


@pytest.mark.skipif(not _common._DIRECT, reason="the direct launch is off here (not Triton 3.6 on CUDA)")
def test_every_specialization_of_a_fused_step_passes_its_direct_launch_check(monkeypatch):
    monkeypatch.setattr(_common, "_refused", [])
    cfg = transformers.LlamaConfig(vocab_size=512, hidden_size=256, intermediate_size=512, num_hidden_layers=2,
                                   num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256)
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(cfg).cuda()
    torchfuser.optimize(model, backend="triton")
    ids = torch.randint(0, cfg.vocab_size, (2, 64), device="cuda")
    before = _keys()
    # Step 1 compiles (kernel[grid]), step 2 checks each specialization (kernel[grid], spied on),
    # step 3 onwards launches directly.
    first = _step(model, ids)
    _step(model, ids)
    direct = _step(model, ids)
    torch.cuda.synchronize()

    assert _common._refused == [], f"direct launch refused for {_common._refused}"
    new = {lc: keys - before.get(lc, set()) for lc, keys in _keys().items()}
    new = {lc: keys for lc, keys in new.items() if keys}
    assert new, "no Triton kernel of the fused step went through a Launcher"
    unchecked = [lc.fn.__name__ for lc, keys in new.items() for k in keys if lc.pending.get(k) is not None]
    assert not unchecked, f"specializations still waiting for their check after three steps: {unchecked}"
    assert sum(k in lc.cache for lc, keys in new.items() for k in keys) >= 4, new  # norms, rope, gated MLP, LM head
    torch.testing.assert_close(direct[0], first[0], rtol=1e-6, atol=1e-6)
    for name, g in first[1].items():
        torch.testing.assert_close(direct[1][name], g, rtol=1e-5, atol=1e-6, msg=lambda m: f"{name}: {m}")
