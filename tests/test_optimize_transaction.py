"""optimize is all or nothing, the steps after the swaps included: a failure holding the Inductor pass,
setting FP8, installing CUDA graphs or autotune, or at the very end, leaves the model exactly as it was
before the call (a first call: unfused, nothing held; a later call: as the earlier ones left it), with
the process-wide holds (the Inductor pass, the FP8 optimizer-step hook) as they were."""
from __future__ import annotations

import importlib
import sys

import pytest
import torch

import torchfuser
from test_optimize import tiny_llama
from torchfuser import autotune, cuda_graphs, walker
from torchfuser.modules.fp8 import step as fp8_step

FIRST = dict(backend="reference", fp8="rowwise", fp8_lm_head=True, exclude=["gated_mlp"])
# Every setting changed at once: each step after the swaps has work to do.
AGAIN = dict(backend="auto", fp8="tensorwise", fp8_weights="per_step", exclude=(), cuda_graphs=True, autotune=True)
NARROWER = dict(patterns=["rms_norm", "attention"], fp8_weights="per_step", cuda_graphs=True, autotune=True)


def _fail_after(monkeypatch, module, name):
    """``module.name`` runs, then raises: the step has changed what it changes when it fails."""
    real = getattr(module, name)

    def fails(*args, **kwargs):
        real(*args, **kwargs)
        raise RuntimeError(f"injected failure in {name}")

    monkeypatch.setattr(module, name, fails)


def _inductor_pass():
    return importlib.import_module("torchfuser.compiler.inductor_pass")


STEPS = {
    "inductor pass": lambda mp: _fail_after(mp, _inductor_pass(), "hold"),
    "fp8 settings": lambda mp: _fail_after(mp, fp8_step, "hold"),
    "cuda graphs": lambda mp: _fail_after(mp, cuda_graphs, "install"),
    "autotune": lambda mp: _fail_after(mp, autotune, "apply"),
}
if importlib.util.find_spec("torchfuser.settings") is not None:  # the last step of all
    STEPS["the end"] = lambda mp: _fail_after(mp, importlib.import_module("torchfuser.settings"), "keep")


def _picture(model):
    """Everything optimize may change, by identity where it is an object."""
    modules = []
    for name, m in model.named_modules():
        d = m.__dict__
        modules.append((name, id(m), sorted(d), id(d.get("forward")), d.get("_fp8"), d.get("_fp8_per_step"),
                        d.get("backend"), tuple(id(h) for h in m._forward_pre_hooks.values()),
                        tuple((k, id(v)) for k, v in m._modules.items())))
    head = model.__dict__.get("forward")
    st = walker.state(model)
    ip = sys.modules.get("torchfuser.compiler.inductor_pass")
    return dict(
        modules=modules,
        head=None if head is None else (head.backend, head.fp8),
        report=str(torchfuser.report(model)),
        state=None if st is None else (st.backend, len(st.undo), list(st.report.notes)),
        settings=model.__dict__.get("_torchfuser_settings"),
        graphs=model.__dict__.get(cuda_graphs._ATTR),
        inductor=None if ip is None else (id(model) in ip._holders, ip.holders(), ip.config.pre_grad_custom_pass),
        fp8_step=(id(model) in fp8_step._holders, fp8_step.holders()),
    )


@pytest.fixture
def stand_in_gpu(monkeypatch):
    """The CUDA graphs install path on the CPU, let through the CUDA check."""
    monkeypatch.setattr(cuda_graphs, "_unsupported", lambda model, layers: None)


@pytest.mark.parametrize("step", list(STEPS))
@pytest.mark.parametrize("call", ["first", "again", "narrower"])
def test_a_failure_after_the_swaps_leaves_the_model_as_it_was(call, step, monkeypatch, stand_in_gpu):
    model = tiny_llama()
    if call != "first":
        torchfuser.optimize(model, **FIRST)
    ids = torch.randint(0, 128, (2, 8))
    with torch.no_grad():
        want = model(input_ids=ids).logits  # first: a call may keep caches on the modules
    _inductor_pass()  # imported (by an earlier test or here): its holders are part of the picture
    before = _picture(model)
    STEPS[step](monkeypatch)
    with pytest.raises(RuntimeError, match="injected failure"):
        torchfuser.optimize(model, **(NARROWER if call == "narrower" else {**FIRST, **AGAIN} if call == "first" else AGAIN))
    after = _picture(model)
    for key, value in before.items():
        if key == "modules":
            for was, now in zip(value, after[key]):
                assert now == was
        assert after[key] == value, key
    if call == "first":
        assert walker.state(model) is None and "forward" not in model.__dict__
        assert "not called" in str(torchfuser.report(model))
    with torch.no_grad():
        assert torch.equal(model(input_ids=ids).logits, want)
    monkeypatch.undo()
    torchfuser.optimize(model, **AGAIN)  # and it can be optimized afterwards
    assert torchfuser.report(model).counts()["gated_mlp"]["fused"] == 2
    torchfuser.restore(model)
    assert fp8_step.holders() == 0 or id(model) not in fp8_step._holders
