"""A residual scale, for the residual-norm pattern (``patterns.residual_norm``): layers that add each block's
output times a factor, ``s = x + attention(norm(x)) · c``, ``out = s + mlp(norm(s)) · c`` (Granite's
``residual_multiplier``, MiniCPM3's ``residual_scale = scale_depth / √layers``).

The probe reads each block's factor from the layer's output with the other block's stand-in giving zeros
(out − x = c · block(norm(x))), and accepts it only where it is one float attribute of the layer, read at
each call: that attribute set to another value on the probe copy must change the factor to it. The fused
forward then reads the attribute at each call, as the original does (a factor written in the code, or
computed from several attributes, is not followed: the layer is left alone).
"""
from __future__ import annotations

import torch

from torchfuser.patterns import _probe

_OTHER = 0.375  # a value no default scale has


def scales(probe, markers: dict) -> tuple[str | None, str | None] | None:
    """(the attention's factor's attribute, the MLP's), None for a factor of 1; None where a factor is not
    an attribute read at each call, or the layer is not a scaled sequential or parallel one."""
    found = []
    for role in ("attention", "mlp"):
        c = _factor(probe, markers, role)
        if c is None:
            return None
        names = [n for n, v in vars(probe.module).items()
                 if isinstance(v, float) and not isinstance(v, bool) and "drop" not in n and v == c]
        name = next((n for n in names if _factor(probe, markers, role, {n: _OTHER}) == _OTHER), None)
        if name is None and c != 1.0:
            return None
        found.append(name)  # (a factor of 1 that no attribute holds: None, no scale)
    return tuple(found)


def _factor(probe, markers: dict, role: str, attrs: dict | None = None) -> float | None:
    """c in out − x = c · block(norm(x)) with the other block's stand-in giving zeros (rounded to the
    float32 factor it is, or None where out − x is not a multiple of it)."""
    others = ("mlp", "mlp2") if role == "attention" else ("attention",)  # (mlp2: a second MLP summed, Granite 4's)
    saved, probe.fns = probe.fns, {**probe.fns, **{o: lambda t: t * 0.0 for o in others}}
    probe.attrs = attrs or {}
    try:
        out = probe.split(probe.run(0.0, **markers)[0])[0]
    except Exception:
        return None
    finally:
        probe.fns, probe.attrs = saved, {}
    if not isinstance(out, torch.Tensor):
        return None
    f, x = probe.fns, probe.x
    norm = f["norm_in"] if role == "attention" or probe.roles["norm_mid"] == probe.roles["norm_in"] else f["norm_mid"]
    ref = f[role](norm(x)).double()
    if role == "mlp" and "mlp2" in probe.roles:
        ref = ref + f["mlp2"](norm(x)).double()
    d = (out - x).double()
    c = float((d * ref).sum() / (ref * ref).sum())
    if not _probe.close(d, ref * c):
        return None
    exact = [v for v in (1.0, *(v for v in vars(probe.module).values() if isinstance(v, float)), *(attrs or {}).values())
             if abs(v - c) <= 1e-5 * max(1.0, abs(c))]
    return exact[0] if exact else round(c, 6)
