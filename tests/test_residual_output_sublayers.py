"""Post-norm output sublayers (BERT's SelfOutput and Output, and every encoder built like them): out = norm(dropout(
dense(h)) + r), the add inside the norm's kernel (``patterns.residual_norm_output``, ``modules.residual_output``).
One fp32 training step fused vs unfused (loss and every gradient), the dropout on, a masked-LM head, checkpointing."""
from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

import torchfuser
from torchfuser.modules import fallbacks
from torchfuser.modules.residual_output import ResidualOutputForward
from torchfuser.patterns.residual_norm import ResidualNormPattern

from numerics import assert_step_like, assert_trains_like
from tiny_lm import lm_step as step, tiny_model

H = 16


def _sublayers(model) -> list:
    return [m for m in model.modules() if isinstance(m.__dict__.get("forward"), ResidualOutputForward)]


@pytest.mark.parametrize("model_type, fields", [("bert", {}), ("roberta", {}), ("electra", {}),
                                                ("bert", {"hidden_dropout_prob": 0.2})],
                         ids=["bert", "roberta", "electra", "bert-dropout"])
def test_training_step_matches_unfused(model_type, fields):
    ref = tiny_model(model_type, **fields)
    fused = copy.deepcopy(ref)
    torchfuser.optimize(fused, backend="reference")
    found = _sublayers(fused)
    assert len(found) == 4, str(torchfuser.report(fused))
    assert {(m.forward.spec.dense, m.forward.spec.norm_in, m.forward.spec.dropout) for m in found} == {
        ("dense", "LayerNorm", "dropout")}
    if fields:
        assert step(ref) != step(tiny_model(model_type)), "the dropout is not on: the test would not see it"
        ref.zero_grad(set_to_none=True)
    assert_trains_like(ref, fused, step, list(ref.state_dict()))  # (restores it)
    assert not _sublayers(fused) and not any("forward" in m.__dict__ for m in fused.modules())


@pytest.mark.parametrize("checkpointing", ["hf", True])
def test_masked_lm_under_checkpointing(checkpointing):
    """BERT's own use (a masked-LM head): Hugging Face's gradient checkpointing around each layer, or optimize's
    own (each fused sublayer checkpoints itself)."""
    from transformers import AutoModelForMaskedLM

    cfg = tiny_model("bert").config
    cfg.is_decoder = False
    torch.manual_seed(0)
    ref = AutoModelForMaskedLM.from_config(cfg).float().train()
    if checkpointing == "hf":
        ref.gradient_checkpointing_enable()
    fused = copy.deepcopy(ref)
    torchfuser.optimize(fused, backend="reference", checkpointing=checkpointing is True)
    assert len(_sublayers(fused)) == 4, str(torchfuser.report(fused))
    ids = torch.randint(3, 128, (2, 10), generator=torch.Generator().manual_seed(1))

    def step_on_ids(m):
        loss = m(input_ids=ids, labels=ids).loss
        loss.backward()
        return loss.detach()

    assert_step_like(ref, fused, step_on_ids)
    assert not fallbacks.counts(fused), fallbacks.counts(fused)


class _Output(nn.Module):
    def __init__(self, after_add: bool = False):
        super().__init__()
        self.dense, self.LayerNorm, self.dropout = nn.Linear(2 * H, H), nn.LayerNorm(H), nn.Dropout(0.1)
        self.after_add = after_add

    def forward(self, hidden_states, input_tensor):
        h = self.dense(hidden_states)
        if self.after_add:  # the dropout on the sum: not the form
            return self.LayerNorm(self.dropout(h + input_tensor))
        return self.LayerNorm(self.dropout(h) + input_tensor)


def test_a_sublayer_is_fused_exactly_and_calls_with_other_arguments_run_the_original():
    torch.manual_seed(0)
    ref = _Output().double().train()
    model = nn.ModuleDict(dict(out=copy.deepcopy(ref)))
    torchfuser.optimize(model, backend="reference")
    assert len(_sublayers(model)) == 1, str(torchfuser.report(model))
    h = torch.randn(2, 5, 2 * H, dtype=torch.float64, requires_grad=True)
    r = torch.randn(2, 5, H, dtype=torch.float64, requires_grad=True)
    h2, r2 = (t.detach().clone().requires_grad_() for t in (h, r))
    g = torch.randn(2, 5, H, dtype=torch.float64)
    torch.manual_seed(3)
    (ref(h, r) * g).sum().backward()
    torch.manual_seed(3)
    (model.out(h2, input_tensor=r2) * g).sum().backward()
    torch.testing.assert_close(h2.grad, h.grad)
    torch.testing.assert_close(r2.grad, r.grad)
    for (n, a), (_, b) in zip(ref.named_parameters(), model.out.named_parameters()):
        torch.testing.assert_close(b.grad, a.grad, msg=n)
    assert not fallbacks.counts(model)
    with pytest.raises(TypeError):
        model.out(h2)  # the original's error, counted
    assert fallbacks.counts(model)


def test_a_dropout_on_the_sum_is_not_the_form():
    assert ResidualNormPattern().match(_Output(after_add=True)) is None
    assert ResidualNormPattern().match(_Output()) is not None


def test_autotune_leaves_the_sublayers_norms_to_them():
    """Autotune does not time a norm a fused sublayer calls by method (a hook on it would turn that forward off)."""
    from torchfuser import autotune

    fused = tiny_model("bert")
    torchfuser.optimize(fused, backend="reference")
    found = _sublayers(fused)
    assert len(found) == 4
    assert {id(m.LayerNorm) for m in found} <= autotune._residual_norms(fused)


def test_a_broadcasting_residual_is_added_as_the_original_adds_it():
    torch.manual_seed(0)
    ref = _Output().double().eval()
    model = nn.ModuleDict(dict(out=copy.deepcopy(ref)))
    torchfuser.optimize(model, backend="reference")
    h, r = torch.randn(2, 5, 2 * H, dtype=torch.float64), torch.randn(1, 1, H, dtype=torch.float64)
    torch.testing.assert_close(model.out(h, r), ref(h, r))
