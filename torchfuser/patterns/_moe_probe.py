"""Probes of a mixture-of-experts block: what its router, its experts and the block around them compute.

Each part is checked on its own against the fused ops (reference backend), on small random CPU
tensors, never the model's (widths ``H_P`` and ``I_P``; the number of experts and the top-k stay the
model's, since the routing depends on them):

- the block in fp64 with the experts replaced by a recorder and a shared expert by a stand-in: the
  router's choice and weights as the recorder received them, the router's own logits, and the output
  as the recorder's result plus the stand-in's (sigmoid-gated or not), in eval and in training;
- the experts module, called as the block calls it (hidden, indices, weights), in fp32 (transformers'
  grouped-GEMM experts take no fp64), for each layout its weights' shapes allow;
- the whole fused module against the block, fp32, with the real experts probed above.
"""
from __future__ import annotations

import inspect

import torch
from torch import nn

from torchfuser import functional as F
from torchfuser.patterns import _probe
from torchfuser.patterns.base import Skip

H_P, I_P = 12, 4  # rows of 16-byte multiples in fp32 (grouped GEMMs need them); 2·I_P ≠ H_P
_SHAPE = (2, 8)  # probe tokens: batch × sequence


class Recorder(nn.Module):
    """Keeps its arguments. Stands in for the experts (returns a fixed random function of the hidden
    states), or wraps the router's probe copy ``inner`` (returns what it returns)."""

    def __init__(self, mix: torch.Tensor | None, inner: nn.Module | None = None):
        super().__init__()
        self.mix, self.calls = mix, []
        self.__dict__["inner"] = inner  # not a child: its tensors are not the recorder's

    def forward(self, *args, **kwargs):
        self.calls.append((args, kwargs))
        if self.inner is not None:
            return self.inner(*args, **kwargs)
        return args[0] @ self.mix.to(args[0].dtype)


class StandIn(nn.Module):
    """Stands in for the shared expert: a fixed random per-token function of what it is given (kept in ``calls``)."""

    def __init__(self, mix: torch.Tensor):
        super().__init__()
        self.mix, self.calls = mix, []

    def forward(self, x):
        self.calls.append(x)
        return torch.tanh(x @ self.mix.to(x.dtype))


def tree_copy(module: nn.Module) -> nn.Module:
    """``shallow_copy`` of a module and all its descendants (own dicts; tensors and code shared)."""
    probe = _probe.shallow_copy(module)
    for name, child in module._modules.items():
        if child is not None:
            probe._modules[name] = tree_copy(child)
    return probe


_WIDTH_WORDS = ("hidden", "size", "dim", "embed", "width")


def shrink_hidden(modules, hidden: int) -> None:
    """Int attributes named like a width and equal to the hidden one, set to ``H_P`` (forwards reshape by
    them: ``hidden_dim``, Granite's ``input_size``)."""
    for m in modules:
        for name, value in list(vars(m).items()):
            if any(w in name for w in _WIDTH_WORDS) and type(value) is int and value == hidden:
                m.__dict__[name] = H_P


def named_tensors(module: nn.Module):
    """(dotted name, owner, leaf name, tensor) of every parameter and buffer under ``module``."""
    for prefix, m in module.named_modules():
        for store in (m._parameters, m._buffers):
            for name, t in store.items():
                if t is not None:
                    yield (f"{prefix}.{name}" if prefix else name), m, name, t


def set_tensor(owner: nn.Module, leaf: str, t: torch.Tensor) -> None:
    if leaf in owner._parameters:
        owner._parameters[leaf] = nn.Parameter(t, requires_grad=False)
    else:
        owner._buffers[leaf] = t


def tensor_at(module: nn.Module, dotted: str | None):
    return None if dotted is None else next(t for n, _, _, t in named_tensors(module) if n == dotted)


def find_attr(modules, word: str, kind):
    """(name, value) of the first attribute of ``kind`` whose name has ``word``, on any of ``modules``."""
    for m in modules:
        for name, value in vars(m).items():
            if type(value) is kind and word in name:
                return name, value
    return None, None


def same_routing(idx, w, ref_idx, ref_w) -> bool:
    """Whether two (T, k) choices pick the same experts with the same weights, in any order within a row."""
    if idx.shape != ref_idx.shape or ref_idx.dtype != idx.dtype:
        return False
    a, pa = idx.sort(-1)
    b, pb = ref_idx.sort(-1)
    return torch.equal(a, b) and _probe.close(w.gather(-1, pa), ref_w.gather(-1, pb))


def route_candidates(n_group: int, topk_group: int, scale: float, correction: bool):
    """(MoESpec router fields, whether the correction is used) to try, every hint found used first."""
    groups = [(n_group, topk_group, 2), (n_group, topk_group, 1), (1, 1, 2)] if n_group > 1 else [(1, 1, 2)]
    scales = [scale, 1.0] if scale != 1.0 else [1.0]
    for scoring in ("softmax", "sigmoid", "softmax_topk"):
        plain = scoring == "softmax_topk"
        for renorm in (False,) if plain else (True, False):
            for corr in (True, False) if correction and not plain else (False,):
                for g, tg, top in [(1, 1, 2)] if plain else groups:
                    for sc in scales:
                        yield dict(scoring=scoring, renorm=renorm, n_group=g, topk_group=tg, group_top=top, scale=sc), corr


def _call_args(experts: nn.Module, args, kwargs):
    """The experts' call as (hidden, indices, weights, (position of indices, of weights)), or None."""
    try:
        values = list(inspect.signature(experts.forward).bind(*args, **kwargs).arguments.values())
    except (TypeError, ValueError):
        return None
    if len(values) != 3 or not all(isinstance(v, torch.Tensor) for v in values) or not values[0].is_floating_point():
        return None
    ints = [i for i in (1, 2) if not values[i].is_floating_point()]
    if len(ints) != 1:
        return None
    i = ints[0]
    return values[0], values[i], values[3 - i], (i, 3 - i)


def _ordered(x, idx, w, order):
    args = [x, None, None]
    args[order[0]], args[order[1]] = idx, w
    return args


def _experts_op(x, idx, w, tensors: dict, fields: dict):
    d = lambda t: None if t is None else t.double()  # noqa: E731
    return F.moe_experts(x.double(), w.double(), idx, d(tensors["gate_up"]), d(tensors["down"]),
                         gate_up_bias=d(tensors.get("gate_up_bias")), down_bias=d(tensors.get("down_bias")),
                         transposed=fields["transposed"], halves=fields["halves"], activation=fields["activation"],
                         alpha=fields.get("alpha", 1.0), limit=fields.get("limit", 0.0), backend="reference")


def probe_experts(experts: nn.Module, layouts: list[dict], acts: list[dict], e: int, k: int, order, hidden: int):
    """(layout + activation fields, the experts' fp32 probe copy) the experts compute, or (Skip, None)."""
    gen = _probe.generator(11)
    idx = torch.stack([torch.randperm(e, generator=gen)[:k] for _ in range(_SHAPE[0] * _SHAPE[1])])
    w = torch.rand(idx.shape, generator=gen, dtype=torch.float64).float() + 0.1
    # A second, larger input drives pre-activations past a SwiGLU clamp limit.
    xs = [(_probe.randn(idx.shape[0], H_P, gen=gen) * s).float() for s in (1.0, 8.0)]
    errors = []
    for layout in layouts:
        two = 2 * I_P
        shapes = {"gate_up": (e, H_P, two) if layout["transposed"] else (e, two, H_P),
                  "down": (e, I_P, H_P) if layout["transposed"] else (e, H_P, I_P),
                  "gate_up_bias": (e, two), "down_bias": (e, H_P)}
        probe = tree_copy(experts)
        shrink_hidden(probe.modules(), hidden)
        tensors = {role: (_probe.randn(*shapes[role], gen=gen) / H_P ** 0.5).float() for role in layout["names"]}
        for role, name in layout["names"].items():
            set_tensor(probe, name, tensors[role])
        try:
            with torch.no_grad():
                got = [probe(*_ordered(x, idx, w, order)) for x in xs]
        except Exception as err:
            errors.append(f"{type(err).__name__}: {str(err).splitlines()[0] if str(err) else ''}")
            continue
        for act in acts:
            fields = {"names": layout["names"], "transposed": layout["transposed"], **act}
            if all(_probe.close(y, _experts_op(x, idx, w, tensors, fields)) for x, y in zip(xs, got)):
                return fields, probe
    if len(errors) == len(layouts):
        return Skip(f"its experts do not run on (hidden, indices, weights) in any weight layout tried ({errors[0]})"), None
    return Skip("its experts compute none of act(x·gate_upᵀ)·downᵀ weighted by the router (SiLU, tanh-GELU or GPT-OSS's "
                "clamped SwiGLU; [gate | up], [up | gate] or interleaved halves; biases where held)"), None
