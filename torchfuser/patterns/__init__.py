"""The pattern registry, in matching order: a module is claimed by the first pattern that
recognises it as a candidate (``match`` returns a spec or a Skip). ``register_pattern`` adds a
user's own pattern (docs/extending.md)."""
from __future__ import annotations

from torchfuser.modules.base import FusedModule, adopt
from torchfuser.patterns.attention import AttentionPattern
from torchfuser.patterns.base import Applied, Pattern, Skip
from torchfuser.patterns.lm_head import LMHeadLossPattern
from torchfuser.patterns.mlp import GatedMLPPattern, MLPPattern
from torchfuser.patterns.moe import MoEPattern
from torchfuser.patterns.norms import LayerNormPattern, RMSNormPattern
from torchfuser.patterns.rel_pos_attention import RelPosAttentionPattern
from torchfuser.patterns.residual_norm import ResidualNormPattern
from torchfuser.patterns.varlen_attention import VarlenAttentionPattern

PATTERNS: dict[str, Pattern] = {p.name: p for p in (
    LMHeadLossPattern(), VarlenAttentionPattern(), RelPosAttentionPattern(), AttentionPattern(), RMSNormPattern(), LayerNormPattern(),
    MoEPattern(),  # before the MLPs: a block of experts is one candidate, its parts are not
    GatedMLPPattern(), MLPPattern(), ResidualNormPattern())}


def register_pattern(pattern: Pattern, *, before: str | None = None) -> Pattern:
    """Add ``pattern`` to the registry: offered every module after the patterns already there
    (``before=None``), or just ahead of the pattern named ``before`` (to see blocks that pattern
    would claim, e.g. report as skipped). Every later ``optimize`` uses it, unless ``patterns=`` /
    ``exclude=`` say otherwise; ``unregister_pattern(pattern.name)`` takes it out. Returns it."""
    if isinstance(pattern, type):
        raise TypeError(f"register_pattern takes a Pattern instance, got the class {pattern.__name__}: "
                        f"call register_pattern({pattern.__name__}())")
    if not isinstance(pattern, Pattern):
        raise TypeError(f"register_pattern takes a torchfuser.Pattern, got {type(pattern).__name__}")
    if not isinstance(pattern.name, str) or not pattern.name:
        raise ValueError(f"{type(pattern).__name__}.name must be a non-empty string: it names the pattern in the report")
    if type(pattern).match is Pattern.match:
        raise TypeError(f"{type(pattern).__name__} does not define match(module)")
    if pattern.fused is None and type(pattern).build is Pattern.build:
        raise TypeError(f"{type(pattern).__name__} sets no fused class and defines no build(module, spec, backend)")
    if pattern.name in PATTERNS:
        raise ValueError(f"a pattern named {pattern.name!r} is registered already; unregister_pattern({pattern.name!r}) first")
    if before is not None and before not in PATTERNS:
        raise ValueError(f"before={before!r} is no registered pattern; registered are {', '.join(PATTERNS)}")
    items = list(PATTERNS.items())
    at = len(items) if before is None else [n for n, _ in items].index(before)
    items.insert(at, (pattern.name, pattern))
    PATTERNS.clear()  # in place: torchfuser.PATTERNS is this very dict
    PATTERNS.update(items)
    return pattern


def unregister_pattern(name: str) -> Pattern:
    """Take the pattern ``name`` out of the registry (a built-in one too); returns it. Models fused
    already keep their fused blocks until ``restore``."""
    if name not in PATTERNS:
        raise KeyError(f"no pattern named {name!r} is registered; registered are {', '.join(PATTERNS)}")
    return PATTERNS.pop(name)


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
    rms, layer = (any(p.name == n for p in chosen) for n in ("rms_norm", "layer_norm"))
    if not (rms and layer):  # residual_norm runs fused only on fused norms
        chosen = [ResidualNormPattern(norms_fused=rms, layer_norms_fused=layer) if p.name == "residual_norm" else p
                  for p in chosen]
    return chosen


__all__ = ["PATTERNS", "Pattern", "Skip", "Applied", "FusedModule", "adopt", "register_pattern", "unregister_pattern",
           "select"]
