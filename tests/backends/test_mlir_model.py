"""A full tiny-Llama training step with backend="mlir" against backend="reference": the loss and
every parameter's gradient, then one optimizer step and a second forward (fp32, CPU)."""
from __future__ import annotations

import copy

import pytest
import torch

pytest.importorskip("torch_mlir")
transformers = pytest.importorskip("transformers")

import torchfuser  # noqa: E402

VOCAB = 128


pytestmark = pytest.mark.usefixtures("mlir_tmp_cache")


def _tiny_llama():
    cfg = transformers.LlamaConfig(
        vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, bos_token_id=1, eos_token_id=2, pad_token_id=0,
    )
    cfg._attn_implementation = "sdpa"
    torch.manual_seed(0)
    return transformers.AutoModelForCausalLM.from_config(cfg).float().train()


def _batch():
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(3, VOCAB, (2, 12), generator=g)
    labels = ids.clone()
    labels[1, :3] = -100
    return ids, labels


def test_tiny_llama_training_step_matches_reference():
    base = _tiny_llama()
    ref, fused = copy.deepcopy(base), copy.deepcopy(base)
    torchfuser.optimize(ref, backend="reference")
    torchfuser.optimize(fused, backend="mlir")
    report = torchfuser.report(fused)
    kinds = {f.pattern for f in report.fused}
    assert {"rms_norm", "gated_mlp", "lm_head_loss"} <= kinds, report
    assert all(f.backend == "mlir" for f in report.fused if f.pattern in ("rms_norm", "gated_mlp", "lm_head_loss")), report

    ids, labels = _batch()
    opts = {m: torch.optim.SGD(m.parameters(), lr=0.1) for m in (ref, fused)}
    losses = {}
    for step in range(2):
        for name, m in (("ref", ref), ("fused", fused)):
            loss = m(input_ids=ids, labels=labels).loss
            loss.backward()
            losses[name, step] = loss.detach()
        torch.testing.assert_close(losses["fused", step], losses["ref", step], rtol=1e-5, atol=1e-5)
        for (n, p_ref), (n_f, p_fused) in zip(ref.named_parameters(), fused.named_parameters()):
            assert n == n_f and (p_ref.grad is None) == (p_fused.grad is None), n
            if p_ref.grad is not None:
                torch.testing.assert_close(p_fused.grad, p_ref.grad, rtol=1e-4, atol=1e-5, msg=f"step {step}: {n}")
        for o in opts.values():
            o.step()
            o.zero_grad(set_to_none=True)
    assert fused.state_dict().keys() == base.state_dict().keys()
