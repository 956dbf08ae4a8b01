"""FP8 weight copies never go stale: every way a weight can be written is seen by the next call.

``param.data`` has a version counter of its own, so a write through it (``.data.copy_``, EMA and weight
averaging, ``vector_to_parameters``, PEFT's ``merge_adapter`` on the frozen bases) moves neither the
parameter's ``_version`` nor its ``data_ptr``. Under the default ``fp8_weights="per_call"`` every weight,
frozen or not, is quantised at every call; under ``"per_step"`` a kept copy (frozen or not) lasts until the
next optimizer step or a version / storage change. Each check compares against the same model with its
copies dropped (what a fresh quantisation gives), bit for bit."""
from __future__ import annotations

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM

import torchfuser
from torchfuser.modules import fp8

CFG = dict(vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
           num_key_value_heads=2)
IDS = torch.randint(0, 128, (2, 16), generator=torch.Generator().manual_seed(3))


def _model(**kw):
    torch.manual_seed(0)
    model = torchfuser.optimize(LlamaForCausalLM(LlamaConfig(**CFG)), backend="reference", fp8="rowwise", **kw)
    for p in model.parameters():
        p.requires_grad_(False)  # frozen, as LoRA's bases
    model.model.embed_tokens.weight.requires_grad_(True)  # something to train: a backward through every layer
    return model


def _run(model, grad=True):
    """(loss, the embeddings' gradient) of one step under bf16 autocast."""
    model.zero_grad(set_to_none=True)
    with torch.autocast("cpu", dtype=torch.bfloat16), torch.set_grad_enabled(grad):
        loss = model(input_ids=IDS, labels=IDS).loss
    if not grad:
        return loss.item(), None
    loss.backward()
    return loss.item(), model.model.embed_tokens.weight.grad.clone()


def _fresh(model, grad=True):
    """What the model computes with every kept FP8 copy dropped: a fresh quantisation of its weights."""
    for m in model.modules():
        m.__dict__.pop("_fp8_weights", None)
    return _run(model, grad)


def _projections(model):
    return [m.weight for n, m in model.named_modules() if type(m) is torch.nn.Linear and "layers" in n]


def _new_values(w):
    g = torch.Generator().manual_seed(w.numel())
    return (torch.randn(w.shape, generator=g, dtype=w.dtype) * 0.05).to(w.device)


def _data_copy(model):
    for w in _projections(model):
        w.data.copy_(_new_values(w))


def _data_inplace(model):  # EMA / weight averaging written through .data
    for w in _projections(model):
        w.data.mul_(0.5).add_(_new_values(w), alpha=0.5)


def _data_assign(model):
    for w in _projections(model):
        w.data = _new_values(w)


def _vector_to_parameters(model):  # torch.nn.utils' own: param.data = ...
    ws = _projections(model)
    vec = torch.nn.utils.parameters_to_vector(ws)
    torch.nn.utils.vector_to_parameters(vec * -1.5, ws)


def _no_grad_copy(model):
    with torch.no_grad():
        for w in _projections(model):
            w.copy_(_new_values(w))


def _load_state_dict(model):
    state = model.state_dict()
    model.load_state_dict({k: (v * -0.5 if "layers" in k and k.endswith("proj.weight") else v) for k, v in state.items()})


def _swap_tensors(model):
    for w in _projections(model):
        torch.utils.swap_tensors(w, torch.nn.Parameter(_new_values(w), requires_grad=False))


WRITES = [_data_copy, _data_inplace, _data_assign, _vector_to_parameters, _no_grad_copy, _load_state_dict, _swap_tensors]


@pytest.mark.parametrize("grad", [True, False], ids=["train", "no-grad"])
@pytest.mark.parametrize("write", WRITES, ids=lambda f: f.__name__.lstrip("_"))
def test_per_call_sees_every_write_to_a_frozen_weight(write, grad):
    model = _model()
    before = _run(model, grad)
    write(model)
    got = _run(model, grad)
    assert got[0] != before[0]  # the write changed the model
    want = _fresh(model, grad)
    assert got[0] == want[0]
    assert grad is False or torch.equal(got[1], want[1])


@pytest.mark.parametrize("write", WRITES, ids=lambda f: f.__name__.lstrip("_"))
def test_per_step_sees_a_write_at_the_next_optimizer_step(write):
    """``per_step`` keeps copies (frozen ones too) until an optimizer steps: a ``.data`` write made with
    a step (EMA, averaging after ``step()``) is seen from the next call on; writes that bump the version or
    replace the storage are seen at once."""
    model = _model(fp8_weights="per_step")
    opt = torch.optim.SGD([model.model.embed_tokens.weight], lr=0.0)
    _run(model)
    write(model)
    opt.step()  # lr 0: only the count moves
    got = _run(model)
    want = _fresh(model)
    assert got[0] == want[0] and torch.equal(got[1], want[1])


def test_per_step_keeps_frozen_copies_between_steps(monkeypatch):
    model = _model(fp8_weights="per_step")
    made = []
    real = fp8._both
    monkeypatch.setattr(fp8, "_both", lambda weights, recipe: made.append(len(weights)) or real(weights, recipe))
    opt = torch.optim.SGD([model.model.embed_tokens.weight], lr=0.0)
    for _ in range(2):
        _run(model)
        _run(model)
        opt.step()
    assert len(made) == 2 * 4 * CFG["num_hidden_layers"]  # once a step, not once a call


def test_peft_base_writes_and_adapter_switches_are_seen():
    """Under PEFT the FP8 products are the frozen bases': a write to a base through ``.data`` (loading base
    weights, averaging) is seen at the next call; ``set_adapter`` and ``merge_adapter`` / ``unmerge_adapter``
    (merged layers run as PEFT's own, bf16) change adapters, never an FP8 copy. Each call is what a fresh
    quantisation gives."""
    peft = pytest.importorskip("peft")
    torch.manual_seed(0)
    base = LlamaForCausalLM(LlamaConfig(**CFG)).to(torch.bfloat16)
    torchfuser.optimize(base, backend="reference", fp8="rowwise")
    cfg = peft.LoraConfig(r=8, lora_alpha=16, target_modules="all-linear", lora_dropout=0.0, init_lora_weights=False)
    torch.manual_seed(1)
    model = peft.get_peft_model(base, cfg)
    torch.manual_seed(2)
    model.add_adapter("other", cfg)
    bases = [m.base_layer.weight for m in model.modules() if hasattr(m, "base_layer") and hasattr(m, "lora_A")]

    def logits():
        with torch.no_grad():
            return model(input_ids=IDS).logits

    def write_bases():
        for w in bases:
            w.data.copy_(_new_values(w))

    def fresh():
        for m in model.modules():
            m.__dict__.pop("_fp8_weights", None)
        return logits()

    got = logits()
    changes = {"other adapter": lambda: model.set_adapter("other"), "default adapter": lambda: model.set_adapter("default"),
               "bases written": write_bases, "merged": model.merge_adapter, "unmerged": model.unmerge_adapter}
    for what, change in changes.items():
        before, _ = got, change()
        got = logits()
        assert not torch.equal(got, before) or what == "unmerged", what  # (unmerged ≈ before, in bf16)
        assert torch.equal(got, fresh()), what


@pytest.mark.skipif(not torch.cuda.is_available() or torch.cuda.get_device_capability() < (8, 9),
                    reason="FP8 GEMMs on CUDA need a GPU of compute capability 8.9 or newer")
@pytest.mark.parametrize("write", [_data_copy, _data_inplace], ids=lambda f: f.__name__.lstrip("_"))
def test_per_call_sees_a_data_write_on_cuda(write):
    """The same on a GPU, through the Triton quantisers (backend "auto")."""
    torch.manual_seed(0)
    model = torchfuser.optimize(LlamaForCausalLM(LlamaConfig(**CFG)).cuda(), fp8="rowwise")
    for p in model.parameters():
        p.requires_grad_(False)
    model.model.embed_tokens.weight.requires_grad_(True)
    ids = IDS.cuda()

    def run():
        model.zero_grad(set_to_none=True)
        with torch.autocast("cuda", dtype=torch.bfloat16):
            loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        return loss.item(), model.model.embed_tokens.weight.grad.clone()

    before = run()
    write(model)
    got = run()
    for m in model.modules():
        m.__dict__.pop("_fp8_weights", None)
    want = run()
    assert got[0] != before[0]
    assert got[0] == want[0] and torch.equal(got[1], want[1])
