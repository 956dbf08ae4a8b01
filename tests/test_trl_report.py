"""The report tells which LM head runs. TRL's SFTTrainer and DPOTrainer put their own fused LM head on the
model's forward after TorchFuserCallback ran (``trl.trainer.utils.add_fused_lm_head``), so TorchFuser's
fused LM head + loss is never called: the report and the callback's printout must say that TRL's head
runs, not "fused". A trainer that computes its loss without passing labels bypasses it too (no call in
a training step). The plain path still reports it fused, with its calls counted."""
from __future__ import annotations

import logging
import types

import pytest
import torch

import torchfuser
from test_trl import TEXT, _model, _sft, _tokenizer
from torchfuser import walker
from torchfuser.modules.lm_head import FusedLMHeadLoss

trl = pytest.importorskip("trl")
datasets = pytest.importorskip("datasets")


def _head(rep):
    return next(e for e in rep.entries if e.pattern == "lm_head_loss")


def _fused_head(model):
    """The fused LM head + loss optimize installed (wrapped since, or not)."""
    return next(a.undo.fused for a in walker.state(model).undo if isinstance(getattr(a.undo, "fused", None), FusedLMHeadLoss))


def _says_trl_runs(trainer, capsys, caplog):
    rep = torchfuser.report(trainer.model)
    head = _head(rep)
    assert not head.is_fused and head.reason.startswith("bypassed — TRL's fused_lm_head wrapper"), head
    assert "(0 fused calls)" in head.reason
    assert "lm_head_loss 0 (+1 skipped)" in rep.summary()
    assert any(n.startswith("lm_head_loss: bypassed — TRL's") for n in rep.notes)
    out = capsys.readouterr().out
    assert "bypassed — TRL's fused_lm_head" in " ".join(out.split())  # printed again once TRL's head is on
    assert any("bypassed — TRL's" in r.getMessage() for r in caplog.records if r.levelno == logging.WARNING)
    callback = next(c for c in trainer.callback_handler.callbacks if isinstance(c, torchfuser.TorchFuserCallback))
    assert callback.report.summary() == rep.summary()


def test_sft_trainer_report_says_trls_head_runs(tmp_path, capsys, caplog):
    caplog.set_level(logging.WARNING, logger="torchfuser")
    _, trainer = _sft(tmp_path, True, steps=2)
    _says_trl_runs(trainer, capsys, caplog)
    assert _fused_head(trainer.model).calls.n == 0  # the fused head really never ran


def test_dpo_trainer_report_says_trls_head_runs(tmp_path, capsys, caplog):
    caplog.set_level(logging.WARNING, logger="torchfuser")
    model = _model()
    args = trl.DPOConfig(output_dir=str(tmp_path), max_steps=2, per_device_train_batch_size=2, learning_rate=1e-3,
                         logging_steps=1, save_strategy="no", report_to=[], use_cpu=True, bf16=False,
                         disable_tqdm=True, dataset_num_proc=1, max_length=64)
    data = datasets.Dataset.from_dict({"prompt": TEXT[:4] * 2, "chosen": TEXT[4:] * 2, "rejected": TEXT[4:][::-1] * 2})
    trainer = trl.DPOTrainer(model=model, ref_model=_model(), args=args, train_dataset=data,
                             processing_class=_tokenizer(), callbacks=[torchfuser.TorchFuserCallback(backend="reference")])
    trainer.train()
    _says_trl_runs(trainer, capsys, caplog)
    assert _fused_head(model).calls.n == 0


def test_optimize_after_trls_head_is_on_leaves_the_head_to_it():
    """optimize on a model TRL already gave its head: the fused loss would wrap TRL's and never run (or
    break its fused_lm_head calls), so the head is skipped with the reason and TRL's calls work."""
    from trl.trainer.utils import add_fused_lm_head

    model = _model()
    add_fused_lm_head(model)
    torchfuser.optimize(model, backend="reference")
    head = _head(torchfuser.report(model))
    assert not head.is_fused and "TRL's fused LM head" in head.reason
    ids = torch.randint(4, 60, (2, 12))
    model(input_ids=ids, labels=ids, fused_lm_head=True).loss.backward()


def test_trls_head_is_found_under_accelerates_mixed_precision_wrapper():
    """A trainer with bf16 prepares a fully fine-tuned model with accelerate, whose mixed-precision wrapper sits over
    TRL's head (GRPO on the H200 was reported "the model's own head runs"): both the report of a fused head and
    optimize's check look through wrappers that keep ``__wrapped__``."""
    from accelerate.utils import convert_outputs_to_fp32
    from trl.trainer.utils import add_fused_lm_head

    def prepared(model):  # what accelerate's prepare_model does with mixed_precision="bf16" (its state is process-wide)
        add_fused_lm_head(model)
        autocast = torch.autocast("cpu", dtype=torch.bfloat16)(model.forward.__func__)
        model.forward = types.MethodType(convert_outputs_to_fp32(autocast), model)
        return model

    model = prepared(torchfuser.optimize(_model(), backend="reference"))  # optimize, then the trainer's set-up
    fused = _fused_head(model)
    fused.idle_steps = 1  # as TorchFuserCallback records a training step without a fused call
    head = _head(torchfuser.report(model))
    assert not head.is_fused and head.reason.startswith("bypassed — TRL's fused_lm_head wrapper"), head.reason

    model = torchfuser.optimize(prepared(_model()), backend="reference")  # the trainer's set-up, then optimize
    head = _head(torchfuser.report(model))
    assert not head.is_fused and "TRL's fused LM head" in head.reason, head.reason


def test_the_plain_path_reports_fused_with_its_calls_counted():
    model = torchfuser.optimize(_model(), backend="reference")
    assert any(n.startswith("lm_head_loss: 0 fused calls so far") for n in torchfuser.report(model).notes)
    ids = torch.randint(4, 60, (2, 12))
    for _ in range(3):
        model(input_ids=ids, labels=ids).loss.backward()
    model(input_ids=ids)  # no labels: the original forward, not counted
    rep = torchfuser.report(model)
    assert _head(rep).is_fused and "lm_head_loss 1" in rep.summary()
    assert any(n.startswith("lm_head_loss: 3 fused calls so far") for n in rep.notes), rep.notes


def _trainer(tmp_path, model, cls=None):
    pytest.importorskip("accelerate")
    from transformers import Trainer, TrainingArguments

    data = [{"input_ids": ids, "labels": ids} for ids in torch.randint(4, 60, (8, 12))]
    args = TrainingArguments(output_dir=str(tmp_path), per_device_train_batch_size=2, max_steps=2,
                             gradient_accumulation_steps=2, save_strategy="no", report_to=[], use_cpu=True)
    return (cls or Trainer)(model=model, args=args, train_dataset=data,
                            callbacks=[torchfuser.TorchFuserCallback(backend="reference", verbose=False)])


def test_the_trainer_callback_counts_the_fused_heads_calls(tmp_path):
    model = _model()
    trainer = _trainer(tmp_path, model)
    trainer.train()
    rep = torchfuser.report(model)
    assert _head(rep).is_fused and any(n.startswith("lm_head_loss: 4 fused calls so far") for n in rep.notes)
    assert _fused_head(model).calls.n == 4  # 2 steps × 2 micro-batches


def test_a_trainer_whose_loss_bypasses_the_model_head_is_found_out(tmp_path, caplog):
    """A trainer computing its loss from the logits, the model called without labels: no fused call in
    a training step, and the report says the model's own head and the trainer's loss run."""
    from transformers import Trainer

    class OwnLoss(Trainer):
        def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
            labels = inputs.pop("labels")
            logits = model(**inputs).logits
            loss = torch.nn.functional.cross_entropy(logits[:, :-1].flatten(0, 1), labels[:, 1:].flatten())
            return (loss, logits) if return_outputs else loss

    caplog.set_level(logging.WARNING, logger="torchfuser")
    model = _model()
    trainer = _trainer(tmp_path, model, OwnLoss)
    trainer.train()
    head = _head(torchfuser.report(model))
    assert not head.is_fused and head.reason.startswith("bypassed — 0 fused calls in 1 training step"), head
    assert any("bypassed — 0 fused calls" in r.getMessage() for r in caplog.records)
