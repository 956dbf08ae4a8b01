"""RMSNorm and LayerNorm, recognised by their math.

A candidate is a leaf module with a 1-D weight (and maybe a 1-D bias of the same size), a
float epsilon attribute, and no other parameters. The probe feeds it rows whose mean square
is near eps and near 1, so that a wrong eps, a missing or extra ``1 +`` on the weight, or a
mean subtraction all show. A weightless norm (a parameterless leaf with an eps attribute, a
``normalized_shape`` or "norm" in its class name: NanoChat's RMS norm, OLMo-1's LayerNorm,
``nn.LayerNorm(elementwise_affine=False)``) is probed the same with w = 1; where it has no eps attribute
(OLMo-1's eps is a literal in its forward) the eps is solved from rows of tiny variance and then checked
like any other. LayerNorm's weight may carry an offset, as RMSNorm's does (Nemotron's ``w + 1``). A second probe finds which dtype it returns for each input and weight
dtype, and under autocast (``_dtype_probe``): the fused module returns the same.
"""
from __future__ import annotations

import torch
from torch import nn

from torchfuser.modules.norms import FusedLayerNorm, FusedRMSNorm, LayerNormSpec, RMSNormSpec
from torchfuser.patterns import _dtype_probe, _probe
from torchfuser.patterns.base import Pattern, Skip, further_inputs

_EPS_ATTRS = ("variance_epsilon", "eps", "epsilon", "layer_norm_eps", "rms_norm_eps")


def _eps(module: nn.Module) -> float | None:
    for attr in _EPS_ATTRS:
        value = getattr(module, attr, None)
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            return float(value)
    return None


_WIDTH = 64  # a weightless norm of no declared width is probed this wide


def weightless(module: nn.Module) -> bool:
    """A parameterless, bufferless leaf that calls itself a norm (an eps attribute, a ``normalized_shape``, or
    "norm" in its class name): the math probe decides whether it is one."""
    if module._modules or module._buffers or any(p is not None for p in module._parameters.values()):
        return False
    return (any(hasattr(module, a) for a in _EPS_ATTRS) or hasattr(module, "normalized_shape")
            or "norm" in type(module).__name__.lower())


def _width(module: nn.Module) -> int | None:
    shape = getattr(module, "normalized_shape", None)
    if shape is None:
        return _WIDTH
    shape = (shape,) if isinstance(shape, int) else tuple(shape)
    return shape[0] if len(shape) == 1 and isinstance(shape[0], int) and shape[0] > 1 else None


def _solved_eps(module: nn.Module, width: int) -> float | None:
    """The eps a weightless norm with no eps attribute adds to its variance: mean-free rows (where RMSNorm and
    LayerNorm agree) of variance 1e-12 give var + eps = Σx² / Σy² to fp32's precision; rounded to four
    digits, checked afterwards by the probe like an attribute's."""
    x = _probe.randn(1, width, gen=_probe.generator(4))
    x = x - x.mean(-1, keepdim=True)
    x = x / x.pow(2).mean(-1, keepdim=True).sqrt() * 1e-6
    try:
        y = _probe.run(_probe.shallow_copy(module), x)
    except Exception:
        return None
    if not isinstance(y, torch.Tensor) or y.shape != x.shape:
        return None
    eps = float(x.pow(2).sum() / y.double().pow(2).sum()) - 1e-12
    return float(f"{eps:.4g}") if eps > 1e-15 and eps == eps else None


def _norm_params(module: nn.Module):
    """(weight, bias) names if the module looks like a norm layer, else None."""
    if len(module._modules) or not len(module._parameters):
        return None
    params = {n: p for n, p in module._parameters.items() if p is not None}
    if "weight" not in params or params["weight"].dim() != 1:
        return None
    extra = set(params) - {"weight", "bias"}
    if extra:
        return None
    bias = "bias" if "bias" in params else None
    if bias and params["bias"].shape != params["weight"].shape:
        return None
    return "weight", bias


def _probe_input(hidden: int, eps: float) -> torch.Tensor:
    gen = _probe.generator(2)
    x = _probe.randn(_probe.PROBE_ROWS, hidden, gen=gen) + 0.5  # a nonzero mean tells LayerNorm apart
    scales = torch.tensor([1.0, eps**0.5, 3 * eps**0.5, 10.0], dtype=torch.float64)
    return x / x.pow(2).mean(-1, keepdim=True).sqrt() * scales[:, None]


def _candidate(module: nn.Module):
    """((weight, bias), eps) for a norm-shaped leaf ((None, None), eps for a weightless one), a Skip for one we
    cannot read, else None."""
    names = (None, None) if weightless(module) else _norm_params(module)
    if names is None:
        return None
    eps = _eps(module)
    if names[0] is None and eps is None and not any(hasattr(module, a) for a in _EPS_ATTRS):
        width = _width(module)
        eps = None if width is None else _solved_eps(module, width)
        if eps is None:
            return None
    if names[0] is None and _width(module) is None:
        return None
    if eps is None:
        hinted = "norm" in type(module).__name__.lower()
        return Skip("norm-like module without an epsilon attribute") if hinted else None
    if more := further_inputs(module):
        return Skip(f"its forward takes more than x ({', '.join(more)}): a gated or conditioned norm, not a plain one")
    return names, eps


def _run_probe(module: nn.Module, eps: float):
    """(probe copy, input, output or Skip)."""
    probe = _probe.random_params(module, _probe.generator(3))
    weight = module._parameters.get("weight")
    x = _probe_input(_width(module) if weight is None else weight.shape[0], eps)
    try:
        return probe, x, _probe.run(probe, x)
    except Exception as err:  # the module's own forward failed on a plain 2-D input
        first = str(err).splitlines()[0][:120] if str(err) else ""
        return probe, x, Skip(f"{type(module).__name__}'s forward does not run on plain (rows, hidden) input "
                              f"({type(err).__name__}: {first}), so it is not a plain norm of the last dimension")


def _rms(x, w, eps, offset):
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * (offset + w)


def _ln(x, w, b, eps, offset=0.0):
    y = torch.nn.functional.layer_norm(x, x.shape[-1:], None if w is None else offset + w, None, eps)
    return y if b is None else y + b


class RMSNormPattern(Pattern):
    name = "rms_norm"
    description = "x·rsqrt(mean(x²)+eps)·(offset+w), incl. Gemma's 1+w"
    fused = FusedRMSNorm

    def match(self, module):
        found = _candidate(module)
        if found is None or isinstance(found, Skip):
            return found
        (weight, bias), eps = found
        if bias is not None:
            return None  # a biased norm is LayerNorm's business
        probe, x, y = _run_probe(module, eps)
        if isinstance(y, Skip):
            return y
        w = 1.0 if weight is None else probe._parameters[weight]
        for offset in (0.0,) if weight is None else (0.0, 1.0):
            if _probe.close(y, _rms(x, w, eps, offset)):
                dtypes = _dtype_probe.out_dtypes(probe, x)
                if isinstance(dtypes, Skip):
                    return dtypes
                return RMSNormSpec(eps=eps, offset=offset, weight=weight, out_dtype=dtypes[0],
                                   autocast_out_dtype=dtypes[1])
        if any(_probe.close(y, _ln(x, None if weight is None else w, None, eps, o)) for o in (0.0, 1.0)):
            return None  # a bias-free LayerNorm
        return Skip("forward does not compute x·rsqrt(mean(x²)+eps)·(offset+w)" if weight else
                    "a weightless norm-like module whose forward computes neither x·rsqrt(mean(x²)+eps) nor "
                    "(x−mean)·rsqrt(var+eps)")


class LayerNormPattern(Pattern):
    name = "layer_norm"
    description = "(x−mean)·rsqrt(var+eps)·(offset+w)+b, with or without bias, incl. Nemotron's 1+w, or weightless"
    fused = FusedLayerNorm

    def match(self, module):
        if isinstance(module, nn.LayerNorm):
            if len(module.normalized_shape) != 1:
                return Skip(f"normalizes over {len(module.normalized_shape)} dims; only the last dim is fused")
        found = _candidate(module)
        if found is None or isinstance(found, Skip):
            return found
        (weight, bias), eps = found
        probe, x, y = _run_probe(module, eps)
        if isinstance(y, Skip):
            return y if bias is not None else None
        b = None if bias is None else probe._parameters[bias]
        w = None if weight is None else probe._parameters[weight]
        for offset in (0.0,) if weight is None else (0.0, 1.0):
            if _probe.close(y, _ln(x, w, b, eps, offset)):
                dtypes = _dtype_probe.out_dtypes(probe, x)
                if isinstance(dtypes, Skip):
                    return dtypes
                return LayerNormSpec(eps=eps, weight=weight, bias=bias, out_dtype=dtypes[0],
                                     autocast_out_dtype=dtypes[1], offset=offset)
        if bias is None:
            return None  # RMSNorm's business
        return Skip("forward does not compute (x−mean)·rsqrt(var+eps)·w+b")
