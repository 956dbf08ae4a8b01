"""train_step.py's unsloth variants on the CPU, where Unsloth itself cannot run (it needs CUDA): the
skip and its reason, the checkpoint and tokenizer the worker loads, and the worker process end to end
with a stand-in ``unsloth`` package (plain transformers + PEFT) that checks the arguments it is given
against the signatures of Unsloth 2026.10.9."""
from __future__ import annotations

import argparse
import json
import sys
import textwrap
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))

import train_step  # noqa: E402
import unsloth_variant  # noqa: E402

# The parameters of FastLanguageModel.from_pretrained (unsloth/models/loader.py) and of
# FastLlamaModel.get_peft_model (unsloth/models/llama.py) in unsloth 2026.10.9; from_pretrained passes
# other keywords (local_files_only) on to transformers.
FROM_PRETRAINED = {"model_name", "max_seq_length", "dtype", "load_in_4bit", "load_in_8bit", "load_in_16bit",
                   "full_finetuning", "token", "device_map", "rope_scaling", "fix_tokenizer", "trust_remote_code",
                   "use_gradient_checkpointing", "resize_model_vocab", "revision", "use_exact_model_name",
                   "offload_embedding", "float32_mixed_precision", "fast_inference", "random_state", "local_files_only"}
GET_PEFT_MODEL = {"r", "target_modules", "lora_alpha", "lora_dropout", "bias", "layers_to_transform",
                  "use_gradient_checkpointing", "random_state", "max_seq_length", "use_rslora", "modules_to_save",
                  "init_lora_weights", "loftq_config"}

FAKE_UNSLOTH = textwrap.dedent('''
    """A stand-in for Unsloth: transformers + PEFT, recording what it was asked."""
    import json, os, sys
    assert "transformers" not in sys.modules and "peft" not in sys.modules, "unsloth imported after transformers"
    FROM_PRETRAINED, GET_PEFT_MODEL = {from_pretrained!r}, {get_peft_model!r}
    CALLS = os.environ["FAKE_UNSLOTH_CALLS"]

    def _record(name, kwargs, allowed):
        unknown = set(kwargs) - allowed
        assert not unknown, f"{{name}}: no such parameter in unsloth 2026.10.9: {{sorted(unknown)}}"
        with open(CALLS, "a") as f:
            f.write(json.dumps({{"call": name, **{{k: str(v) for k, v in kwargs.items()}}}}) + "\\n")

    class FastLanguageModel:
        @staticmethod
        def from_pretrained(**kwargs):
            _record("from_pretrained", kwargs, FROM_PRETRAINED)
            from transformers import AutoModelForCausalLM, AutoTokenizer
            model = AutoModelForCausalLM.from_pretrained(kwargs["model_name"], dtype=kwargs["dtype"],
                                                         local_files_only=True)
            return model, AutoTokenizer.from_pretrained(kwargs["model_name"])

        @staticmethod
        def get_peft_model(model, **kwargs):
            _record("get_peft_model", kwargs, GET_PEFT_MODEL)
            import peft
            return peft.get_peft_model(model, peft.LoraConfig(
                r=kwargs["r"], lora_alpha=kwargs["lora_alpha"], target_modules=kwargs["target_modules"],
                lora_dropout=kwargs["lora_dropout"], bias=kwargs["bias"]))

        @staticmethod
        def for_training(model, use_gradient_checkpointing=None):
            return model.train()
''')


def _args(**overrides):
    fields = dict(models=["tiny"], device="cpu", batch=2, seq=32, workload="fixed", lora=4, grad_checkpointing=False,
                  warmup=1, steps=2, seed=0, precision="bf16", backend="auto", compiled_elementwise="inductor",
                  exclude=[], out=None, profile_dir=None)
    return argparse.Namespace(**{**fields, **overrides})


def test_the_variants_are_skipped_with_their_reason_and_the_others_run(tmp_path):
    out = tmp_path / "rows.jsonl"
    train_step.main(["--models", "tiny", "--device", "cpu", "--batch", "2", "--seq", "32", "--steps", "1",
                     "--warmup", "0", "--precision", "bf16", "--lora", "4", "--variants", "eager", "unsloth",
                     "unsloth-offload", "--out", str(out)])
    rows = {r["variant"]: r for r in map(json.loads, out.read_text().splitlines())}
    assert rows["eager"]["ms_per_step"] > 0
    assert rows["unsloth"]["skipped"] == rows["unsloth-offload"]["skipped"] == "Unsloth needs a CUDA GPU"
    assert set(unsloth_variant.VARIANTS) <= set(train_step.VARIANTS)


def test_skip_reasons():
    from transformers import GPT2Config, LlamaConfig

    cuda = torch.device("cuda")
    assert "--lora" in unsloth_variant.skip_reason(LlamaConfig(), _args(lora=0), cuda)
    assert "--precision bf16" in unsloth_variant.skip_reason(LlamaConfig(), _args(precision="autocast"), cuda)
    assert "gpt2" in unsloth_variant.skip_reason(GPT2Config(), _args(), cuda)


def test_the_tokenizer_covers_the_whole_vocabulary(tmp_path):
    from transformers import AutoTokenizer

    unsloth_variant.write_tokenizer(1024, tmp_path)
    tok = AutoTokenizer.from_pretrained(str(tmp_path))
    assert len(tok) == 1024 and tok.pad_token_id == 3 and tok.eos_token_id == 2
    assert tok("t4 t1023", add_special_tokens=False)["input_ids"] == [4, 1023]


def test_the_checkpoint_holds_the_weights_every_variant_starts_from():
    from transformers import AutoModelForCausalLM

    args = _args(seq=4096)
    try:
        folder, losses = unsloth_variant.prepare_checkpoint("tiny", args, torch.device("cpu"), train_step.build,
                                                            train_step.run_batches)
        saved = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.bfloat16)
        built = train_step.build("tiny", torch.device("cpu"), args.seed, torch.bfloat16)
        for (name, a), (_, b) in zip(saved.state_dict().items(), built.state_dict().items(), strict=True):
            assert torch.equal(a, b), name
        # Unsloth truncates rows past max_seq_length and rescales RoPE past max_position_embeddings.
        assert saved.config.max_position_embeddings >= 4096
    finally:
        unsloth_variant.cleanup()
    assert abs(losses["peft_eager_bf16"] - losses["reference_fp32"]) < 0.05
    assert unsloth_variant.parity(losses["peft_eager_bf16"], losses)["within_rule"]
    assert not unsloth_variant.parity(losses["reference_fp32"] + 0.5, losses)["within_rule"]


def test_the_worker_trains_the_loaded_model_in_its_own_process(tmp_path, monkeypatch):
    fake = tmp_path / "fake" / "unsloth"
    fake.mkdir(parents=True)
    (fake / "__init__.py").write_text(FAKE_UNSLOTH.format(from_pretrained=FROM_PRETRAINED, get_peft_model=GET_PEFT_MODEL))
    calls = tmp_path / "calls.jsonl"
    monkeypatch.setenv("PYTHONPATH", f"{fake.parent}:{Path(__file__).resolve().parents[1]}")
    monkeypatch.setenv("FAKE_UNSLOTH_CALLS", str(calls))
    try:
        row = unsloth_variant.run_isolated("tiny", "unsloth-offload", _args(), torch.device("cpu"), train_step.build,
                                           train_step.run_batches)
    finally:
        unsloth_variant.cleanup()
    assert "error" not in row, row
    assert row["variant"] == "unsloth-offload" and row["ms_per_step"] > 0 and row["grad_checkpointing"] == "unsloth"
    assert row["trained_parameters"] > 0 and row["lora"] == 4
    first = row["loss_first_step"]
    assert set(first) == {"unsloth", "peft_eager_bf16", "reference_fp32"}
    assert abs(first["unsloth"] - first["peft_eager_bf16"]) < 1e-3  # the same weights, batch and math
    assert row["loss_parity"]["within_rule"]
    made = {c["call"]: c for c in map(json.loads, calls.read_text().splitlines())}
    load, peft = made["from_pretrained"], made["get_peft_model"]
    assert load["load_in_4bit"] == "False" and load["dtype"] == "torch.bfloat16"
    assert load["use_gradient_checkpointing"] == peft["use_gradient_checkpointing"] == "unsloth"
    assert int(load["max_seq_length"]) >= 512  # else Unsloth swaps its offloading for plain checkpointing
    assert (peft["r"], peft["lora_alpha"], peft["lora_dropout"], peft["bias"]) == ("4", "8", "0.0", "none")
    assert peft["target_modules"] == str(unsloth_variant.TARGETS)
