"""Where a decoder layer's own dropouts act, for the residual-norm pattern (``patterns.residual_norm``).

A layer may drop its attention's output and its MLP's before each residual add (Phi-3's ``resid_attn_dropout``
and ``resid_mlp_dropout``, OPT's functional ``dropout``, Falcon's ``dropout_add(…, config.hidden_dropout)``,
MPT's ``resid_attn_dropout``). The fused forward applies the same dropout, by the same module or functional
call, to the same tensor at the same point of the same order of random draws, so that from one seed its
masks are the original's. The probe finds the place: every dropout of the layer gets a probability of its
own, the stand-ins for the attention and the MLP draw from the CPU generator too (so that a dropout drawn
before or after a block shows), and from one seed the layer's output must equal, exactly, the formula with
one dropout (or none) on the attention's output and one (or none) on the MLP's, drawn in the fused forward's
order: attention, its dropout, MLP, its dropout; or, in a parallel layer, one dropout on the sum of both
blocks' outputs (Falcon's ``dropout_add(mlp_output + attention_output, residual, …)``). A form that matches
none keeps the fused forward to the calls where its dropouts are off.
"""
from __future__ import annotations

import itertools

import torch
from torch import nn

from torchfuser.patterns import _probe

_SEED = 11
_MAX_SOURCES = 4


def places(probe, kind: str, sources: list[str], markers: dict) -> tuple[str | None, ...] | None:
    """(the dropout on the attention's output, the one on the MLP's output, the one on their sum (parallel
    layers), the one on an inline MLP's activation output (OPT-style layers' ``activation_dropout``: BioGPT,
    XGLM)), each a name as ``modules.residual_norm.dropout_attr`` reads it or None; None when no such choice
    gives the layer's output."""
    if not sources or len(sources) > _MAX_SOURCES:
        return None
    ps = {n: 0.5 - 0.1 * i for i, n in enumerate(sources)}  # each its own p: its masks differ from the others'
    fns = probe.drawing()
    with _probe.saved_rng():
        try:
            _probe.seed_cpu(_SEED)
            out = probe.split(probe.run(ps=ps, **markers)[0])[0]
        except Exception:
            return None
        if not isinstance(out, torch.Tensor):
            return None
        sums = [(None, None, n) for n in sources] if kind == "parallel" else []
        inners = (None, *sources) if "act" in probe.roles else (None,)
        for di in inners:
            for da, dm, ds in [(*pair, None) for pair in itertools.product((None, *sources), repeat=2)] + sums:
                _probe.seed_cpu(_SEED)
                want = _expected(probe, fns, kind, ps.get(da), ps.get(dm), ps.get(ds), ps.get(di))
                if _probe.close(out, want):
                    return da, dm, ds, di
    return None


def _expected(probe, fns: dict, kind: str, pa: float | None, pm: float | None, ps: float | None,
              pi: float | None = None) -> torch.Tensor:
    """The layer's formula (``_Probe.expected``) with a dropout at p on the attention's and the MLP's output,
    or (parallel) on their sum, and on an inline MLP's activation output."""
    def drop(t, p):
        return t if p is None else nn.functional.dropout(t, p, True)

    if "act" in probe.roles:  # inline: fc_out(dropout(act(fc_in(·))))
        act = probe.module._modules[probe.roles["act"]]
        fns = {**fns, "mlp": lambda t: fns["fc_out"](drop(act(fns["fc_in"](t)), pi))}

    x, norm_in = probe.x, fns["norm_in"]
    mid = norm_in if probe.roles["norm_mid"] == probe.roles["norm_in"] else fns["norm_mid"]
    if kind == "post":
        h = norm_in(x + drop(fns["attention"](x), pa))
        return mid(h + drop(fns["mlp"](h), pm))
    a = drop(fns["attention"](norm_in(x)), pa)
    if kind == "parallel":
        m = drop(fns["mlp"](mid(x)), pm)
        return x + drop(a + m, ps) if ps is not None else x + a + m
    s = x + a
    return s + drop(fns["mlp"](mid(s)), pm)
