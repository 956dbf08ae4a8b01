"""Skip reasons in words: what a probe's exception or a module's parts mean to the user."""
from __future__ import annotations

import re

from torch import nn



def missing_arguments(text: str) -> list[str]:
    """The required arguments a ``TypeError`` message says a forward was not given ([] for any other)."""
    m = re.search(r"missing \d+ required (?:positional|keyword-only) arguments?: (.*)$", text)
    return re.findall(r"'([^']+)'", m.group(1)) if m else []


def quoted(names) -> str:
    names = [repr(n) for n in names]
    return names[0] if len(names) == 1 else ", ".join(names[:-1]) + " and " + names[-1]


def children(module: nn.Module, names) -> str:
    """'name' (Class), ... for the named children of ``module``."""
    return ", ".join(f"{n!r} ({type(module._modules[n]).__name__})" for n in names)


def projections(projs: dict[str, tuple[int, int]]) -> str:
    return ", ".join(f"{n} {a}→{b}" for n, (a, b) in projs.items())


def failed_probe(module: nn.Module, err: BaseException, what: str) -> str:
    """Why running ``module``'s forward on a plain input raised, for a block fused as ``what``."""
    cls = type(module).__name__
    missing = missing_arguments(str(err)) if isinstance(err, TypeError) else []
    if "residual" in missing:
        return f"{cls}'s forward takes the residual as an argument (it adds it itself); only {what} are fused"
    if missing:
        return f"{cls}'s forward requires {quoted(missing)} besides its input; only {what} are fused"
    first = str(err).splitlines()[0] if str(err) else ""
    return (f"{cls}'s forward does not run on a plain (tokens, hidden) input, so it is not one of the {what} "
            f"that are fused (it raised {type(err).__name__}: {first})")


def no_mask(params) -> str | None:
    """Why a forward that cannot be given a mask is not fused (the probe and the fused module pass one)."""
    if not params or any(p.name == "attention_mask" or p.kind is p.VAR_KEYWORD for p in params):
        return None
    return (f"its forward takes no attention mask (only {quoted([p.name for p in params])}): it arranges "
            "what it attends over from its input itself (a (batch, height, width, channels) map cut into windows, as "
            "DaViT / Florence-2's window attention does, or channel groups, as DaViT's channel attention does), where "
            "the fused attention takes (batch, tokens, channels) and a mask; one that calls transformers' attention "
            "interface on what it builds (Florence-2's) runs SDPA already under attn_implementation='sdpa'")
