"""A second ``optimize`` on a model keeps every setting it is not passed, and applies the ones it is:
backend, FP8 (recipe, LM head, weight copies), CUDA graphs, autotune, and the selection of blocks
(patterns / exclude / filter_fn). ``TorchFuserCallback()`` calls optimize on a model the user may have
optimized already: it must not undo the user's choices."""
from __future__ import annotations

import copy
import functools
import io

import pytest
import torch
from transformers import LlamaForCausalLM

import torchfuser
from test_optimize import loss_and_grads, tiny_llama
from torchfuser import autotune, cuda_graphs, settings, walker
from torchfuser.modules import fp8
from torchfuser.modules.fp8 import step as fp8_step
from torchfuser.modules.base import FusedModule
from torchfuser.modules.mlp import FusedGatedMLP
from torchfuser.modules.norms import FusedRMSNorm

FP8_KINDS = ("attention", "gated_mlp")


def _fused(model):
    return [m for m in model.modules() if isinstance(m, FusedModule)] + [model.__dict__["forward"]]


def _tree(model):
    return [(n, m) for n, m in model.named_modules()] + [(n, m.__dict__.get("forward")) for n, m in model.named_modules()]


def _fp8_flags(model):
    """{fused block: (its recipe, per-step copies)} and the LM head's recipe."""
    rep = torchfuser.report(model)
    blocks = {e.name: (model.get_submodule(e.name).__dict__.get("_fp8"),
                       model.get_submodule(e.name).__dict__.get("_fp8_per_step", False))
              for e in rep.fused if e.pattern in FP8_KINDS}
    return blocks, model.__dict__["forward"].fp8


def _ids(seed=1):
    return torch.randint(0, 128, (2, 16), generator=torch.Generator().manual_seed(seed))


def _weight_quantisations(model, monkeypatch) -> int:
    made = []
    real = fp8._both
    monkeypatch.setattr(fp8, "_both", lambda weights, recipe: made.append(len(weights)) or real(weights, recipe))
    with torch.autocast("cpu", dtype=torch.bfloat16):
        model(input_ids=_ids(), labels=_ids()).loss.backward()
    monkeypatch.setattr(fp8, "_both", real)
    return len(made)


def test_a_second_call_without_arguments_changes_nothing():
    model = torchfuser.optimize(tiny_llama(), backend="reference")
    tree, text = _tree(model), str(torchfuser.report(model))
    torchfuser.optimize(model)
    assert {f.backend for f in _fused(model)} == {"reference"}  # was reset to auto (None)
    assert walker.state(model).backend == "reference"
    assert _tree(model) == tree and str(torchfuser.report(model)) == text


def test_a_second_call_keeps_fp8_its_head_and_per_step_copies(monkeypatch):
    model = torchfuser.optimize(tiny_llama(), backend="reference", fp8="rowwise", fp8_lm_head=True,
                                fp8_weights="per_step")
    flags, notes = _fp8_flags(model), list(torchfuser.report(model).notes)
    assert set(flags[0].values()) == {("rowwise", True)} and flags[1] == "rowwise"
    torchfuser.optimize(model)
    assert _fp8_flags(model) == flags  # FP8 was turned off, the head bf16, per_step dropped
    assert id(model) in fp8_step._holders  # the optimizer-step hook still held for the kept copies
    assert torchfuser.report(model).notes == notes
    assert _weight_quantisations(model, monkeypatch) > 0  # the projections really run FP8
    torchfuser.restore(model)
    assert id(model) not in fp8_step._holders


def test_fp8_passed_to_a_second_call_applies_and_none_turns_it_all_off():
    model = torchfuser.optimize(tiny_llama(), backend="reference", fp8="rowwise", fp8_lm_head=True,
                                fp8_weights="per_step")
    torchfuser.optimize(model, fp8="tensorwise")  # the head and the copies follow the recipe
    blocks, head = _fp8_flags(model)
    assert set(blocks.values()) == {("tensorwise", True)} and head == "tensorwise"
    torchfuser.optimize(model, fp8_lm_head=False)
    assert _fp8_flags(model)[1] is None and set(_fp8_flags(model)[0].values()) == {("tensorwise", True)}
    torchfuser.optimize(model, fp8=None)  # off, and what refines it back to its defaults
    blocks, head = _fp8_flags(model)
    assert set(blocks.values()) == {(None, False)} and head is None
    assert id(model) not in fp8_step._holders
    assert not any(n.startswith("fp8: ") for n in torchfuser.report(model).notes)
    assert settings.of(model).fp8_weights == "per_call" and not settings.of(model).fp8_lm_head


def test_a_kept_fp8_head_that_a_new_recipe_cannot_take_raises_and_changes_nothing():
    model = torchfuser.optimize(tiny_llama(), backend="reference", fp8="rowwise", fp8_lm_head=True)
    flags = _fp8_flags(model)
    with pytest.raises(ValueError, match=r"fp8_lm_head=True \(kept from the earlier optimize call"):
        torchfuser.optimize(model, fp8="blockwise")
    assert _fp8_flags(model) == flags
    torchfuser.optimize(model, fp8="blockwise", fp8_lm_head=False)  # said together, it applies
    assert _fp8_flags(model)[1] is None and settings.of(model).fp8 == "blockwise"


def test_a_second_call_keeps_cuda_graph_options_on_the_cpu():
    """On the CPU no graphs are installed (the report says why); the option itself is kept."""
    options = torchfuser.GraphOptions(max_buckets=2)
    model = torchfuser.optimize(tiny_llama(), backend="reference", cuda_graphs=options)
    notes = [n for n in torchfuser.report(model).notes if n.startswith("cuda graphs")]
    assert notes and "the model is on cpu" in notes[0]
    torchfuser.optimize(model)
    assert settings.of(model).cuda_graphs is options
    assert [n for n in torchfuser.report(model).notes if n.startswith("cuda graphs")] == notes
    torchfuser.optimize(model, cuda_graphs=True)  # on, as it is: the options set earlier stay
    assert settings.of(model).cuda_graphs is options
    torchfuser.optimize(model, cuda_graphs=False)
    assert settings.of(model).cuda_graphs is False
    assert not any(n.startswith("cuda graphs") for n in torchfuser.report(model).notes)


def _stacks(model):
    return model.__dict__.get(cuda_graphs._ATTR)


def test_a_second_call_keeps_the_installed_graphs_and_applies_new_options(monkeypatch):
    """The install path on the CPU, let through the CUDA check: an unchanged second call keeps the very
    stacks (with what they captured); new options, a new backend or newly fused blocks capture anew."""
    monkeypatch.setattr(cuda_graphs, "_unsupported", lambda model, layers: None)
    options = torchfuser.GraphOptions(max_buckets=2)
    model = torchfuser.optimize(tiny_llama(), backend="reference", exclude=["gated_mlp"], cuda_graphs=options)
    stacks = _stacks(model)
    stacks[0].sets["captured"] = object()  # stands in for a captured set of graphs
    torchfuser.optimize(model)
    assert _stacks(model) is stacks and stacks[0].sets  # same graphs, nothing recaptured
    assert all(isinstance(layer.__dict__["forward"], functools.partial) for layer in model.model.layers)
    torchfuser.optimize(model, cuda_graphs=True)
    assert _stacks(model) is stacks
    torchfuser.optimize(model, cuda_graphs=torchfuser.GraphOptions(max_buckets=3))
    assert _stacks(model) is not stacks and _stacks(model)[0].options.max_buckets == 3
    assert not stacks[0].sets  # the old graphs' memory let go
    stacks = _stacks(model)
    torchfuser.optimize(model, exclude=())  # the MLPs fused now, inside the graphed layers: capture anew
    assert isinstance(model.model.layers[0].mlp, FusedGatedMLP)
    assert _stacks(model) is not stacks and _stacks(model)[0].options.max_buckets == 3
    torchfuser.optimize(model, cuda_graphs=False)
    assert _stacks(model) is None
    assert all(type(layer.__dict__["forward"]).__name__ == "ResidualNormForward" for layer in model.model.layers)
    assert not any(n.startswith("cuda graphs") for n in torchfuser.report(model).notes)


def _tuned(model):
    return [h for m in model.modules() for h in m._forward_pre_hooks.values() if isinstance(h, autotune._Tuner)]


def test_a_second_call_keeps_autotune_on_and_off_turns_it_off():
    model = torchfuser.optimize(tiny_llama(), backend="reference", autotune=True)
    tuners = _tuned(model)
    assert tuners
    torchfuser.optimize(model)
    assert _tuned(model) == tuners  # the same pending tuners, not taken out
    torchfuser.optimize(model, autotune=False)
    assert not _tuned(model) and autotune._HOOKS not in model.__dict__
    assert not any(n.startswith(autotune.UNTIMED) for n in torchfuser.report(model).notes)


def test_patterns_and_exclude_are_kept_and_a_narrower_selection_restores_what_it_leaves_out():
    model = tiny_llama()
    originals = dict(model.named_modules())
    torchfuser.optimize(model, backend="reference", exclude=["lm_head_loss"])
    torchfuser.optimize(model)  # the exclusion is kept: the LM head stays as it is
    assert "forward" not in model.__dict__
    assert "lm_head_loss" not in torchfuser.report(model).counts()
    torchfuser.optimize(model, exclude=())  # passed: everything selected, the head fused now
    assert "forward" in model.__dict__
    torchfuser.optimize(model, patterns=["rms_norm"])  # narrower: fused afresh with the norms alone
    assert torchfuser.report(model).counts() == {"rms_norm": {"fused": 5, "skipped": 0}}
    mlp, attn = model.model.layers[0].mlp, model.model.layers[0].self_attn
    assert mlp is originals["model.layers.0.mlp"] and attn is originals["model.layers.0.self_attn"]
    assert "forward" not in model.__dict__ and "forward" not in model.model.layers[0].__dict__
    assert {f.backend for f in model.modules() if isinstance(f, FusedModule)} == {"reference"}  # kept
    (loss, grads), (want, want_grads) = loss_and_grads(model, _ids()), loss_and_grads(tiny_llama(), _ids())
    torch.testing.assert_close(loss, want, rtol=1e-5, atol=1e-6)
    torchfuser.restore(model)
    assert all(originals[n] is m for n, m in model.named_modules())


def _not_layer(i):
    return lambda module, fqn: not fqn.startswith(f"model.layers.{i}.") and fqn != f"model.layers.{i}"


def test_filter_fn_is_kept_none_drops_it_and_a_new_one_applies():
    model = tiny_llama()
    torchfuser.optimize(model, backend="reference", filter_fn=_not_layer(0))
    layers = model.model.layers
    torchfuser.optimize(model)  # kept: layer 0 stays as it is
    assert not isinstance(layers[0].mlp, FusedGatedMLP) and isinstance(layers[1].mlp, FusedGatedMLP)
    torchfuser.optimize(model, filter_fn=_not_layer(1))  # applies: layer 1 back, layer 0 fused
    assert isinstance(layers[0].mlp, FusedGatedMLP) and not isinstance(layers[1].mlp, FusedGatedMLP)
    assert not isinstance(layers[1].input_layernorm, FusedRMSNorm) and "forward" not in layers[1].__dict__
    torchfuser.optimize(model, filter_fn=None)  # no filter any more: everything
    assert isinstance(layers[1].mlp, FusedGatedMLP) and not torchfuser.report(model).skipped


def _refuse_layer_0(module, fqn):  # module level: pickled by name
    return not fqn.startswith("model.layers.0")


def test_a_model_saved_whole_keeps_a_filter_that_pickles_and_refuses_new_blocks_without_one():
    for fn, kept in ((_refuse_layer_0, True), (_not_layer(0), False)):
        model = torchfuser.optimize(tiny_llama(), backend="reference", filter_fn=fn)
        buf = io.BytesIO()
        torch.save(model, buf)
        buf.seek(0)
        loaded = torch.load(buf, weights_only=False)
        got = settings.of(loaded).filter_fn
        assert (got is fn) if kept else isinstance(got, settings.RefuseNew)
        torchfuser.optimize(loaded)
        assert not isinstance(loaded.model.layers[0].mlp, FusedGatedMLP)  # refused as before, either way
        assert isinstance(loaded.model.layers[1].mlp, FusedGatedMLP)
    assert copy.deepcopy(model).__dict__[settings.KEY].filter_fn is settings.of(model).filter_fn


def test_restore_forgets_the_settings():
    model = torchfuser.optimize(tiny_llama(), backend="reference", exclude=["lm_head_loss"])
    torchfuser.restore(model)
    assert settings.of(model) is None
    torchfuser.optimize(model)  # a first call again: the defaults
    assert "forward" in model.__dict__ and walker.state(model).backend == "auto"


def test_the_trainer_callback_keeps_what_the_user_chose(tmp_path):
    """The user optimizes, then hands the model to a Trainer with TorchFuserCallback(): the callback's
    optimize passes nothing, so the backend, FP8 and the user's exclusion stay."""
    pytest.importorskip("accelerate")
    from transformers import Trainer, TrainingArguments

    model = torchfuser.optimize(tiny_llama(), backend="reference", fp8="rowwise", exclude=["lm_head_loss"])
    flags = {n: model.get_submodule(n).__dict__.get("_fp8") for n in ("model.layers.0.mlp", "model.layers.0.self_attn")}
    data = [{"input_ids": ids, "labels": ids} for ids in torch.randint(0, 128, (4, 12))]
    args = TrainingArguments(output_dir=str(tmp_path), per_device_train_batch_size=2, max_steps=1,
                             save_strategy="no", report_to=[], use_cpu=True, bf16=True)
    callback = torchfuser.TorchFuserCallback(verbose=False)
    trainer = Trainer(model=model, args=args, train_dataset=data, callbacks=[callback])
    assert callback.report is not None
    assert {f.backend for f in model.modules() if isinstance(f, FusedModule)} == {"reference"}
    assert flags == {"model.layers.0.mlp": "rowwise", "model.layers.0.self_attn": "rowwise"}
    assert {n: model.get_submodule(n).__dict__.get("_fp8") for n in flags} == flags
    assert "forward" not in model.__dict__  # the user's exclusion
    trainer.train()
    assert isinstance(model, LlamaForCausalLM) and settings.of(model).fp8 == "rowwise"


@pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA graphs need a CUDA device")
def test_a_second_call_keeps_the_captured_graphs_on_a_gpu():
    """What TorchFuserCallback does to a graphed model at train begin: nothing recaptured, the same
    replays, the same losses as a model optimized once."""
    from test_cuda_graphs import _step, tiny_llama as llama

    once, twice = (torchfuser.optimize(llama("cuda"), cuda_graphs=True) for _ in range(2))
    ids = torch.randint(0, 128, (2, 24), device="cuda", generator=torch.Generator("cuda").manual_seed(3))
    for _ in range(3):
        _step(once, ids)
        _step(twice, ids)
    stack = _stacks(twice)[0]
    captures, sets = stack.captures, dict(stack.sets)
    assert captures and sets
    torchfuser.optimize(twice)
    assert _stacks(twice)[0] is stack and stack.sets == sets
    for _ in range(2):
        (loss, grads), (want, want_grads) = _step(twice, ids), _step(once, ids)
        torch.testing.assert_close(loss, want)
    assert stack.captures == captures and stack.replays > 0  # replayed what it had captured


def test_a_call_passing_no_selection_keeps_the_blocks_of_a_pattern_unregistered_since():
    """unregister_pattern: models fused already keep their fused blocks until restore, also through a
    second optimize that passes no patterns / exclude / filter_fn."""
    from torchfuser.patterns import PATTERNS, register_pattern, unregister_pattern

    model = torchfuser.optimize(tiny_llama(), backend="reference")
    at = list(PATTERNS).index("gated_mlp")
    pattern = unregister_pattern("gated_mlp")
    try:
        torchfuser.optimize(model)
        assert isinstance(model.model.layers[0].mlp, FusedGatedMLP)
    finally:
        register_pattern(pattern, before=list(PATTERNS)[at])
