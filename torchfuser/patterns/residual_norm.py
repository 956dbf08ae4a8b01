"""Pre-norm decoder layers whose residual adds can go into their RMSNorms.

A candidate has an attention, an MLP and two RMSNorm children under Llama's names. Its forward
is probed with stand-ins for the four children: simple random maps that record how they are
called. The layer qualifies when its output is exactly

    s = x + attention(norm_in(x))[0];   out = s + mlp(norm_mid(s))

(in training mode, every dropout of the layer at p = 0.5, so that one between the blocks shows; if
one does, the layer still qualifies when the formula holds with them at 0, and its fused forward
runs only while they are off: ``ResidualNormSpec.dropouts``), and when the attention receives
norm_in's output by keyword and each of the forward's other arguments unchanged, which the probe
tells apart with a marker object per argument. What the probe learns is the ``ResidualNormSpec``.
"""
from __future__ import annotations

import copy
import inspect
import warnings

import torch
from torch import nn

from torchfuser.modules import residual_norm
from torchfuser.modules.norms import FusedRMSNorm
from torchfuser.modules.residual_norm import ResidualNormSpec
from torchfuser.patterns import _probe
from torchfuser.patterns.base import Applied, Pattern, Skip
from torchfuser.patterns.norms import RMSNormPattern

_CHILDREN = ("self_attn", "mlp", "input_layernorm", "post_attention_layernorm")
# Keywords transformers' decorators have accepted in place of a layer's cache argument.
_CACHE_ALIASES = ("past_key_values", "past_key_value", "cache", "layer_past")
_EXTRA = "_torchfuser_probe_extra"
_WIDTH = 8


class _Marker:
    """A value the probe passes for one argument, to see where it arrives."""

    def __init__(self, name: str):
        self.name = name

    def __repr__(self) -> str:
        return f"<{self.name}>"


class _StandIn(nn.Module):
    """Computes ``fn`` and records each call's arguments."""

    def __init__(self, fn, tuple_out: bool = False):
        super().__init__()
        self.fn, self.tuple_out, self.calls = fn, tuple_out, []

    def forward(self, *args, **kwargs):
        self.calls.append((args, kwargs))
        x = args[0] if args else next(v for v in kwargs.values() if isinstance(v, torch.Tensor))
        y = self.fn(x)
        return (y, None) if self.tuple_out else y


def _signature(module: nn.Module):
    """(first parameter, [(name, default)] of the rest, takes **kwargs) or a Skip."""
    params = list(inspect.signature(type(module).forward).parameters.values())[1:]
    if not params or params[0].kind not in (params[0].POSITIONAL_ONLY, params[0].POSITIONAL_OR_KEYWORD):
        return Skip("its forward does not take the hidden states first")
    rest, extra = [], False
    for p in params[1:]:
        if p.kind is p.VAR_KEYWORD:
            extra = True
        elif p.kind is p.VAR_POSITIONAL or p.default is p.empty:
            return Skip(f"its forward requires {p.name!r} (it has no default); only layers whose arguments after the "
                        "hidden states all have defaults are fused")
        else:
            rest.append((p.name, p.default))
    return params[0].name, rest, extra


class _Probe:
    """The layer's forward run on stand-in children, in training mode."""

    def __init__(self, module: nn.Module):
        gen = _probe.generator(5)
        a, m = (_probe.randn(_WIDTH, _WIDTH, gen=gen) / _WIDTH**0.5 for _ in range(2))
        self.fns = {
            "input_layernorm": lambda x: 1.5 * x + 0.25,
            "self_attn": lambda x: torch.tanh(x) @ a,
            "post_attention_layernorm": lambda x: 0.5 - 0.75 * x,
            "mlp": lambda x: torch.sin(x) @ m,
        }
        self.x = _probe.randn(2, 3, _WIDTH, gen=gen)
        self.module = module

    def dropouts(self) -> tuple[list[str], list[str]]:
        """(nn.Dropout children, float dropout attributes) of the layer itself."""
        children = [n for n, m in self.module._modules.items() if isinstance(m, nn.Dropout)]
        return children, _probe.float_dropouts(self.module)

    def run(self, p: float = 0.5, **kwargs):
        """(output, the stand-ins' calls by child name), every dropout of the layer at ``p``."""
        probe = _probe.shallow_copy(self.module)
        probe.training = True
        children, floats = self.dropouts()
        for name, child in self.module._modules.items():
            if name not in _CHILDREN and child is not None and not any(True for _ in child.parameters()):
                visible = copy.copy(child)  # in training, whatever it is
                visible.training = True
                if name in children:
                    visible.p = p
                probe._modules[name] = visible
        for name in floats:
            setattr(probe, name, p)
        stand = {n: _StandIn(fn, tuple_out=n == "self_attn") for n, fn in self.fns.items()}
        probe._modules.update(stand)
        with torch.no_grad(), _probe.saved_rng():
            out = type(self.module).forward(probe, self.x, **kwargs)
        return out, {n: s.calls for n, s in stand.items()}

    def expected(self) -> torch.Tensor:
        f = self.fns
        s = self.x + f["self_attn"](f["input_layernorm"](self.x))
        return s + f["mlp"](f["post_attention_layernorm"](s))


def _study(module: nn.Module, first: str, params, extra: bool):
    """The ResidualNormSpec the probe finds, or a Skip."""
    probe = _Probe(module)
    markers = {name: _Marker(name) for name, _ in params}
    if extra:
        markers[_EXTRA] = _Marker(_EXTRA)
    try:
        out, calls = probe.run(**markers)
        dropouts = ()
        if isinstance(out, torch.Tensor) and not _probe.close(out, probe.expected()):
            # Maybe a dropout between the blocks (Phi-3's resid_*_dropout): the fused forward serves
            # the calls where every dropout of the layer is off, and only if the forward is exact then.
            out, calls = probe.run(0.0, **markers)
            children, floats = probe.dropouts()
            dropouts = (tuple(children), tuple(floats))
    except Exception as err:
        first = str(err).splitlines()[0] if str(err) else ""
        return Skip(f"its forward does not use its children as a pre-norm layer's attention, MLP and norms (run on "
                    f"stand-ins for them it raised {type(err).__name__}: {first})")
    if not isinstance(out, torch.Tensor) or not _probe.close(out, probe.expected()):
        return Skip("its forward is not the pre-norm x + attention(norm(x)), then + mlp(norm(·)): something sits "
                    "between the blocks (a residual scale, a post-norm, a parallel branch)")
    if any(len(c) != 1 for c in calls.values()):
        return Skip("its forward calls a child more than once")
    if any(len(calls[n][0][0]) != 1 or calls[n][0][1] for n in _CHILDREN if n != "self_attn"):
        return Skip("its forward passes its MLP or norms more than their input")
    (pos, kw) = calls["self_attn"][0]
    inputs = [k for k, v in kw.items() if isinstance(v, torch.Tensor)]
    if pos or len(inputs) != 1:
        return Skip("its forward does not pass the attention its input by keyword")
    by_marker = {id(v): k for k, v in kw.items() if isinstance(v, _Marker)}
    if len(by_marker) + 1 != len(kw) or (extra and kw.get(_EXTRA) is not markers[_EXTRA]):
        return Skip("its forward passes the attention arguments of its own making")
    arguments = tuple((n, by_marker[id(markers[n])], d) for n, d in params if id(markers[n]) in by_marker)
    renames = []
    for alias in (a for a in _CACHE_ALIASES if a not in markers):
        try:
            with warnings.catch_warnings():  # "`past_key_values` is deprecated…"
                warnings.simplefilter("ignore")
                _, calls = probe.run(**{alias: _Marker(alias)})
        except Exception:
            continue
        kw = calls["self_attn"][0][1]
        landed = [k for k, v in kw.items() if isinstance(v, _Marker)]
        if landed and landed != [alias]:
            renames.append((alias, landed[0]))
    return ResidualNormSpec(first, inputs[0], arguments, tuple(renames), extra, *dropouts)


def _p(module: nn.Module, name: str) -> float:
    value = getattr(module, name)
    return float(value.p if isinstance(value, nn.Module) else value)


class ResidualNormPattern(Pattern):
    name = "residual_norm"
    description = "pre-norm decoder layer: residual adds inside its RMSNorms (forward and backward)"

    def __init__(self, norms_fused: bool = True):
        self.norms_fused = norms_fused  # whether the rms_norm pattern runs in the same optimize call

    def match(self, module: nn.Module):
        if isinstance(module.__dict__.get("forward"), residual_norm.ResidualNormForward):
            return None  # already fused: optimize is idempotent
        kids = module._modules
        if not all(isinstance(kids.get(n), nn.Module) for n in _CHILDREN):
            return None
        if any(n not in _CHILDREN and m is not None and any(True for _ in m.parameters()) for n, m in kids.items()):
            return None  # more blocks than one attention, one MLP and two norms (Gemma-2's four norms)
        norms = [kids[n] if isinstance(kids[n], FusedRMSNorm) else RMSNormPattern().match(kids[n]) for n in _CHILDREN[2:]]
        if any(n is None or isinstance(n, Skip) for n in norms):
            return None  # LayerNorms: only residual adds next to RMSNorms are fused
        if "forward" in module.__dict__:  # fused by an earlier call (and maybe graphed since), or hooked by others
            return None if all(isinstance(n, FusedRMSNorm) for n in norms) else Skip(
                "its forward is already replaced on the instance (by accelerate's hooks?), which a fused forward "
                "would bypass")
        if not self.norms_fused and not all(isinstance(n, FusedRMSNorm) for n in norms):
            # Its fused forward calls the norms' kernels: with plain norms every call would run the original.
            return Skip("its RMSNorms are left unfused (the rms_norm pattern is not selected), and the residual "
                        "adds are fused into the norms' kernels: select rms_norm to fuse this layer")
        sig = _signature(module)
        if isinstance(sig, Skip):
            return sig
        spec = _study(module, *sig)
        on = [] if isinstance(spec, Skip) else [n for n in (*spec.dropouts, *spec.float_dropouts) if _p(module, n) > 0]
        if on:  # it would fuse only calls with them off: in training, none
            return Skip(f"dropout between its blocks ({', '.join(on)}) is on, and the fused forward has none "
                        "(it would run only with the dropout at 0)")
        return spec

    def apply(self, root, qualname, module, spec, backend) -> Applied:
        if "forward" in module.__dict__:
            raise ValueError(f"{qualname}: the layer's forward is already replaced on the instance")
        residual_norm.install(module, spec)
        return Applied(residual_norm.ResidualNormForward.__name__, residual_norm.Uninstall(module))
