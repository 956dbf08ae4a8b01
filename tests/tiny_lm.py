"""Shared pieces of the fused-against-unfused training tests on tiny causal LMs (``arch_sweep.tiny_config``):
the model with some config fields set, one training step, the layers the residual-norm pattern fused."""
from __future__ import annotations

import torch
from transformers import AutoModelForCausalLM

from torchfuser import switches
from torchfuser.cuda_graphs.replay import Stack
from torchfuser.modules.residual_norm import ResidualNormForward

from arch_sweep import tiny_config

VOCAB = 128


def tiny_model(model_type: str, **fields):
    """The tiny fp32 model in training mode, ``fields`` set on its config (dropouts, residual scales), seed 0."""
    cfg = tiny_config(model_type)
    for k, v in fields.items():
        setattr(cfg, k, v)
    torch.manual_seed(0)
    return AutoModelForCausalLM.from_config(cfg).float().train()


def left_padded_prompts(batch: int, longest: int, pad_step: int, low: int, high: int):
    """(ids, mask): ``batch`` prompts left-padded to ``longest`` with 0, the padding growing by ``pad_step`` a row
    (as generation and TRL's rollouts batch them), tokens drawn from [low, high) of one seeded generator."""
    gen = torch.Generator().manual_seed(1)
    ids = torch.zeros(batch, longest, dtype=torch.long)
    mask = torch.zeros_like(ids)
    for row in range(batch):
        n = longest - pad_step * row
        ids[row, -n:] = torch.randint(low, high, (n,), generator=gen)
        mask[row, -n:] = 1
    return ids, mask


def loss_and_grads(model, ids):
    """One forward and backward of ``model`` on ``ids`` (labels = ids): the loss and a copy of every gradient."""
    model.zero_grad(set_to_none=True)
    loss = model(input_ids=ids, labels=ids).loss
    loss.backward()
    return loss.detach(), {n: p.grad.clone() for n, p in model.named_parameters()}


def lm_step(model, device="cpu"):
    """One forward and backward on fixed token ids; the global generator seeded just before the forward, so
    two models' dropouts draw the same random stream."""
    ids = torch.randint(3, VOCAB, (2, 10), generator=torch.Generator().manual_seed(1)).to(device)
    torch.manual_seed(0)
    loss = model(input_ids=ids, labels=ids, use_cache=False).loss
    loss.backward()
    return loss.detach()


def assert_generates_like(ref, fused) -> None:
    """Greedy decoding with the cache gives the unfused model's tokens: the decode steps run by the original modules
    (the default, ``modules.decode``), and by the fused forward's decode path (no_grad; the switch off)."""
    ids = torch.randint(3, VOCAB, (2, 6), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        want = ref.generate(ids, max_new_tokens=6, do_sample=False, pad_token_id=0)
        for on in (True, False):
            with switches.switched(decode_to_original=on):
                got = fused.generate(ids, max_new_tokens=6, do_sample=False, pad_token_id=0)
            assert torch.equal(got, want)


def fused_layers(model) -> list:
    """The decoder layers whose forward the residual-norm pattern replaced, also where CUDA graphs (the default
    ``cuda_graphs="auto"`` on a GPU) route the layer through its stack, which calls that forward."""
    return [m for m in model.modules() if isinstance(_layer_forward(m), ResidualNormForward)]


def _layer_forward(module):
    forward = module.__dict__.get("forward")
    stack = getattr(getattr(forward, "func", None), "__self__", None)
    if isinstance(stack, Stack):
        return stack.forwards[forward.args[0]]
    return forward
