"""Mixture-of-experts blocks: a router and experts, fused when the experts are stacked (transformers 5).

A candidate has a router, a child whose 2-D ``weight`` maps the hidden size to E ≥ 2 expert scores
(an ``nn.Linear`` or a router module of its own), and E experts: a ModuleList / ModuleDict of E
small MLPs of one class (Mixtral before transformers 5), or stacked parameters whose first
dimension is E (transformers 5's ``gate_up_proj`` / ``down_proj``, JetMoE's), held by a child or by the
block itself. Per-expert modules that are plain MLPs are offered to the MLP patterns one by one (each
is an ordinary module call, exact when fused); the block stays as it is.

Stacked experts in one child are fused (``FusedMoE``) when the probes (``_moe_probe``) find what the
router, the experts and the block compute among the forms ``MoESpec`` describes: softmax or sigmoid
scores or a softmax of the top-k logits, renormalised, scaled, with a score correction and expert
groups (DeepSeek-V3); SiLU, tanh-GELU or GPT-OSS's clamped SwiGLU on [gate | up], [up | gate] or
interleaved halves, with or without biases, either weight layout; a shared expert, sigmoid-gated or not.
"""
from __future__ import annotations

import torch
from torch import nn

from torchfuser.modules.moe import FusedMoE
from torchfuser.patterns import _moe_probe as mp, _probe, _reasons
from torchfuser.patterns._moe_block import BlockProbe
from torchfuser.patterns.base import Pattern, Skip, further_inputs


def _stacked(module: nn.Module) -> list[torch.Size]:
    """Shapes of the 3-D direct parameters of ``module``, per-expert stacks if it is not a convolution."""
    if isinstance(module, nn.modules.conv._ConvNd):  # a conv's 3-D weight is channels × groups × width
        return []
    return [p.shape for p in module._parameters.values() if p is not None and p.dim() == 3]


def _experts(module: nn.Module):
    """(holder names, E, how, hidden widths they read or write) of the block's experts, else None:
    a list of E modules of one class, or two or more stacked parameters of E rows (one child, or
    the block itself (""), or one per child as JetMoE's input_linear / output_linear)."""
    for name, child in module._modules.items():
        if isinstance(child, (nn.ModuleList, nn.ModuleDict)) and len(child) >= 2:
            kids = list(child.values()) if isinstance(child, nn.ModuleDict) else list(child)
            if len({type(m) for m in kids}) == 1 and _mlp_like(kids[0]):
                dims = [d for m in kids[0]._modules.values() if (d := _probe.projection_dims(m))]
                return [name], len(kids), "modules", {d for pair in dims for d in pair}
    held = {"": _stacked(module)} | {n: _stacked(c) for n, c in module._modules.items() if c is not None}
    per = {n: min(s[0] for s in shapes) for n, shapes in held.items() if shapes}  # E of each holder
    if not per:
        return None
    e = max(per.values())  # shared experts stacked apart (Inkling) have fewer rows than the routed ones
    holders = [n for n in per if per[n] == e]
    shapes = [s for n in holders for s in held[n]]
    if len(shapes) < 2:
        return None
    return holders, e, "stacked", {d for s in shapes for d in s[1:]}


def _mlp_like(expert: nn.Module) -> bool:
    """An expert is a small MLP: leaf children only, two or three of them projections (not a
    stack of decoder layers, which a ModuleList of two would otherwise resemble)."""
    kids = [m for m in expert._modules.values() if m is not None]
    return (all(not m._modules for m in kids)
            and sum(_probe.projection_dims(m) is not None for m in kids) in (2, 3))


def _router(module: nn.Module, skip: list[str], e: int, widths: set[int]) -> str | None:
    """The child (or grandchild) whose 2-D weight scores at least E experts from a width they read:
    a Linear or a router of its own (not an embedding table)."""
    for name, child in module._modules.items():
        if child is None or name in skip:
            continue
        for sub_name, sub in [("", child), *child._modules.items()]:
            w = sub._parameters.get("weight") if sub is not None else None
            # ≥ E rows: routers may score extra, computation-free experts (LongCat's zero experts)
            if (w is not None and w.dim() == 2 and w.shape[0] >= e and w.shape[1] in widths
                    and not isinstance(sub, nn.Embedding)):
                return f"{name}.{sub_name}" if sub_name else name
    return None


def _layouts(three: dict, hidden: int) -> list[dict]:
    """Assignments of the two stacked weights to gate_up and down, and their layout, that fit the shapes."""
    out = []
    for gu, dn in (tuple(three), tuple(three)[::-1]):
        (_, a, b), (_, c, d) = three[gu].shape, three[dn].shape
        if b == hidden and c == hidden and a == 2 * d:
            out.append(dict(names={"gate_up": gu, "down": dn}, transposed=False, inner=d))
        if a == hidden and d == hidden and b == 2 * c:
            out.append(dict(names={"gate_up": gu, "down": dn}, transposed=True, inner=c))
    return out


def _biases(two: dict, names: dict, e: int, hidden: int, inner: int) -> dict | None:
    """{"gate_up_bias": name, "down_bias": name} for the experts' 2-D parameters, or None if they do not fit."""
    if not two:
        return {}
    want = {"gate_up_bias": (e, 2 * inner), "down_bias": (e, hidden)}
    out = {}
    for role, shape in want.items():
        weight = names[role.removesuffix("_bias")]
        fits = [n for n, p in two.items() if tuple(p.shape) == shape]
        named = [n for n in fits if n.startswith(weight)]
        pick = named or (fits if len(fits) == 1 else [])
        if len(pick) != 1:
            return None
        out[role] = pick[0]
    return out if len(set(out.values())) == 2 else None


def _acts(experts: nn.Module) -> list[dict]:
    """Activation fields to try: the experts' own act_fn's kind first, then the others."""
    kinds = [k for m in experts._modules.values() if m is not None and (k := _probe.activation_kind(m))]
    found = [{"activation": k} for k in kinds if k in ("silu", "gelu_tanh")]
    _, alpha = mp.find_attr([experts], "alpha", float)
    _, limit = mp.find_attr([experts], "limit", float)
    if alpha is not None and limit is not None:
        found.append({"activation": "clamped_swiglu", "alpha": alpha, "limit": limit})
    found += [{"activation": k} for k in ("silu", "gelu_tanh") if {"activation": k} not in found]
    return [{**a, "halves": h} for a in found for h in ("gate_up", "up_gate", "interleaved")]


def _adapter(module: nn.Module) -> bool:
    """A PEFT LoRA layer (a ``base_layer`` and adapters): PEFT's ParamWrapper wraps stacked experts."""
    return isinstance(getattr(module, "base_layer", None), nn.Module) and hasattr(module, "lora_A")


def _wrapped_experts(module: nn.Module):
    """(child name, E, widths) of a child that is PEFT adapters around stacked expert weights, else None."""
    for name, child in module._modules.items():
        inner = child
        while inner is not None and _adapter(inner):
            inner = inner.base_layer
        shapes = _stacked(inner) if inner is not child else []
        if len(shapes) >= 2:
            return name, shapes[0][0], {d for sh in shapes for d in sh[1:]}
    return None


class MoEPattern(Pattern):
    name = "moe"
    description = "mixture-of-experts block (router top-k + stacked gated experts + shared expert) → fused MoE"
    fused = FusedMoE

    def match(self, module: nn.Module):
        if _adapter(module):  # an adapter's base layer is no router, its lora_A no expert
            return None
        if (wrapped := _wrapped_experts(module)) and (router := _router(module, [wrapped[0]], *wrapped[1:])):
            return Skip(f"mixture-of-experts block ({wrapped[1]} experts stacked in {wrapped[0]!r}, router {router!r}): "
                        "PEFT adapters on its experts' weights (target_parameters); the fused MoE runs no adapters, so "
                        "its experts run as the model's own code")
        found = _experts(module)
        if found is None or found[1] < 2:
            return None
        holders, e, how, widths = found
        router = _router(module, holders, e, widths)
        if router is None:
            return None
        if how == "modules":
            return Skip(f"mixture-of-experts block ({e} experts as {e} modules in {holders[0]!r}, router {router!r}): "
                        "per-expert modules are not fused as one block; each expert that is a plain MLP is fused on its own")
        where = ", ".join(repr(n) for n in holders if n) or "the block itself"
        head = f"mixture-of-experts block ({e} experts as stacked per-expert weights in {where}, router {router!r})"
        why = _stacked_block(module, holders, e, router)
        return Skip(f"{head}: {why.reason}; its experts run as the model's own code") if isinstance(why, Skip) else why


def _stacked_block(module: nn.Module, holders: list[str], e: int, router_path: str):
    """The MoESpec of a block whose experts are stacked in one child, or a Skip."""
    if len(holders) != 1 or not holders[0]:
        return Skip("the fused MoE reads the stacked weights from one experts module, not split across several "
                    "or held by the block")
    ex_name, router_name = holders[0], router_path.split(".")[0]
    experts, weight = module._modules[ex_name], module.get_submodule(router_path)._parameters["weight"]
    hidden = weight.shape[1]
    if weight.shape[0] != e:
        return Skip(f"its router scores {weight.shape[0]} experts for {e} held (computation-free extra experts)")
    if more := further_inputs(module):
        return Skip(f"its forward takes more than the hidden states ({_reasons.quoted(more)})")
    own = {n: t for n, t in (*module._parameters.items(), *module._buffers.items()) if t is not None}
    own_corr = [n for n, t in own.items() if t.is_floating_point() and t.numel() == e and t.dim() <= 2]
    if len(own) > len(own_corr) or len(own_corr) > 1:  # one (E,) tensor may be a score correction (MiniMax-M2)
        return Skip(f"tensors of its own besides its children's ({_reasons.quoted(own)}): the fused MoE would not "
                    "compute with them")
    three = {n: p for n, p in experts._parameters.items() if p is not None and p.dim() == 3}
    two = {n: p for n, p in experts._parameters.items() if p is not None and p.dim() == 2}
    rest = [n for n, *_ in mp.named_tensors(experts) if n not in three and n not in two]
    if len(three) != 2 or len(two) not in (0, 2) or rest:
        return Skip(f"its experts hold {', '.join(f'{n} {tuple(t.shape)}' for n, _, _, t in mp.named_tensors(experts))}: "
                    "not one stacked gate_up and one down projection (with both biases or none)")
    layouts = []
    for lay in _layouts(three, hidden):
        biases = _biases(two, lay["names"], e, hidden, lay["inner"])
        if biases is not None:
            layouts.append(dict(names={**lay["names"], **biases}, transposed=lay["transposed"]))
    if not layouts:
        return Skip("its experts' weights are not gated (E, 2I, H) / (E, H, I) stacks, nor their transposes")
    return _probe_block(module, ex_name, router_name, router_path, e, hidden, layouts, own_corr[0] if own_corr else None)


def _probe_block(module, ex_name, router_name, router_path, e, hidden, layouts, own_corr):
    gen = _probe.generator(7)
    router = module._modules[router_name]
    rel = router_path.split(".", 1)[1] + "." if "." in router_path else ""
    tensors = {n: t for n, _, _, t in mp.named_tensors(router)}
    bias_name = rel + "bias" if isinstance(tensors.get(rel + "bias"), torch.Tensor) else None
    corr = [n for n, t in tensors.items() if n not in (rel + "weight", bias_name) and t.is_floating_point()
            and t.numel() == e and t.dim() <= 2]
    odd = [n for n, t in tensors.items() if n not in (rel + "weight", bias_name, *corr) and t.is_floating_point()]
    if odd or len(corr) + (own_corr is not None) > 1 or (bias_name and tensors[bias_name].shape != (e,)):
        return Skip(f"its router holds {_reasons.quoted(odd or corr)} besides its weight and bias: not a form the fused "
                    "router computes")
    rcopy = mp.tree_copy(router)
    fresh = {rel + "weight": _probe.randn(e, mp.H_P, gen=gen) / mp.H_P ** 0.5}
    for n in ([bias_name] if bias_name else []) + corr:
        fresh[n] = _probe.randn(*tensors[n].shape, gen=gen) * 0.5
    for name, owner, leaf, t in mp.named_tensors(rcopy):
        if name in fresh:
            store = owner._parameters if leaf in owner._parameters else owner._buffers
            store[leaf] = nn.Parameter(fresh[name], requires_grad=False) if store is owner._parameters else fresh[name]
    mp.shrink_hidden(rcopy.modules(), hidden)
    return BlockProbe(module, ex_name, router_name, rcopy, rel, bias_name, corr[0] if corr else None, own_corr, e,
                      hidden, layouts, _acts(module._modules[ex_name]), gen).run()
