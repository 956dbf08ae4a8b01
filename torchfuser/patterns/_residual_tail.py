"""A third block after a decoder layer's attention and MLP, for the residual-norm pattern (``patterns.residual_norm``):
Gemma 4's per-layer inputs (E2B, E4B),

    out = o + norm_t(fc_out(act(fc_in(o)) · g))        o: the layer's output so far, g: one of its forward's arguments

held as the layer's own children (two projections H → P → H, one parameter-free activation, one norm). The probe
stands in for the projections and the norm, keeps the activation, passes a tensor for the argument that takes it
(the one a run with that argument alone set succeeds with) and checks the formula; the fused forward runs the block
after the fused part as the original does (its add follows its norm: nothing of it is fused, ``_POST_BLOCK``).
"""
from __future__ import annotations

import torch
from torch import nn

from torchfuser.modules import _layer_blocks
from torchfuser.patterns import _probe

ROLES = ("tail_in", "tail_act", "tail_out", "tail_norm")


def find(module: nn.Module, blocks: list[str], hidden: int) -> tuple[str, str, str] | None:
    """(fc_in, act, fc_out): the layer's own two projections ``hidden`` → P → ``hidden`` and its one parameter-free
    activation child (no other parameter-free child but dropouts and identities), where it has them beside more blocks; else None."""
    from torchfuser.modules.adapters import lora

    dims = {n: _probe.projection_dims(lora.base_of(module._modules[n])) for n in blocks}
    linears = [n for n, d in dims.items() if d is not None]
    if len(linears) != 2 or len(blocks) < 6:
        return None
    ins = [n for n in linears if dims[n][0] == hidden]
    outs = [n for n in linears if dims[n][1] == hidden and n not in ins[:1]]
    if len(ins) < 1 or len(outs) != 1 or dims[ins[0]][1] != dims[outs[0]][0]:
        return None
    acts = [n for n, m in module._modules.items() if m is not None and n not in blocks and not any(True for _ in m.parameters())
            and not isinstance(m, nn.Dropout) and not _layer_blocks.is_identity(m)]
    return (ins[0], acts[0], outs[0]) if len(acts) == 1 else None


def fns(gen: torch.Generator, width: int) -> dict:
    """The stand-ins' maps for the block's projections and norm."""
    t1, t2 = (_probe.randn(width, width, gen=gen) / width**0.5 for _ in range(2))
    return {"tail_in": lambda x: x @ t1, "tail_out": lambda x: x @ t2, "tail_norm": lambda x: 0.6 * x + 0.2}


def apply(probe, o: torch.Tensor) -> torch.Tensor:
    """The formula's block on the probe's output so far."""
    f, act = probe.fns, probe.module._modules[probe.roles["tail_act"]]
    return o + f["tail_norm"](f["tail_out"](act(f["tail_in"](o)) * probe.g))


def argument(probe, params) -> str | None:
    """The forward's argument the block multiplies by: the one that, alone given the probe's tensor, lets it run."""
    for name, _ in params:
        probe.tail_arg = name
        try:
            probe.run(0.0)
            return name
        except Exception:  # noqa: BLE001 - not this one
            continue
    probe.tail_arg = ""
    return None
