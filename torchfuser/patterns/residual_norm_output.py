"""Post-norm output sublayers, for the residual-norm pattern (``patterns.residual_norm``): a module holding one
projection, one norm and at most one dropout, whose forward takes two tensors and computes

    out = norm(dropout(dense(h)) + r)                                     (BERT's SelfOutput and Output)

The probe runs the forward on stand-ins for the projection and the norm (random maps), with the dropout at 0 and
then, from one seed, at 0.5: the output must be the formula, the dropout on the projection's output before the add,
exactly. A module of two such children that is not this form is no candidate (no report noise); one that is but
cannot be fused (its norm's kind not selected, its forward replaced already) is skipped with the reason.
"""
from __future__ import annotations

import inspect

import torch
from torch import nn

from torchfuser.modules.norms import FusedLayerNorm, FusedRMSNorm
from torchfuser.modules.residual_output import ResidualOutputSpec
from torchfuser.patterns import _probe
from torchfuser.patterns._residual_roles import norm_kind
from torchfuser.patterns.base import Skip

_WIDTH, _SEED = 8, 17


class _Map(nn.Module):
    def __init__(self, fn):
        nn.Module.__init__(self)
        self.fn = fn

    def forward(self, x):
        return self.fn(x)


def match(module: nn.Module, blocks: list[str], fused_kinds: set[str]):
    """The ``ResidualOutputSpec`` of such a sublayer, a Skip, or None where the module is not one."""
    from torchfuser.modules.adapters import lora

    kinds = {n: norm_kind(module._modules[n]) for n in blocks}
    norms = [n for n in blocks if kinds[n]]
    dense = [n for n in blocks if not kinds[n] and _probe.projection_dims(lora.base_of(module._modules[n]))]
    others = [n for n, m in module._modules.items() if m is not None and n not in blocks]
    drops = [n for n in others if isinstance(module._modules[n], nn.Dropout)]
    if len(norms) != 1 or len(dense) != 1 or len(drops) != len(others) or len(drops) > 1 or _probe.float_dropouts(module):
        return None
    try:
        params = list(inspect.signature(type(module).forward).parameters.values())[1:]
    except (TypeError, ValueError):
        return None
    if len(params) != 2 or any(p.kind is not p.POSITIONAL_OR_KEYWORD or p.default is not p.empty for p in params):
        return None
    drop = drops[0] if drops else None
    if not _is_form(module, dense[0], norms[0], drop):
        return None
    if "forward" in module.__dict__:
        return Skip("its forward is already replaced on the instance (by accelerate's hooks?), which a fused forward "
                    "would bypass")
    norm = module._modules[norms[0]]
    if not isinstance(norm, (FusedRMSNorm, FusedLayerNorm)) and kinds[norms[0]] not in fused_kinds:
        words, pattern = ("RMSNorm", "rms_norm") if kinds[norms[0]] == "rms" else ("LayerNorm", "layer_norm")
        return Skip(f"its {words} is left unfused (the {pattern} pattern is not selected), and the residual add is fused "
                    f"into the norm's kernel: select {pattern} to fuse this sublayer")
    return ResidualOutputSpec((params[0].name, params[1].name), dense[0], norms[0], drop)


def _is_form(module: nn.Module, dense: str, norm: str, drop: str | None) -> bool:
    """Whether the forward is norm(dropout(dense(h)) + r) on stand-ins: dropout at 0, then at 0.5 from one seed."""
    gen = _probe.generator(_SEED)
    w = _probe.randn(_WIDTH, _WIDTH, gen=gen) / _WIDTH**0.5
    h, r = _probe.randn(2, 3, _WIDTH, gen=gen), _probe.randn(2, 3, _WIDTH, gen=gen)
    fd, fn = (lambda x: torch.tanh(x) @ w), (lambda x: 0.7 * x - 0.3)

    def run(p: float):
        probe = _probe.shallow_copy(module)
        probe._modules.update({dense: _Map(fd), norm: _Map(fn)})
        probe.training = True
        if drop is not None:
            probe._modules[drop] = nn.Dropout(p)
        return type(module).forward(probe, h, r)

    with torch.no_grad(), _probe.saved_rng():
        try:
            if not _close(run(0.0), fn(fd(h) + r)):
                return False
            if drop is None:
                return True
            _probe.seed_cpu(_SEED)
            out = run(0.5)
            _probe.seed_cpu(_SEED)
            return _close(out, fn(nn.functional.dropout(fd(h), 0.5, True) + r))
        except Exception:  # noqa: BLE001 - a forward of another shape
            return False


def _close(out, want) -> bool:
    return isinstance(out, torch.Tensor) and _probe.close(out, want)
