"""MLP blocks: gated (gate/up/down or a fused gate_up) and plain (fc_in → GELU, ReLU or squared ReLU → fc_out,
perhaps + a residual the forward is passed: BLOOM's and MPT's MLPs add it themselves).

A candidate has two or three projection children (``nn.Linear`` or GPT-2's ``Conv1D``; or a wrapped projection,
Gemma 4's ``Gemma4ClippableLinear``: one Linear in a module that clamps around it, called as it is) whose
shapes chain H → I → H, a parameter-free activation child and perhaps a dropout. Which
projection is the gate, the order of a fused ``gate_up`` and where the dropout sits are
decided by a probe: the block's own forward, run with small random projections, must equal
the formula exactly.
"""
from __future__ import annotations

import dataclasses
import inspect
from dataclasses import dataclass, field

import torch
from torch import nn

from torchfuser.modules.adapters import lora
from torchfuser.modules.mlp import FusedGatedMLP, FusedMLP, GatedMLPSpec, MLPSpec
from torchfuser.patterns import _probe, _reasons
from torchfuser.patterns._attention_projections import linear_of, projection_dims
from torchfuser.patterns.base import Pattern, Skip

_H, _I = 8, 12  # probe widths: small, and I ≠ H so that shapes cannot line up by accident
_ACT_FNS = {
    "silu": torch.nn.functional.silu,
    "gelu_tanh": lambda t: torch.nn.functional.gelu(t, approximate="tanh"),
    "gelu": torch.nn.functional.gelu,
    "relu": torch.relu,
    "relu2": lambda t: torch.relu(t) ** 2,
}


_ACT_WORDS = {"silu": "SiLU", "gelu_tanh": "tanh-GELU", "gelu": "exact (erf) GELU", "relu": "ReLU",
              "relu2": "squared ReLU"}
_PLAIN_ACTS = ("gelu", "gelu_tanh", "relu", "relu2")  # the plain MLP's kernels: gelu and activation


def _unknown(module: nn.Module, names: list[str]) -> str:
    return (f"unrecognised submodules {names} ({_reasons.children(module, names)}) besides its projections and "
            "activation: the fused MLP would not compute them")


def _lora_problem(module: nn.Module, parts: "_Parts") -> str | None:
    return next(filter(None, (lora.unsupported(n, module._modules[n]) for n in parts.proj)), None)


@dataclass
class _Parts:
    proj: dict[str, tuple[int, int]]
    act: str
    act_kind: str
    dropout: str | None
    others: list[str] = field(default_factory=list)


class _Scale(nn.Module):
    """Stands in for dropout in the probe: a visible, deterministic mark of where it is applied."""

    def forward(self, x):
        return 3.0 * x


def _parts(module: nn.Module) -> _Parts | None:
    # A projection under a PEFT adapter counts as the projection it wraps (the fused MLPs run LoRA); a wrapped
    # projection (Gemma 4's ClippableLinear: clamps around one Linear) as its Linear's widths, called as it is.
    proj = {n: d for n, m in module._modules.items() if m is not None and (d := projection_dims(m))}
    if len(proj) not in (2, 3) or len(module._parameters):
        return None
    rest = [n for n in module._modules if n not in proj]
    acts = [(n, k) for n in rest if (k := _probe.activation_kind(module._modules[n]))]
    drops = [n for n in rest if isinstance(module._modules[n], nn.Dropout)]
    if len(acts) != 1 or len(drops) > 1:
        return None
    others = [n for n in rest if n != acts[0][0] and n not in drops]
    if any(_probe.projection_dims(sub) for n in others for sub in module._modules[n].modules()):
        return None  # projections inside another child: a bigger block (a decoder layer), not an MLP
    return _Parts(proj, acts[0][0], acts[0][1], drops[0] if drops else None, others)


def _residual_arg(module: nn.Module) -> str | None:
    """The one argument besides the input that the forward requires, if any (BLOOM's and MPT's MLPs take
    the residual and add it themselves): the probe passes a random tensor there and tells whether it is."""
    try:
        params = list(inspect.signature(module.forward).parameters.values())[1:]
    except (TypeError, ValueError):
        return None
    required = [p.name for p in params if p.default is p.empty and p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY)]
    return required[0] if len(required) == 1 else None


def _inputs(gen, residual: str | None):
    """The probe's input, and a residual of its shape where the forward takes one."""
    x = _probe.randn(_probe.PROBE_ROWS, _H, gen=gen)
    return (x,) if residual is None else (x, _probe.randn(_probe.PROBE_ROWS, _H, gen=gen))


def _probe_module(module: nn.Module, parts: _Parts, widths: dict[str, tuple[int, int]], what: str,
                  residual: str | None = None):
    gen = _probe.generator(4)
    probe = _probe.shallow_copy(module)
    small = {n: _probe.small_projection(linear_of(module._modules[n]), *widths[n], gen) for n in widths}
    probe._modules.update(small)
    if parts.dropout is not None:
        probe._modules[parts.dropout] = _Scale()
    xs = _inputs(gen, residual)
    try:
        return small, xs, _probe.run(probe, *xs)
    except Exception as err:
        return small, xs, Skip(_reasons.failed_probe(module, err, what))


def _in_training(module: nn.Module, spec, small: dict, fused_cls):
    """``spec`` with the dropout ``module`` applies in training, or a Skip. The probe copy runs in
    training mode against the fused module from one seed; every dropout gets a p of its own, even
    one configured at 0 (a functional dropout reads its p at each call, so p = 0 today says nothing
    about tomorrow). Candidates after the last projection: the one the eval probe found, none, each
    Dropout child, each float attribute named like a dropout probability (Seed-OSS, Starcoder2)."""
    gen = _probe.generator(6)
    probe = _probe.shallow_copy(module)
    probe._modules.update(small)
    children = [n for n, m in module._modules.items() if isinstance(m, nn.Dropout)]
    floats = _probe.float_dropouts(module)
    for i, n in enumerate(children):
        probe._modules[n] = nn.Dropout(0.15 + 0.1 * i)
    for i, n in enumerate(floats):
        probe.__dict__[n] = 0.2 + 0.1 * i
    probe.training = True
    xs = _inputs(gen, getattr(spec, "residual", None))
    for candidate in _candidates(spec, [*children, *floats]):
        fused = fused_cls(probe, candidate, "reference")
        fused.training = True
        with torch.no_grad(), _probe.saved_rng():
            _probe.seed_cpu(0)
            want = type(probe).forward(probe, *xs)  # the class's forward: no hooks
            _probe.seed_cpu(0)
            got = fused(*xs)
        if _probe.close(got, want):
            return candidate
    return Skip("in training its output differs from the fused MLP with any dropout found after the last "
                "projection and any before it (a dropout elsewhere, or another training-only step)")


def _candidates(spec, names: list[str]):
    """Where the dropouts may sit: the one the eval probe found; after the last projection (``dropout``) each
    name or none, and on the activation's output before it (``inner_dropout``) each other name or none."""
    outer = dict.fromkeys([spec.dropout, spec.inner_dropout, None, *names])
    seen = set()
    for first in (spec, *(dataclasses.replace(spec, dropout=o, inner_dropout=i) for o in outer for i in (None, *names)
                          if i is None or i != o)):
        key = (first.dropout, first.inner_dropout)
        if key not in seen:
            seen.add(key)
            yield first


def _dropout_place(y, last: nn.Module, h, dropout: str | None, rest=0.0) -> dict | None:
    """Where the eval probe's stand-in for the Dropout child (``_Scale``: 3·) acts: {"dropout": name} after the
    last projection, {"inner_dropout": name} on its input h (ModernBERT-decoder), {} without one; None if y is
    neither (the training probe then tells the two apart where a bias-free projection makes them agree)."""
    if dropout is None:
        return {} if _probe.close(y, last(h) + rest) else None
    if _probe.close(y, 3.0 * last(h) + rest):
        return {"dropout": dropout}
    return {"inner_dropout": dropout} if _probe.close(y, last(3.0 * h) + rest) else None


def _roles_by_shape(parts: _Parts) -> list[dict]:
    """Every assignment of a gated MLP's projections to roles that their shapes allow, as (widths of the
    probe's projections, layouts to try). More than one where shapes coincide: with an intermediate
    size equal to the hidden size every projection of gate / up / down is H → H, and the probe, whose
    widths differ, tells which is which (a wrong assignment does not even run)."""
    proj, names = parts.proj, list(parts.proj)
    found = []
    if len(names) == 3:
        for down in names:
            a, b = [n for n in names if n != down]
            if proj[a] == proj[b] and proj[a] == proj[down][::-1]:  # gate, up: H → I; down: I → H
                found.append(dict(down=down, widths={a: (_H, _I), b: (_H, _I), down: (_I, _H)},
                                  layouts=[dict(gate=a, up=b), dict(gate=b, up=a)]))
    else:
        for down, gate_up in (names, names[::-1]):
            if proj[gate_up][1] == 2 * proj[down][0] and proj[down][1] == proj[gate_up][0]:
                found.append(dict(down=down, widths={gate_up: (_H, 2 * _I), down: (_I, _H)},
                                  layouts=[dict(gate_up=gate_up, gate_first=True), dict(gate_up=gate_up, gate_first=False)]))
    return found


class GatedMLPPattern(Pattern):
    name = "gated_mlp"
    description = "down(act(gate(x))·up(x)), SiLU → swiglu, tanh-GELU → geglu, exact (erf) GELU → geglu(approximate='none')"
    fused = FusedGatedMLP

    def match(self, module):
        parts = _parts(module)
        if parts is None:
            return None
        roles = _roles_by_shape(parts)
        if not roles:
            return None
        if parts.others:
            return Skip(_unknown(module, parts.others))
        if why := _lora_problem(module, parts):
            return Skip(why)
        if parts.act_kind not in ("silu", "gelu_tanh", "gelu"):
            return Skip(f"a gated MLP with {_ACT_WORDS[parts.act_kind]}: that activation has no fused gated kernel "
                        "(SiLU, tanh-GELU and exact GELU do)")
        skips = []
        for role in roles:
            found = self._probe_roles(module, parts, **role)
            if not isinstance(found, Skip):
                return found
            skips.append(found)
        # Where shapes allowed several assignments, the one whose probe ran says why (the others raised).
        return next((s for s in skips if s.reason.startswith(_DOES_NOT)), skips[0])

    @staticmethod
    def _probe_roles(module, parts: _Parts, down: str, widths: dict, layouts: list[dict]):
        small, (x,), y = _probe_module(module, parts, widths, "MLPs computing down(act(gate(x))·up(x)) from x alone")
        if isinstance(y, Skip):
            return y
        act = _ACT_FNS[parts.act_kind]
        for layout in layouts:
            if "gate_up" in layout:
                g, u = small[layout["gate_up"]](x).chunk(2, dim=-1)
                g, u = (g, u) if layout["gate_first"] else (u, g)
            else:
                g, u = small[layout["gate"]](x), small[layout["up"]](x)
            where = _dropout_place(y, small[down], act(g) * u, parts.dropout)
            if where is not None:
                spec = GatedMLPSpec(activation=parts.act_kind, down=down, keep=(parts.act,), **where, **layout)
                return _in_training(module, spec, small, FusedGatedMLP)
        return Skip(f"{_DOES_NOT} down(act(gate(x))·up(x)) (a dropout before or after down)")


_DOES_NOT = "forward does not compute"


class MLPPattern(Pattern):
    name = "mlp"
    description = ("fc_out(act(fc_in(x))) with erf or tanh GELU (GPT-2 Conv1D, NeoX, Phi, Starcoder2), ReLU or "
                   "squared ReLU (Nemotron, Persimmon); + a residual argument (BLOOM, MPT)")
    fused = FusedMLP

    def match(self, module):
        parts = _parts(module)
        if parts is None or len(parts.proj) != 2:
            return None
        # fc_in: H → I, fc_out: I → H. Both ways where I = H: the probe (I ≠ H) tells which.
        orders = [(a, b) for a, b in (tuple(parts.proj), tuple(parts.proj)[::-1])
                  if parts.proj[a] == parts.proj[b][::-1]]
        if not orders:
            return None
        if parts.others:
            return Skip(_unknown(module, parts.others))
        if why := _lora_problem(module, parts):
            return Skip(why)
        if parts.act_kind not in _PLAIN_ACTS:
            return Skip(f"an ungated MLP with {_ACT_WORDS[parts.act_kind]}, fc_out(act(fc_in(x))): only ungated MLPs "
                        "with GELU (erf or tanh), ReLU or squared ReLU are fused")
        skips = []
        for fc_in, fc_out in orders:
            found = self._probe_roles(module, parts, fc_in, fc_out)
            if not isinstance(found, Skip):
                return found
            skips.append(found)
        return next((s for s in skips if s.reason.startswith(_DOES_NOT)), skips[0])

    @staticmethod
    def _probe_roles(module, parts: _Parts, fc_in: str, fc_out: str):
        residual = _residual_arg(module)
        small, xs, y = _probe_module(module, parts, {fc_in: (_H, _I), fc_out: (_I, _H)},
                                     "MLPs computing fc_out(act(fc_in(x))) from x (and adding a residual)", residual)
        if isinstance(y, Skip):
            return y
        rest = xs[1] if residual is not None else 0.0
        where = _dropout_place(y, small[fc_out], _ACT_FNS[parts.act_kind](small[fc_in](xs[0])), parts.dropout, rest)
        if where is None:
            return Skip(f"{_DOES_NOT} fc_out(act(fc_in(x))) (a dropout before or after fc_out" +
                        (f", then + {residual})" if residual else ")"))
        approximate = "tanh" if parts.act_kind == "gelu_tanh" else "none"
        activation = "gelu" if parts.act_kind.startswith("gelu") else parts.act_kind
        spec = MLPSpec(fc_in=fc_in, fc_out=fc_out, approximate=approximate, keep=(parts.act,),
                       activation=activation, residual=residual, **where)
        return _in_training(module, spec, small, FusedMLP)
