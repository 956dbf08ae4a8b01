"""Vision attention over variable-length image sequences (``cu_seqlens``), recognised by structure and a probe.

A candidate is a module whose forward takes ``cu_seqlens`` (the offsets of images or windows in one
unbatched sequence of patches) and whose children are two projections (a fused [q | k | v] one and the
output) or four (q, k, v, output), nothing else. Each guess (layout; rotate-half rotary on the whole head
or none) becomes a ``VarlenAttentionSpec``; the first whose ``FusedVarlenAttention`` computes exactly
what the module's own forward computes on a probe wins: float64 copies, narrow on the model side, three
segments of unequal length, random rotary tables, under the module's own attention implementation.
"""
from __future__ import annotations

import dataclasses
import inspect
import itertools

import torch
from torch import nn

from torchfuser.modules import fallbacks
from torchfuser.modules.adapters import lora
from torchfuser.modules.varlen_attention import _IMPLEMENTATIONS, FusedVarlenAttention, VarlenAttentionSpec
from torchfuser.patterns import _probe
from torchfuser.patterns._attention_probe import ProbeNorm
from torchfuser.patterns.attention import _heads, _hint_rank, _is_norm, _scaling
from torchfuser.patterns.base import Pattern, Skip

_WIDTH, _LENGTHS = 8, (3, 5, 2)  # probe: model-side width; segment lengths
_TUPLE = "returns (output, attention weights)"


def _positional(module: nn.Module) -> tuple[str, ...]:
    """The names of the forward's positional parameters after hidden_states."""
    sig = inspect.signature(module.forward).parameters.values()
    return tuple(p.name for p in sig if p.kind is p.POSITIONAL_OR_KEYWORD)[1:]


def _params(module: nn.Module) -> list[str]:
    try:
        return list(inspect.signature(module.forward).parameters)
    except (TypeError, ValueError):
        return []


def _guesses(module: nn.Module, projs: dict, rotary: bool, norms: list[str]):
    names = list(projs)
    for out in sorted(names, key=lambda n: _hint_rank([n], "o")):
        inputs = [n for n in names if n != out]
        hidden = projs[out][1]
        heads, kv, d = _heads(module, projs[out][0])
        if not (heads and kv and d) or heads % kv or projs[out][0] != heads * d or any(projs[n][0] != hidden for n in inputs):
            continue
        common = dict(out=out, num_heads=heads, head_dim=d, scaling=_scaling(module, d), num_kv_heads=0 if kv == heads else kv)
        layouts = []
        if len(inputs) == 1 and projs[inputs[0]][1] == (heads + 2 * kv) * d:
            layouts.append(("concat", tuple(inputs)))
        elif len(inputs) == 3:
            for qkv in sorted(itertools.permutations(inputs), key=lambda p: _hint_rank(p, "qkv")):
                if projs[qkv[0]][1] == heads * d and projs[qkv[1]][1] == projs[qkv[2]][1] == kv * d:
                    layouts.append(("separate", qkv))
        roles = [dict(q_norm=a, k_norm=b) for a, b in sorted(itertools.permutations(norms), key=lambda p: _hint_rank(p, "qk"))
                 if module._modules[a].weight.shape[0] == d] if norms else [{}]
        for layout, qkv in layouts:
            modes = ((True, False), (False, False), (True, True)) if rotary else ((False, False),)
            for (rot, pairs), role in itertools.product(modes, roles):  # rotate-half, none, adjacent pairs (Inkling 2)
                yield VarlenAttentionSpec(layout=layout, qkv=qkv, rotary=rot, rotary_pairs=pairs, **role, **common)


def _probe_once(module: nn.Module, spec: VarlenAttentionSpec, projs: dict, extra: dict | None = None) -> str | None:
    """None if the fused module computes what ``module`` does on the probe, else why not."""
    gen = _probe.generator(12)
    probe = _probe.shallow_copy(module)
    for n in spec.qkv:
        probe._modules[n] = _probe.small_projection(lora.base_of(module._modules[n]), _WIDTH, projs[n][1], gen)
    for n in (spec.q_norm, spec.k_norm):
        if n is not None:  # random weights: a norm applied in the wrong place or role shows
            probe._modules[n] = ProbeNorm(module._modules[n].weight.shape[0], gen)
    probe._modules[spec.out] = _probe.small_projection(lora.base_of(module._modules[spec.out]), projs[spec.out][0], _WIDTH, gen)
    s = sum(_LENGTHS)
    x = _probe.randn(s, _WIDTH, gen=gen)
    x = x.unsqueeze(0) if spec.batched else x
    cu = torch.tensor([0, *torch.tensor(_LENGTHS).cumsum(0).tolist()], dtype=torch.int32)
    kwargs = {"cu_seqlens": cu, **(extra or {})}
    if "max_seqlen" in _params(module):  # required by some (MiniCPM-V's vision attention)
        kwargs["max_seqlen"] = max(_LENGTHS)
    if "position_embeddings" in _params(module):
        kwargs["position_embeddings"] = (_probe.randn(s, spec.head_dim, gen=gen), _probe.randn(s, spec.head_dim, gen=gen))
    try:
        fused = FusedVarlenAttention(probe, spec, "reference")
        with torch.no_grad(), _probe.saved_rng():
            want = type(probe).forward(probe, x, **kwargs)
            got = fused(x, **kwargs)
    except Exception as err:
        return f"{type(err).__name__}: {err}"
    if fallbacks.counts(fused):  # it ran the original: that proves nothing
        return f"the fused module ran the original ({next(iter(fallbacks.counts(fused)['']))})"
    if isinstance(want, tuple) != spec.returns_tuple:
        return _TUPLE if isinstance(want, tuple) else "output is not a tuple"
    want, got = (want[0], got[0]) if spec.returns_tuple else (want, got)
    if not isinstance(want, torch.Tensor) or not _probe.close(got, want):
        return "output differs (layout, scaling, rotary or segments)"
    return None


class VarlenAttentionPattern(Pattern):
    name = "varlen_attention"
    description = ("vision attention within each image / window of cu_seqlens (Qwen-VL, GLM-4V): rope, then "
                   "variable-length attention on CUDA (SDPA over the segments' block mask elsewhere)")
    fused = FusedVarlenAttention

    def match(self, module):
        params = _params(module)
        if "cu_seqlens" not in params:
            return None
        projs = {n: d for n, m in module._modules.items() if m is not None and (d := _probe.projection_dims(lora.base_of(m)))}
        if len(projs) not in (2, 4):
            return None
        others = [n for n, m in module._modules.items() if m is not None and n not in projs]
        if any(_probe.projection_dims(sub) for n in others for sub in module._modules[n].modules()):
            return None  # projections inside another child: a bigger block (an encoder layer), not an attention
        norms = [n for n in others if _is_norm(module._modules[n])]
        others = [n for n in others if n not in norms] + (norms if len(norms) not in (0, 2) else [])
        if others:
            return Skip(f"submodules {others} besides its projections, which the fused attention would not run")
        if any(lora.unsupported(n, module._modules[n]) for n in projs):
            return Skip(next(filter(None, (lora.unsupported(n, module._modules[n]) for n in projs))))
        cfg = getattr(module, "config", None)
        impl = getattr(cfg, "_attn_implementation", None)
        if impl not in _IMPLEMENTATIONS:
            return Skip(f"attention implementation {impl!r}: only 'eager' and 'sdpa' are reproduced")
        drops = [n for n in _probe.float_dropouts(module) if getattr(module, n)]
        if drops:
            return Skip(f"attention dropout ({', '.join(drops)} > 0), which the fused attention does not apply")
        positional = _positional(module)
        first = None
        for spec in _guesses(module, projs, "position_embeddings" in params, norms):
            spec = dataclasses.replace(spec, positional=positional)
            why, extra = _probe_once(module, spec, projs), None
            if why is not None and why.split(":")[0].endswith("Error"):  # perhaps the patches as one row, 1 × S × hidden
                # Such a model passes attention_mask=None through to its attention function (HunYuan-VL).
                batched, one_row = dataclasses.replace(spec, batched=True), {"attention_mask": None}
                why_batched = _probe_once(module, batched, projs, one_row)
                if why_batched in (None, _TUPLE):
                    spec, why, extra = batched, why_batched, one_row
            if why == _TUPLE:  # it returns (output, attention weights): so must the fused module
                spec = dataclasses.replace(spec, returns_tuple=True)
                why = _probe_once(module, spec, projs, extra)
            if why is None:
                return spec
            first = first or why
        return Skip(f"its forward could not be reproduced by variable-length attention with any layout tried ({first})"
                    if first else "no q/k/v and output projections whose shapes fit its heads")
