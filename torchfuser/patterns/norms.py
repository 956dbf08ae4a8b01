"""RMSNorm and LayerNorm, recognised by their math.

A candidate is a leaf module with a 1-D weight (and maybe a 1-D bias of the same size), a
float epsilon attribute, and no other parameters. The probe feeds it rows whose mean square
is near eps and near 1, so that a wrong eps, a missing or extra ``1 +`` on the weight, or a
mean subtraction all show. A second probe finds which dtype it returns for each input and weight
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
    """((weight, bias), eps) for a norm-shaped leaf, a Skip for one we cannot read, else None."""
    names = _norm_params(module)
    if names is None:
        return None
    eps = _eps(module)
    if eps is None:
        hinted = "norm" in type(module).__name__.lower()
        return Skip("norm-like module without an epsilon attribute") if hinted else None
    if more := further_inputs(module):
        return Skip(f"its forward takes more than x ({', '.join(more)}): a gated or conditioned norm, not a plain one")
    return names, eps


def _run_probe(module: nn.Module, eps: float):
    """(probe copy, input, output or Skip)."""
    probe = _probe.random_params(module, _probe.generator(3))
    x = _probe_input(module._parameters["weight"].shape[0], eps)
    try:
        return probe, x, _probe.run(probe, x)
    except Exception as err:  # the module's own forward failed on a plain 2-D input
        first = str(err).splitlines()[0][:120] if str(err) else ""
        return probe, x, Skip(f"{type(module).__name__}'s forward does not run on plain (rows, hidden) input "
                              f"({type(err).__name__}: {first}), so it is not a plain norm of the last dimension")


def _rms(x, w, eps, offset):
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * (offset + w)


def _ln(x, w, b, eps):
    y = torch.nn.functional.layer_norm(x, x.shape[-1:], w, None, eps)
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
        w = probe._parameters[weight]
        for offset in (0.0, 1.0):
            if _probe.close(y, _rms(x, w, eps, offset)):
                dtypes = _dtype_probe.out_dtypes(probe, x)
                if isinstance(dtypes, Skip):
                    return dtypes
                return RMSNormSpec(eps=eps, offset=offset, weight=weight, out_dtype=dtypes[0],
                                   autocast_out_dtype=dtypes[1])
        if _probe.close(y, _ln(x, w, None, eps)):
            return None  # a bias-free LayerNorm
        return Skip("forward does not compute x·rsqrt(mean(x²)+eps)·(offset+w)")


class LayerNormPattern(Pattern):
    name = "layer_norm"
    description = "(x−mean)·rsqrt(var+eps)·w+b, with or without bias"
    fused = FusedLayerNorm

    def match(self, module):
        if isinstance(module, nn.LayerNorm):
            if len(module.normalized_shape) != 1:
                return Skip(f"normalizes over {len(module.normalized_shape)} dims; only the last dim is fused")
            if module.weight is None:
                return Skip("no elementwise affine weight (elementwise_affine=False)")
        found = _candidate(module)
        if found is None or isinstance(found, Skip):
            return found
        (weight, bias), eps = found
        probe, x, y = _run_probe(module, eps)
        if isinstance(y, Skip):
            return y if bias is not None else None
        b = None if bias is None else probe._parameters[bias]
        if _probe.close(y, _ln(x, probe._parameters[weight], b, eps)):
            dtypes = _dtype_probe.out_dtypes(probe, x)
            if isinstance(dtypes, Skip):
                return dtypes
            return LayerNormSpec(eps=eps, weight=weight, bias=bias, out_dtype=dtypes[0], autocast_out_dtype=dtypes[1])
        if bias is None:
            return None  # RMSNorm's business
        return Skip("forward does not compute (x−mean)·rsqrt(var+eps)·w+b")
