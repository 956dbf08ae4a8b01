"""The pattern registry, in matching order: a module is claimed by the first pattern that
recognises it as a candidate."""
from __future__ import annotations

from torchfuser.patterns.attention import AttentionPattern
from torchfuser.patterns.base import Applied, Pattern, Skip
from torchfuser.patterns.lm_head import LMHeadLossPattern
from torchfuser.patterns.mlp import GatedMLPPattern, MLPPattern
from torchfuser.patterns.moe import MoEPattern
from torchfuser.patterns.norms import LayerNormPattern, RMSNormPattern
from torchfuser.patterns.residual_norm import ResidualNormPattern

PATTERNS: dict[str, Pattern] = {p.name: p for p in (
    LMHeadLossPattern(), AttentionPattern(), RMSNormPattern(), LayerNormPattern(),
    MoEPattern(),  # before the MLPs: a block of experts is one candidate, its parts are not
    GatedMLPPattern(), MLPPattern(), ResidualNormPattern())}


def select(include=None, exclude=()) -> list[Pattern]:
    """The patterns named by ``include`` (all when None) minus ``exclude``; unknown names raise."""
    for names in (include or (), exclude or ()):
        if isinstance(names, str):
            raise TypeError(f"pattern names must be a list or tuple of names, got the string {names!r}")
        unknown = [n for n in names if n not in PATTERNS]
        if unknown:
            raise ValueError(f"unknown pattern name(s) {unknown}; valid patterns are {', '.join(PATTERNS)}")
    chosen = PATTERNS if include is None else {n: PATTERNS[n] for n in PATTERNS if n in include}
    chosen = [p for n, p in chosen.items() if n not in set(exclude or ())]
    if not any(p.name == "rms_norm" for p in chosen):  # residual_norm runs fused only on fused norms
        chosen = [ResidualNormPattern(norms_fused=False) if p.name == "residual_norm" else p for p in chosen]
    return chosen


__all__ = ["PATTERNS", "Pattern", "Skip", "Applied", "select"]
