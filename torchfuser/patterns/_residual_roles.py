"""The residual-norm pattern's view of a layer's children and forward (``patterns.residual_norm``): its signature,
which children may be the attention, the norms, an identity first norm, an inline MLP."""
from __future__ import annotations

import inspect

from torch import nn

from torchfuser.modules import _layer_blocks
from torchfuser.modules.attention import FusedAttention
from torchfuser.modules.norms import FusedLayerNorm, FusedRMSNorm, LayerNormSpec, RMSNormSpec
from torchfuser.patterns import _probe, _reasons
from torchfuser.patterns.base import Skip
from torchfuser.patterns.norms import LayerNormPattern, RMSNormPattern, weightless


def signature(module: nn.Module):
    """(first parameter, [(name, default)] of the rest, takes **kwargs) or a Skip."""
    params = list(inspect.signature(type(module).forward).parameters.values())[1:]
    if not params or params[0].kind not in (params[0].POSITIONAL_ONLY, params[0].POSITIONAL_OR_KEYWORD):
        return Skip("its forward does not take the hidden states first")
    rest, extra = [], False
    for p in params[1:]:
        if p.kind is p.VAR_KEYWORD:
            extra = True
        elif p.kind is p.VAR_POSITIONAL:
            return Skip(f"its forward takes *{p.name}; only layers whose arguments after the hidden states have names "
                        "are fused")
        else:  # one without a default (Falcon's attention_mask, BLOOM's alibi): ``p.empty``, required by the fused path too
            rest.append((p.name, p.default))
    return params[0].name, rest, extra


def identities(module: nn.Module) -> list[str]:
    """Children that are identities (``nn.Identity``'s forward, no parameters): a first norm left out."""
    return [n for n, m in module._modules.items() if m is not None and _layer_blocks.is_identity(m)]


def mlp_first(probe) -> bool:
    """Whether the last probe run called the MLP's stand-in before the attention's."""
    names = [s.role for s in probe.last_order]
    return "mlp" in names and "attention" in names and names.index("mlp") < names.index("attention")


def attention_like(m: nn.Module) -> bool:
    """A block that may be the layer's attention: a fused one, one whose class says attention, or one with
    two or more projections whose forward takes an attention mask."""
    if isinstance(m, FusedAttention) or any(w in type(m).__name__.lower() for w in ("attention", "attn")):
        return True
    from torchfuser.modules.adapters import lora

    projs = [n for n, c in m._modules.items() if c is not None and _probe.projection_dims(lora.base_of(c))]
    if len(projs) < 2:
        return False
    try:
        names = inspect.signature(type(m).forward).parameters
    except (TypeError, ValueError):
        names = {}
    return "attention_mask" in names


def inline_mlp(module: nn.Module, blocks: list[str]):
    """For a decoder layer holding its MLP's two projections itself (OPT: attention, two norms, fc1 and fc2 as
    its own children): (the two projections, its activation child), or a Skip; else None."""
    kids = {n: module._modules[n] for n in blocks}
    linears = tuple(n for n, m in kids.items() if _probe.projection_dims(m))
    norms = [n for n in blocks if n not in linears and norm_kind(kids[n])]
    attention = [n for n in blocks if n not in linears and n not in norms and attention_like(kids[n])]
    if len(linears) != 2 or len(norms) != 2 or len(attention) != 1:
        return None
    acts = [n for n, m in module._modules.items() if m is not None and n not in blocks and not isinstance(m, nn.Dropout)
            and not any(True for _ in m.parameters())]
    if len(acts) != 1:
        return Skip(f"its MLP is inline ({_reasons.quoted(linears)} are the layer's own projections) and its activation "
                    f"is not one parameter-free child module ({len(acts)} such children)")
    return linears, acts[0]


def norm_kind(m: nn.Module) -> str | None:
    """"rms" or "layer" for a fused or fusable norm child, else None."""
    if isinstance(m, FusedRMSNorm):
        return "rms"
    if isinstance(m, FusedLayerNorm):
        return "layer"
    if m._modules or not m._parameters and not weightless(m):
        return None
    if isinstance(RMSNormPattern().match(m), RMSNormSpec):
        return "rms"
    return "layer" if isinstance(LayerNormPattern().match(m), LayerNormSpec) else None


def block(m: nn.Module | None) -> bool:
    """Whether a child takes a role in a layer: one with parameters, or a weightless norm (NanoChat's, OLMo-1's),
    fused or fusable."""
    if m is None:
        return False
    if any(True for _ in m.parameters()):
        return True
    return (isinstance(m, (FusedRMSNorm, FusedLayerNorm)) or weightless(m)) and norm_kind(m) is not None


def cross_pairs(module: nn.Module, blocks: list[str], kinds: dict) -> list[tuple[str, str, tuple]]:
    """For a decoder layer of seven blocks (BART's, Whisper's: self-attention, cross-attention, fc1, fc2, three
    norms): each (cross-attention, its norm, ``inline_mlp`` of the rest) to try, the later attention and the norm
    declared right after it first; the probe tells which pair its forward leaves alone without encoder states."""
    attentions = [n for n in blocks if not kinds[n] and attention_like(module._modules[n])]
    norms = [n for n in blocks if kinds[n]]
    if len(attentions) != 2 or len(norms) != 3:
        return []
    found = []
    for cross in reversed(attentions):
        at = blocks.index(cross)
        for norm in sorted(norms, key=lambda n: (blocks.index(n) < at, abs(blocks.index(n) - at))):
            inline = inline_mlp(module, [n for n in blocks if n not in (cross, norm)])
            if isinstance(inline, tuple):
                found.append((cross, norm, inline))
    return found


def study_crosses(module: nn.Module, crosses: list, kinds: dict, sig, study):
    """``study`` (``residual_norm._study``) of a layer with a cross-attention block and its norm beside an attention,
    an inline MLP and two norms, for each choice of the pair (``cross_pairs``): the pair in roles whose stand-ins
    raise when called, so that the arguments that make the forward call them (its encoder states) must stay at their
    default. The first spec found, else the likeliest Skip, else None."""
    skips = []
    every = [n for n, m in module._modules.items() if block(m)]
    for cross, cross_norm, inline in crosses:
        rest = [n for n in every if n not in (cross, cross_norm, *inline[0])]
        found = study(module, [n for n in rest if not kinds[n]], [n for n in rest if kinds[n]], *sig, inline=inline,
                      unused=(cross, cross_norm))
        if found is not None and not isinstance(found, Skip):
            return found
        skips.append(found)
    return next((s for s in skips if s is not None), None)
