"""optimize changes nothing outside the model it is given (random generators, Inductor's config),
changes the model all or nothing, and a second call with another backend applies it."""
from __future__ import annotations

import gc
import os
from types import SimpleNamespace

import pytest
import torch
from transformers import AutoModelForCausalLM

import torchfuser
from arch_sweep import tiny_config
from test_optimize import tiny_llama
from torchfuser import backends, patterns, walker
from torchfuser.backends.mlir import cache as mlir_cache
from torchfuser.modules.attention import FusedAttention
from torchfuser.modules.base import FusedModule
from torchfuser.patterns.norms import RMSNormPattern

ARCHS = ["llama", "gpt2", "phi3", "seed_oss"]


def with_dropouts(model_type: str):
    """A tiny model whose every dropout is on: the probes' training runs draw where there is one."""
    cfg = tiny_config(model_type)
    for name, value in list(vars(cfg).items()):
        if "drop" in name and isinstance(value, float):
            setattr(cfg, name, 0.1)
    return AutoModelForCausalLM.from_config(cfg)


@pytest.mark.parametrize("model_type", ARCHS)
def test_optimize_leaves_the_cpu_generator_as_it_was(model_type):
    model = with_dropouts(model_type)
    before = torch.get_rng_state()
    torchfuser.optimize(model, backend="reference")
    assert torchfuser.report(model).fused
    assert torch.equal(torch.get_rng_state(), before)


@pytest.mark.parametrize("model_type", ["gpt2", "phi3"])  # Conv1D and Linear projections, dropouts everywhere
def test_probes_draw_from_no_global_generator(model_type):
    """The guard around optimize aside: building probe layers and running them must not draw either."""
    model = with_dropouts(model_type)
    for pattern in (patterns.PATTERNS[n] for n in ("attention", "gated_mlp", "mlp", "residual_norm")):
        for name, module in model.named_modules():
            before = torch.get_rng_state()
            pattern.match(module)
            assert torch.equal(torch.get_rng_state(), before), f"{pattern.name} on {name} drew"


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_optimize_leaves_every_cuda_generator_as_it_was():
    torch.cuda.manual_seed_all(1234)  # a probe seeding with torch.manual_seed(0) would reset these to 0
    models = [with_dropouts("phi3"), with_dropouts("gpt2").cuda()]
    cpu = torch.get_rng_state()
    cuda = [torch.cuda.get_rng_state(i) for i in range(torch.cuda.device_count())]
    for model in models:
        torchfuser.optimize(model)
    assert torch.equal(torch.get_rng_state(), cpu)
    assert all(torch.equal(torch.cuda.get_rng_state(i), s) for i, s in enumerate(cuda))


@pytest.fixture
def inductor_config():
    """Inductor's config with a pass of the user's in, and no model holding torchfuser's."""
    from torch._inductor import config

    from torchfuser.compiler import inductor_pass

    def users_pass(graph):
        pass

    inductor_pass.uninstall()
    with config.patch(pre_grad_custom_pass=users_pass):
        yield SimpleNamespace(config=config, users_pass=users_pass, inductor_pass=inductor_pass)
    inductor_pass.uninstall()


def test_inductor_pass_lives_while_a_fused_model_does(inductor_config, monkeypatch):
    config, ip = inductor_config.config, inductor_config.inductor_pass
    monkeypatch.setattr(ip, "RECENT", [])  # nothing compiled yet in this process
    a, b = tiny_llama(), tiny_llama()
    torchfuser.optimize(a, backend="reference")
    torchfuser.optimize(b, backend="reference")
    torchfuser.optimize(a, backend="reference")  # held once per model
    assert ip.installed() and config.pre_grad_custom_pass.previous is inductor_config.users_pass
    # The report notes the pass once Inductor has run it (tests/test_causal_mask.py compiles for real).
    assert not any("pre-grad pass" in n for n in torchfuser.report(a).notes)
    ip.RECENT.append(ip.CompileRecord(graph_backend="inductor (pre-grad pass)"))
    assert sum("pre-grad pass" in n for n in torchfuser.report(a).notes) == 1
    assert sum("pre-grad pass" in n for n in torchfuser.report(a).notes) == 1, "said once, not once a call"
    torchfuser.restore(a)
    assert ip.installed(), "taken out while another fused model lives"
    torchfuser.restore(b)
    assert config.pre_grad_custom_pass is inductor_config.users_pass
    torchfuser.restore(b)  # a second restore lets go of nothing more
    assert config.pre_grad_custom_pass is inductor_config.users_pass


def test_inductor_pass_goes_with_a_model_collected_unrestored(inductor_config):
    model = tiny_llama()
    torchfuser.optimize(model, backend="reference")
    assert inductor_config.inductor_pass.installed()
    del model
    gc.collect()
    assert inductor_config.config.pre_grad_custom_pass is inductor_config.users_pass


def test_inductor_pass_leaves_a_default_config_as_it_was():
    from torch._inductor import config

    from torchfuser.compiler import inductor_pass

    inductor_pass.uninstall()
    before = config.pre_grad_custom_pass
    model = tiny_llama()
    torchfuser.optimize(model, backend="reference")
    assert inductor_pass.installed()
    torchfuser.restore(model)
    assert config.pre_grad_custom_pass is before


class MyFusedAttention(torch.nn.Module):  # a user's module whose name merely ends the same
    pass


@pytest.mark.parametrize("kind, ours", [
    (FusedAttention, True),
    ("torchfuser.modules.attention.FusedAttention", True),  # the qualified name, as export records it
    (MyFusedAttention, False),
    ("my_model.FusedAttention", False),
    (torch.nn.Linear, False),
])
def test_inductor_pass_matches_the_class_not_a_name_suffix(kind, ours):
    from torchfuser.compiler import inductor_pass

    node = SimpleNamespace(meta={"nn_module_stack": {"L__self__": ("layers.0.self_attn", kind)}})
    assert inductor_pass._from_fused_attention(node) is ours


def _snapshot(model):
    return [(name, m, dict(m._modules), dict(m._parameters), set(m.__dict__), m.__dict__.get("forward"))
            for name, m in model.named_modules()]


@pytest.mark.parametrize("first", [None, ["gated_mlp"]])
def test_a_swap_that_fails_halfway_leaves_the_model_as_it_was(first, monkeypatch):
    """The final norm is swapped after the layers' residual adds (deepest first): its build raising
    must put back every module and instance forward swapped before it, and keep no state."""
    model = tiny_llama()
    if first:
        torchfuser.optimize(model, backend="reference", patterns=first)
    ids = torch.randint(0, 128, (2, 8))
    with torch.no_grad():  # first: a fused module's call keeps its per-signature decisions (base.decided)
        want = model(input_ids=ids).logits
    before, st = _snapshot(model), walker.state(model)
    entries = list(st.report.entries) if st else None
    calls, build = [], RMSNormPattern.build

    def fails_on_the_last_norm(self, module, spec, backend):
        calls.append(module)
        if len(calls) == 5:  # 2 layers × 2 norms, then the final one
            raise RuntimeError("build failed")
        return build(self, module, spec, backend)

    monkeypatch.setattr(RMSNormPattern, "build", fails_on_the_last_norm)
    with pytest.raises(RuntimeError, match="build failed"):
        torchfuser.optimize(model, backend="reference", patterns=None)  # every pattern (a first call's are kept)
    assert len(calls) == 5
    assert _snapshot(model) == before
    assert walker.state(model) is st and (st is None or st.report.entries == entries)
    with torch.no_grad():
        assert torch.equal(model(input_ids=ids).logits, want)
    monkeypatch.undo()
    torchfuser.optimize(model, backend="reference", patterns=None)  # and it can be fused afterwards
    assert isinstance(model.model.norm, FusedModule)


def _backends(model) -> set:
    fused = [m for m in model.modules() if isinstance(m, FusedModule)] + [model.__dict__["forward"]]
    return {f.backend for f in fused}


def test_a_second_optimize_with_another_backend_applies_it():
    model = tiny_llama()
    torchfuser.optimize(model, backend="reference")
    assert _backends(model) == {"reference"}
    torchfuser.optimize(model, backend="auto")
    assert _backends(model) == {None}  # auto: decided per device at each call
    labels = {e.backend for e in torchfuser.report(model).fused}
    assert labels == {walker._backend_label("auto", torch.device("cpu"))}
    torchfuser.optimize(model, backend="reference")
    assert _backends(model) == {"reference"} and {e.backend for e in torchfuser.report(model).fused} == {"reference"}
    ids = torch.randint(0, 128, (2, 8))
    model(input_ids=ids, labels=ids).loss.backward()


def test_a_second_optimize_with_a_backend_that_cannot_run_changes_nothing():
    if os.environ.get("TRITON_INTERPRET") or torch.cuda.is_available():
        pytest.skip("triton can run here")
    model = tiny_llama()
    torchfuser.optimize(model, backend="reference")
    with pytest.raises(RuntimeError, match="triton"):
        torchfuser.optimize(model, backend="triton")
    assert _backends(model) == {"reference"} and walker.state(model).backend == "reference"


@pytest.mark.skipif(backends.unavailable_reason("mlir", "cpu") is not None, reason="needs torch-mlir")
def test_compiling_kernels_at_the_first_call_draws_from_no_global_generator(tmp_path, monkeypatch):
    """The MLIR backend traces each kernel on example inputs when a fused model first runs it; those
    examples come from a generator of their own, so a dropout mask drawn after the call is the one the
    unfused model draws."""
    monkeypatch.setenv("TORCHFUSER_CACHE_DIR", str(tmp_path))  # nothing cached on disk: every kernel compiles
    mlir_cache.clear_memory()
    model = torchfuser.optimize(with_dropouts("gpt2").eval(), backend="mlir")
    ids = torch.randint(0, 128, (1, 8), generator=torch.Generator().manual_seed(0))
    before = torch.get_rng_state()
    with torch.no_grad():
        model(input_ids=ids)
    assert torch.equal(torch.get_rng_state(), before)
