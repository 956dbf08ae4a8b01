"""What the attention pattern counts as a projection child: an ``nn.Linear`` / ``Conv1D`` (under a PEFT adapter: the
layer it wraps), or a **wrapped projection**, a module holding one ``nn.Linear`` and no parameters of its own whose
forward maps each row of its input to a row of that Linear's output width (Gemma 4's ``Gemma4ClippableLinear``:
clamp(linear(clamp(x, in bounds)), out bounds), the bounds buffers from the checkpoint where
``use_clipped_linears`` is set, the plain Linear where not).

A wrapped projection is called as it is by the fused attention (``modules.projections``: no joint GEMM, no FP8, no
fused LoRA for it), so whatever it computes around its Linear (its clamps, with any bounds the checkpoint holds) is
the model's own code, exactly; the pattern only needs its widths, read from the Linear inside and checked on a
float64 probe (a random narrow Linear in its place, its own buffers as they are), with every row of the output a
function of its own input row, as a projection is, so that the attention's probe may stand a plain Linear in for it.
"""
from __future__ import annotations

import copy
import weakref

import torch
from torch import nn

from torchfuser.modules.adapters import lora
from torchfuser.patterns import _probe

_WRAPPED = weakref.WeakKeyDictionary()  # module → its inner Linear, or None (probed once a module)
_IN, _OUT = 6, 5  # the probe's narrow Linear


def projection_dims(m: nn.Module) -> tuple[int, int] | None:
    """(in_features, out_features) of a projection child, plain or wrapped, else None."""
    return _probe.projection_dims(linear_of(m)) if m is not None else None


def linear_of(m: nn.Module) -> nn.Module:
    """The layer whose weight makes ``m``'s projection: a PEFT adapter's base, a wrapped projection's Linear
    (its base), else ``m`` itself."""
    base = lora.base_of(m)
    if _probe.projection_dims(base) is not None:
        return base
    inner = wrapped_linear(m)
    return base if inner is None else lora.base_of(inner)


def wrapped_linear(m: nn.Module) -> nn.Module | None:
    """The one Linear (or PEFT adapter over one) that ``m`` wraps as a projection (see the module docstring), or
    None."""
    try:
        return _WRAPPED[m]
    except KeyError:
        pass
    except TypeError:  # not weakly referenceable
        return None
    inner = _wrapped(m)
    _WRAPPED[m] = inner
    return inner


def _wrapped(m: nn.Module) -> nn.Module | None:
    children = [(n, c) for n, c in m._modules.items() if c is not None]
    if (lora.is_lora(m) or _probe.projection_dims(m) is not None or len(children) != 1
            or any(p is not None for p in m._parameters.values())):
        return None
    name, inner = children[0]
    if type(lora.base_of(inner)) is not nn.Linear or inner._forward_hooks or inner._forward_pre_hooks:
        return None
    gen = _probe.generator(11)
    probe = _probe.shallow_copy(m)
    for k, v in m.__dict__.items():  # its plain containers its own: a forward that records its calls keeps no probe's
        if isinstance(v, (list, dict, set)) and k not in ("_modules", "_parameters", "_buffers"):
            probe.__dict__[k] = copy.copy(v)
    probe._modules[name] = _probe.small_projection(lora.base_of(inner), _IN, _OUT, gen)
    for n, b in m._buffers.items():  # its own values (clamp bounds), on a float64 CPU copy
        if b is not None:
            probe._buffers[n] = (torch.zeros(b.shape, dtype=torch.float64) if b.is_meta else
                                 b.detach().to("cpu", torch.float64 if b.is_floating_point() else b.dtype))
    x = 3 * _probe.randn(2, 3, _IN, gen=gen)
    try:
        with torch.no_grad(), _probe.saved_rng():
            y = type(probe).forward(probe, x)
            rows = [type(probe).forward(probe, x[i:i + 1, j:j + 1]) for i in range(2) for j in range(3)]
    except Exception:
        return None
    if not isinstance(y, torch.Tensor) or y.shape != (2, 3, _OUT):
        return None
    if not all(isinstance(r, torch.Tensor) and r.shape == (1, 1, _OUT) for r in rows):
        return None
    return inner if _probe.close(torch.cat(rows).view(2, 3, _OUT), y) else None
