"""Mixture-of-experts blocks, recognised so that the report lists them (none is fused yet).

A candidate has a router, a child whose 2-D ``weight`` maps the hidden size to E ≥ 2 expert scores
(an ``nn.Linear`` or a router module of its own), and E experts: a ModuleList / ModuleDict of E
small MLPs of one class (Mixtral before transformers 5), or stacked parameters whose first
dimension is E (transformers 5's ``gate_up_proj`` / ``down_proj``, JetMoE's), held by a child or by the
block itself. Per-expert modules that are plain MLPs are still offered to the MLP patterns one by
one (each is an ordinary module call, exact when fused); stacked experts are nobody's.
"""
from __future__ import annotations

import torch
from torch import nn

from torchfuser.patterns import _probe
from torchfuser.patterns.base import Pattern, Skip


def _stacked(module: nn.Module) -> list[torch.Size]:
    """Shapes of the 3-D direct parameters of ``module``, per-expert stacks if it is not a convolution."""
    if isinstance(module, nn.modules.conv._ConvNd):  # a conv's 3-D weight is channels × groups × width
        return []
    return [p.shape for p in module._parameters.values() if p is not None and p.dim() == 3]


def _experts(module: nn.Module):
    """(name or names, E, how, hidden widths they read or write) of the block's experts, else None:
    a list of E modules of one class, or two or more stacked parameters of E rows (one child, or
    the block itself, or one per child as JetMoE's input_linear / output_linear)."""
    for name, child in module._modules.items():
        if isinstance(child, (nn.ModuleList, nn.ModuleDict)) and len(child) >= 2:
            kids = list(child.values()) if isinstance(child, nn.ModuleDict) else list(child)
            if len({type(m) for m in kids}) == 1 and _mlp_like(kids[0]):
                dims = [d for m in kids[0]._modules.values() if (d := _probe.projection_dims(m))]
                return name, len(kids), "modules", {d for pair in dims for d in pair}
    held = {"": _stacked(module)} | {n: _stacked(c) for n, c in module._modules.items() if c is not None}
    per = {n: min(s[0] for s in shapes) for n, shapes in held.items() if shapes}  # E of each holder
    if not per:
        return None
    e = max(per.values())  # shared experts stacked apart (Inkling) have fewer rows than the routed ones
    holders = [n for n in per if per[n] == e]
    shapes = [s for n in holders for s in held[n]]
    if len(shapes) < 2:
        return None
    return ", ".join(repr(n) for n in holders if n), e, "stacked", {d for s in shapes for d in s[1:]}


def _mlp_like(expert: nn.Module) -> bool:
    """An expert is a small MLP: leaf children only, two or three of them projections (not a
    stack of decoder layers, which a ModuleList of two would otherwise resemble)."""
    kids = [m for m in expert._modules.values() if m is not None]
    return (all(not m._modules for m in kids)
            and sum(_probe.projection_dims(m) is not None for m in kids) in (2, 3))


def _router(module: nn.Module, skip: str, e: int, widths: set[int]) -> str | None:
    """The child (or grandchild) whose 2-D weight scores at least E experts from a width they read:
    a Linear or a router of its own (not an embedding table)."""
    for name, child in module._modules.items():
        if child is None or repr(name) in skip or name == skip:
            continue
        for sub_name, sub in [("", child), *child._modules.items()]:
            w = sub._parameters.get("weight") if sub is not None else None
            # ≥ E rows: routers may score extra, computation-free experts (LongCat's zero experts)
            if (w is not None and w.dim() == 2 and w.shape[0] >= e and w.shape[1] in widths
                    and not isinstance(sub, nn.Embedding)):
                return f"{name}.{sub_name}" if sub_name else name
    return None


class MoEPattern(Pattern):
    name = "moe"
    description = "mixture-of-experts block (router + experts): listed, not fused yet"

    def match(self, module: nn.Module):
        found = _experts(module)
        if found is None or found[1] < 2:
            return None
        experts, e, how, widths = found
        router = _router(module, experts, e, widths)
        if router is None:
            return None
        if how == "modules":
            held, tail = f"{e} modules in {experts!r}", "each expert that is a plain MLP is fused on its own"
        else:
            held = f"stacked per-expert weights in {experts}" if experts else "stacked per-expert weights"
            tail = "its experts run as the model's own code"
        return Skip(f"mixture-of-experts block ({e} experts as {held}, router {router!r}): not fused yet; {tail}")
