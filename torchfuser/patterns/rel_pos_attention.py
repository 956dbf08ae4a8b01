"""Vision attention with decomposed relative-position terms (SAM-style ViTs: GOT-OCR2, PP-Chart2Table),
recognised by structure and checked by a probe.

A candidate holds two projections (one fused [q | k | v], one output) and two parameters of its own,
2-D tables of one head's width (the relative positions along the map's height and width). Each guess
(which table is which axis; q, k, v's order in the fused projection) becomes a ``RelPosAttentionSpec``;
the first whose ``FusedRelPosAttention`` computes exactly what the module's own forward computes wins.
The probe: float64 copies narrow on the model side, random tables (the model starts them at zero, which
would hide a wrong axis) and a map of unequal height and width, so that every convention shows.
"""
from __future__ import annotations

import dataclasses
import itertools

import torch
from torch import nn

from torchfuser.modules import fallbacks
from torchfuser.modules.adapters import lora
from torchfuser.modules.rel_pos_attention import FusedRelPosAttention, RelPosAttentionSpec
from torchfuser.patterns import _probe
from torchfuser.patterns._attention_probe import forward_params
from torchfuser.patterns.attention import _heads, _scaling
from torchfuser.patterns.base import Pattern, Skip

_WIDTH, _MAP = 8, (3, 4)  # probe: model-side width; (height, width) of the probed map


def _tables(module: nn.Module) -> list[str]:
    return [n for n, p in module._parameters.items() if p is not None]


def _guesses(module: nn.Module, projs: dict, tables: list[str]):
    for out, qkv in itertools.permutations(projs, 2):
        (c_in, c_qkv), (o_in, o_out) = projs[qkv], projs[out]
        heads, _, d = _heads(module, o_in)
        width = module._parameters[tables[0]].shape[1]
        if not heads or heads * width != o_in or c_qkv != 3 * o_in or o_out != c_in:
            continue
        for (th, tw), order in itertools.product(itertools.permutations(tables), itertools.permutations("qkv")):
            yield RelPosAttentionSpec(qkv=qkv, out=out, num_heads=heads, head_dim=width, table_h=th, table_w=tw,
                                      scaling=_scaling_of(module, width), qkv_order=order)


def _scaling_of(module: nn.Module, d: int) -> float:
    s = getattr(module, "scale", None)
    return float(s) if isinstance(s, float) else _scaling(module, d)


def _probe_once(module: nn.Module, spec: RelPosAttentionSpec, projs: dict) -> str | None:
    """None if the fused module computes what ``module`` does on the probe, else why not."""
    gen = _probe.generator(13)
    probe = _probe.shallow_copy(module)
    probe._modules[spec.qkv] = _probe.small_projection(lora.base_of(module._modules[spec.qkv]), _WIDTH,
                                                       projs[spec.qkv][1], gen)
    probe._modules[spec.out] = _probe.small_projection(lora.base_of(module._modules[spec.out]), projs[spec.out][0],
                                                       _WIDTH, gen)
    for n in (spec.table_h, spec.table_w):
        probe._parameters[n] = nn.Parameter(_probe.randn(*module._parameters[n].shape, gen=gen), requires_grad=False)
    x = _probe.randn(2, *_MAP, _WIDTH, gen=gen)
    try:
        fused = FusedRelPosAttention(probe, spec, "reference")
        with torch.no_grad(), _probe.saved_rng():
            want = type(probe).forward(probe, x)
            got = fused(x)
    except Exception as err:
        return f"{type(err).__name__}: {err}"
    if fallbacks.counts(fused):
        return f"the fused module ran the original ({next(iter(fallbacks.counts(fused)['']))})"
    if not (isinstance(want, tuple) and isinstance(want[0], torch.Tensor)):
        return "its forward does not return (output, attention weights)"
    return None if _probe.close(got[0], want[0]) else "output differs (table axes, q/k/v order or scaling)"


class RelPosAttentionPattern(Pattern):
    name = "rel_pos_attention"
    description = ("vision attention over a (B, h, w, C) map with decomposed relative positions (SAM-style ViTs): "
                   "the position terms as SDPA's additive mask")
    fused = FusedRelPosAttention

    def match(self, module):
        projs = {n: d for n, m in module._modules.items() if m is not None and (d := _probe.projection_dims(lora.base_of(m)))}
        tables = _tables(module)
        if len(projs) != 2 or len(tables) != 2 or len(projs) != len([m for m in module._modules.values() if m is not None]):
            return None
        shapes = [module._parameters[n].shape for n in tables]
        if any(len(s) != 2 for s in shapes) or shapes[0][1] != shapes[1][1]:
            return None
        if any(lora.unsupported(n, module._modules[n]) for n in projs):
            return Skip(next(filter(None, (lora.unsupported(n, module._modules[n]) for n in projs))))
        drops = [n for n in _probe.float_dropouts(module) if getattr(module, n)]
        if drops:
            return Skip(f"attention dropout ({', '.join(drops)} > 0), drawn by the original on its probabilities, "
                        "which SDPA would draw differently")
        positional = tuple(p.name for p in forward_params(module)[1:] if p.kind is p.POSITIONAL_OR_KEYWORD)
        first = None
        for spec in _guesses(module, projs, tables):
            spec = dataclasses.replace(spec, positional=positional, dropout=next(iter(_probe.float_dropouts(module)), None))
            why = _probe_once(module, spec, projs)
            if why is None:
                return spec
            first = first or why
        if first is None:
            return None  # the shapes fit no such attention: another pattern's candidate, or none
        return Skip(f"two tables of its own ({', '.join(tables)}) besides a fused qkv and an output projection, but "
                    f"its output is not softmax(q·kᵀ·scale + decomposed relative positions)·v for any axis and q/k/v "
                    f"order tried ({first})")
