"""Why the attention pattern found no spec for a block, in words: no layout its projections fit, or no spec whose
fused forward reproduced the module's on the probe (the likeliest spec's failure)."""
from __future__ import annotations

from torch import nn

from torchfuser.patterns import _reasons
from torchfuser.patterns._attention_roles import _heads


def _no_layout(module: nn.Module, projs) -> str:
    """Why no spec could even be written down for these projections, in words."""
    ins = {a for a, _ in projs.values()}
    if len(projs) == 3 and len(ins) == 1 and len({b for _, b in projs.values()}) == 1:
        return (f"q, k and v projections ({', '.join(projs)}) and no output projection: that sits in another module "
                "(BERT's SelfOutput), and only attention modules holding all four are fused")
    heads, kv, d = _heads(module, max(b for _, b in projs.values()))
    counts = f"{heads} heads, {kv} k/v heads of {d}" if heads else "no head count found"
    why = ("q, k and v read from the hidden states (three projections or one fused) and an output projection "
           "back")
    if len(projs) > 4:
        why += "; more projections than those mean an output gate, or a low-rank / latent attention (DeepSeek's MLA)"
    return f"its projections ({_reasons.projections(projs)}; {counts}) fit no layout the fused attention has: {why}"


def _probe_failed(module: nn.Module, first: str, tried: int, cut: bool) -> str:
    """Why no spec reproduced the module's forward, from the likeliest spec's failure."""
    cls = type(module).__name__
    missing = _reasons.missing_arguments(first) if first.startswith("TypeError") else []
    if missing:
        return (f"{cls}'s forward requires {_reasons.quoted(missing)}, which the fused attention is not given "
                "(it takes the hidden states, the mask, rotary tables and a cache)")
    if first.startswith("forward does not return"):
        return f"{cls}'s forward does not return (output, attention weights) as transformers' attention modules do"
    tries = f"any of the {tried} layouts tried" + (" (the search stopped there)" if cut else "")
    if first.startswith("output differs"):
        return (f"its output is not softmax(q·kᵀ·scale + mask)·v from its projections for {tries}: it scales, "
                "rotates, normalises or masks in a way the fused attention does not")
    return f"its forward could not run as the fused attention would, for {tries} (likeliest: {first})"
