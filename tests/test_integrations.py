"""The Hugging Face Trainer callback and the command line."""
from __future__ import annotations

import json

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM

import torchfuser
from torchfuser import cli
from torchfuser.modules import FusedRMSNorm


def _tiny_cfg():
    return LlamaConfig(hidden_size=32, intermediate_size=48, num_hidden_layers=2, num_attention_heads=4,
                       num_key_value_heads=2, vocab_size=64, attn_implementation="sdpa")


def test_trainer_callback_fuses_trains_and_checkpoint_loads_into_plain_transformers(tmp_path, capsys):
    pytest.importorskip("accelerate")
    from transformers import Trainer, TrainingArguments

    torch.manual_seed(0)
    model = LlamaForCausalLM(_tiny_cfg())
    params_before = [id(p) for p in model.parameters()]
    data = [{"input_ids": ids, "labels": ids} for ids in torch.randint(0, 64, (8, 12))]
    args = TrainingArguments(output_dir=str(tmp_path), per_device_train_batch_size=4, max_steps=2, save_steps=2,
                             logging_steps=1, report_to=[], use_cpu=True)
    callback = torchfuser.TorchFuserCallback(backend="reference")
    trainer = Trainer(model=model, args=args, train_dataset=data, callbacks=[callback])
    assert isinstance(model.model.norm, FusedRMSNorm)  # fused at Trainer init, before any step
    assert callback.report is not None and callback.report.fused
    assert "LlamaForCausalLM: 12 blocks fused" in capsys.readouterr().out  # where the user sees it
    trainer.train()
    assert [id(p) for p in model.parameters()] == params_before  # the optimizer kept valid references
    reloaded = LlamaForCausalLM.from_pretrained(tmp_path / "checkpoint-2")
    assert not any(isinstance(m, FusedRMSNorm) for m in reloaded.modules())
    ids = torch.randint(0, 64, (2, 10))
    model.eval()
    with torch.no_grad():
        torch.testing.assert_close(reloaded(input_ids=ids).logits, model(input_ids=ids).logits, rtol=1e-5, atol=1e-5)


def test_trainer_callback_fuses_every_model_its_model_init_builds(tmp_path):
    """A Trainer with model_init builds a model in __init__ and a new one at each train() (and trial)."""
    pytest.importorskip("accelerate")
    from transformers import Trainer, TrainingArguments

    built = []

    def model_init():
        built.append(LlamaForCausalLM(_tiny_cfg()))
        return built[-1]

    data = [{"input_ids": ids, "labels": ids} for ids in torch.randint(0, 64, (4, 12))]
    args = TrainingArguments(output_dir=str(tmp_path), per_device_train_batch_size=4, max_steps=1, save_strategy="no",
                             report_to=[], use_cpu=True)
    callback = torchfuser.TorchFuserCallback(backend="reference")
    trainer = Trainer(model_init=model_init, args=args, train_dataset=data, callbacks=[callback])
    trainer.train()
    trainer.train()
    assert len(built) == 3 and trainer.model is built[-1]
    assert all(isinstance(m.model.norm, FusedRMSNorm) for m in built)
    assert callback.report is torchfuser.report(built[-1])


def test_trainer_callback_leaves_a_wrapper_of_the_fused_model():
    """With FSDP the Trainer's model at train begin is the wrapper around the model fused at init."""
    from types import SimpleNamespace

    from torch import nn

    from torchfuser import walker

    args = SimpleNamespace(n_gpu=1, local_rank=-1)
    callback = torchfuser.TorchFuserCallback(backend="reference")
    model = LlamaForCausalLM(_tiny_cfg())
    callback.on_init_end(args, None, None, model=model)
    first = callback.report
    wrapper = nn.ModuleDict({"module": model})
    callback.on_train_begin(args, None, None, model=wrapper)
    assert callback.report is first and walker.state(wrapper) is None


def test_inspect_model_type(capsys):
    assert cli.main(["inspect", "llama", "--json"]) == 0
    data = json.loads(capsys.readouterr().out)
    assert data["model_type"] == "llama" and data["model_class"] == "LlamaForCausalLM"
    assert data["counts"]["rms_norm"]["fused"] == 65  # 32 layers × 2 + final norm, built on meta
    assert data["counts"]["gated_mlp"]["fused"] == 32


@pytest.mark.parametrize("model_type", ["opt", "cohere"])
def test_inspect_lm_head_on_the_meta_device(model_type, capsys, caplog):
    """The LM head's logit transform is probed on the model's own forward: on the meta device OPT moves
    the logits there (nothing to measure: the config decides), Cohere's scale is measured."""
    with caplog.at_level("WARNING", logger="torchfuser"):
        assert cli.main(["inspect", model_type, "--json"]) == 0
    data = json.loads(capsys.readouterr().out)
    assert data["counts"]["lm_head_loss"] == {"fused": 1, "skipped": 0}
    assert "pattern failed" not in caplog.text


def test_inspect_config_json(tmp_path, capsys):
    path = tmp_path / "config.json"
    path.write_text(json.dumps({"model_type": "qwen2", "num_hidden_layers": 2, "hidden_size": 64,
                                "intermediate_size": 128, "num_attention_heads": 4, "num_key_value_heads": 2}))
    assert cli.main(["inspect", str(path)]) == 0
    out = capsys.readouterr().out
    assert "Qwen2ForCausalLM" in out and "rms_norm" in out


@pytest.mark.parametrize("arg, words", [("not-a-model", "neither a checkpoint directory"),
                                        ("missing.json", "no such file or directory")])
def test_inspect_bad_target(arg, words, capsys):
    assert cli.main(["inspect", arg]) == 2
    assert words in capsys.readouterr().err


@pytest.mark.parametrize("backend", ["reference", "auto"])
def test_demo_runs_and_reports_parity(backend):
    """The demo counts saved activations with saved-tensor hooks: every backend must run under them."""
    from rich.console import Console

    from torchfuser import demo

    console = Console(record=True, width=120)
    results = demo.run(device="cpu", steps=4, backend=backend, console=console)
    text = console.export_text()
    assert "loss parity" in text and "step time" in text
    eager, fused = results["eager"]["losses"], results["torchfuser"]["losses"]
    assert len(eager) == 4 and max(abs(a - b) for a, b in zip(eager, fused)) < 1e-3


def test_callback_warns_that_data_parallel_replicas_run_without_graphs(caplog):
    from types import SimpleNamespace

    cfg = LlamaConfig(hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
                      num_key_value_heads=2, vocab_size=128)
    for gpus, local_rank, warned in ((2, -1, True), (1, -1, False), (2, 0, False)):
        caplog.clear()
        callback = torchfuser.TorchFuserCallback(backend="reference", cuda_graphs=True)
        with caplog.at_level("WARNING", logger="torchfuser"):
            callback.on_init_end(SimpleNamespace(n_gpu=gpus, local_rank=local_rank), None, None, model=LlamaForCausalLM(cfg))
        assert ("nn.DataParallel" in caplog.text) == warned, (gpus, local_rank)


@pytest.mark.parametrize("fields, words", [
    # Ministral's config leaves head_dim None and its attention's __init__ raises a TypeError.
    ({"model_type": "ministral", "hidden_size": 64, "num_attention_heads": 4}, "transformers could not build 'ministral'"),
    ({"model_type": "llama", "hidden_size": 64, "head_dim": "x"}, "is not a valid transformers config"),
])
def test_inspect_config_transformers_cannot_build(tmp_path, fields, words, capsys):
    cfg = tmp_path / "config.json"
    cfg.write_text(json.dumps(fields))
    assert cli.main(["inspect", str(cfg)]) == 2
    assert words in capsys.readouterr().err


def _callback_args(tmp_path, **kw):
    pytest.importorskip("accelerate")
    from transformers import TrainingArguments

    return TrainingArguments(output_dir=str(tmp_path), report_to=[], use_cpu=True, **kw)


def test_trainer_callback_prints_its_report_once_on_the_main_process(tmp_path, capsys):
    from types import SimpleNamespace

    args = _callback_args(tmp_path)
    callback = torchfuser.TorchFuserCallback(backend="reference")
    callback.on_init_end(args, SimpleNamespace(is_world_process_zero=True), None, model=LlamaForCausalLM(_tiny_cfg()))
    out = capsys.readouterr().out
    assert "LlamaForCausalLM: 12 blocks fused" in out and "model.layers.*.mlp" in out  # the table, not the summary alone
    callback.on_train_begin(args, SimpleNamespace(is_world_process_zero=True), None, model=LlamaForCausalLM(_tiny_cfg()))
    assert capsys.readouterr().out == ""  # model_init's next model fuses alike: nothing new to say
    other = torchfuser.TorchFuserCallback(backend="reference")
    other.on_init_end(args, SimpleNamespace(is_world_process_zero=False), None, model=LlamaForCausalLM(_tiny_cfg()))
    assert other.report is not None and capsys.readouterr().out == ""  # fused on every process, printed on one


@pytest.mark.parametrize("callback_kw, args_kw", [({"verbose": False}, {}), ({}, {"log_level": "error"})])
def test_trainer_callback_report_can_be_silenced(tmp_path, capsys, callback_kw, args_kw):
    callback = torchfuser.TorchFuserCallback(backend="reference", **callback_kw)
    callback.on_init_end(_callback_args(tmp_path, **args_kw), None, None, model=LlamaForCausalLM(_tiny_cfg()))
    assert callback.report.fused and capsys.readouterr().out == ""
