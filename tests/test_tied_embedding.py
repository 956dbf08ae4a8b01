"""Every way gradients meet on a tied weight (input embedding = LM head), fused against unfused.

With ``lm_head_loss`` fused, a tied input embedding's gradient rows go into the head's gradient
(``torchfuser/modules/tied_embedding.py``). W's gradient must then be what autograd gives the
unfused model however else W is reached: several forwards before one backward (DPO without
concatenation, R-Drop, distillation), a term on ``lm_head.weight`` or ``embed_tokens.weight``
(an L2 penalty), the embedding called outside the model, micro-batch accumulation, two backwards
through a retained graph, gradient checkpointing, ``torch.autograd.grad``. DDP and FSDP2 are in
``test_distributed_tied.py``.

Each case trains the fused fp32 model and the unfused one in fp32 and float64, and holds every
gradient to docs/numerics.md's rule: max|fused − ref64| ≤ 2·max|unfused fp32 − ref64| + atol.
Gemma's scaled embedding (a subclass of nn.Embedding) is not routed: its cases check the plain path.
"""
from __future__ import annotations

import copy

import pytest
import torch

import torchfuser
from numerics import ATOL, assert_within_rule
from test_architectures import VOCAB, make

PAD = 5
ROUTED = {"llama": True, "qwen2": True, "gemma": False}


def models(arch: str):
    """(unfused fp32, unfused float64, fused fp32) of one tied model, in training mode."""
    plain = make(arch, tie_word_embeddings=True, pad_token_id=PAD)
    assert plain.lm_head.weight is plain.get_input_embeddings().weight
    ref64 = copy.deepcopy(plain).double()
    fused = torchfuser.optimize(copy.deepcopy(plain), backend="reference")
    return plain.train(), ref64.train(), fused.train()


def batches(n: int, seed: int = 1) -> list[dict]:
    """Batches with the padding token (no embedding gradient; attended to: a fully masked row is NaN
    in the eager attention of float64 models) and a token repeated within a row."""
    g = torch.Generator().manual_seed(seed)
    out = []
    for i in range(n):
        ids = torch.randint(3, VOCAB, (2, 10), generator=g)
        ids[0, :2] = PAD
        ids[1, 3:7] = 9 + i
        labels = ids.masked_fill(ids == PAD, -100)
        out.append(dict(input_ids=ids, labels=labels))
    return out


def _penalty(weight):
    return 1e-2 * weight.square().sum()


def two_forwards(m, bs):
    (m(**bs[0]).loss + m(**bs[1]).loss).backward()


def three_forwards_weighted(m, bs):  # DPO-like: terms of either sign, of the same batch too
    (m(**bs[0]).loss - 0.5 * m(**bs[1]).loss + 0.25 * m(**bs[0]).loss).backward()


def head_penalty(m, bs):
    (m(**bs[0]).loss + _penalty(m.lm_head.weight)).backward()


def embedding_penalty(m, bs):
    (m(**bs[0]).loss + _penalty(m.get_input_embeddings().weight)).backward()


def embedding_called_outside(m, bs):  # a second, plain call of the embedding module in the same graph
    (m(**bs[0]).loss + m.get_input_embeddings()(bs[1]["input_ids"]).square().mean()).backward()


def accumulation(m, bs):  # one backward per micro-batch, into an existing .grad
    for b in bs:
        (m(**b).loss / len(bs)).backward()


def accumulation_with_penalty(m, bs):
    for b in bs:
        ((m(**b).loss + _penalty(m.lm_head.weight)) / len(bs)).backward()


def retain_graph(m, bs):  # the second backward reads the first one's graph again
    loss = m(**bs[0]).loss
    (2 * loss).backward(retain_graph=True)
    loss.backward()


def retain_graph_two_forwards(m, bs):
    a, b = m(**bs[0]).loss, m(**bs[1]).loss
    (a + b).backward(retain_graph=True)
    (0.5 * a).backward()


def _checkpointed(reentrant: bool):
    def case(m, bs):
        m.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": reentrant})
        assert m.is_gradient_checkpointing
        two_forwards(m, bs)
    case.__name__ = f"checkpointing_{'reentrant' if reentrant else 'non_reentrant'}_two_forwards"
    return case


CASES = [two_forwards, three_forwards_weighted, head_penalty, embedding_penalty, embedding_called_outside,
         accumulation, accumulation_with_penalty, retain_graph, retain_graph_two_forwards,
         _checkpointed(True), _checkpointed(False)]


def param_grads(model) -> dict:
    return {n: p.grad for n, p in model.named_parameters()}


def assert_grads_within_rule(fused: dict, plain: dict, ref64: dict):
    """Every parameter's gradient, by name."""
    assert list(fused) == list(plain) == list(ref64) and fused
    for name, got in fused.items():
        assert got is not None and plain[name] is not None and ref64[name] is not None, name
        assert_within_rule(got, plain[name], ref64[name], ATOL[torch.float32], name)


def routed_calls(model) -> list[bool]:
    """Whether each call of the input embedding went through the tied route (an instance forward)."""
    calls = []
    model.get_input_embeddings().register_forward_hook(lambda m, i, o: calls.append("forward" in m.__dict__))
    return calls


@pytest.mark.parametrize("case", CASES, ids=lambda c: c.__name__)
@pytest.mark.parametrize("arch", list(ROUTED))
def test_tied_weight_gradient_matches_unfused(arch, case):
    plain, ref64, fused = models(arch)
    routed = routed_calls(fused)
    bs = batches(3)
    for m in (plain, ref64, fused):
        case(m, bs)
    assert any(routed) == ROUTED[arch], routed
    assert_grads_within_rule(param_grads(fused), param_grads(plain), param_grads(ref64))


@pytest.mark.parametrize("arch", list(ROUTED))
def test_tied_weight_gradient_through_autograd_grad(arch):
    """torch.autograd.grad of two forwards' loss and a penalty: the gradients are returned, and
    none goes into .grad."""
    plain, ref64, fused = models(arch)
    routed = routed_calls(fused)
    bs = batches(2)

    def grads(m):
        names, params = zip(*m.named_parameters())
        got = torch.autograd.grad(m(**bs[0]).loss + m(**bs[1]).loss + _penalty(m.lm_head.weight), params)
        assert all(p.grad is None for p in params)
        return dict(zip(names, got))

    assert_grads_within_rule(grads(fused), grads(plain), grads(ref64))
    assert any(routed) == ROUTED[arch]


def _tied_grad(model, autocast: bool) -> torch.Tensor:
    """W's gradient after two forwards and a penalty on the head's weight."""
    model.zero_grad(set_to_none=True)
    device = model.lm_head.weight.device
    bs = [{k: v.to(device) for k, v in b.items()} for b in batches(2)]
    with torch.autocast(device.type, dtype=torch.bfloat16, enabled=autocast):
        loss = model(**bs[0]).loss + model(**bs[1]).loss
    (loss + _penalty(model.lm_head.weight)).backward()
    return model.lm_head.weight.grad.clone()


DEVICES = ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])


@pytest.mark.parametrize("cuda_graphs", [False, True])
@pytest.mark.parametrize("device", DEVICES)
def test_routed_and_plain_embedding_give_the_same_tied_gradient(device, cuda_graphs, monkeypatch):
    """On the device's own backend (Triton on CUDA, under bf16 autocast, with and without CUDA graphs):
    the tied weight's gradient with the embedding routed into the head equals the one with the route
    off (autograd's dense embedding gradient), for two forwards and a penalty on the head's weight.
    On CUDA relative to the gradient's norm only: bf16 attention's backward is not bitwise repeatable."""
    if device == "cpu" and cuda_graphs:
        pytest.skip("CUDA graphs are a CUDA matter")
    from torchfuser.modules import tied_embedding

    model = make("llama", tie_word_embeddings=True, pad_token_id=PAD).to(device).train()
    torchfuser.optimize(model, backend="reference" if device == "cpu" else "auto", cuda_graphs=cuda_graphs)
    routed = routed_calls(model)
    got = _tied_grad(model, autocast=device == "cuda")
    assert routed and all(routed)
    routed.clear()
    monkeypatch.setattr(tied_embedding, "routable", lambda *args: False)
    want = _tied_grad(model, autocast=device == "cuda")
    assert routed and not any(routed)
    if device == "cpu":
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)
    else:
        assert ((got - want).norm() / want.norm()).item() < 1e-2
