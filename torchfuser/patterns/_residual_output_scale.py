"""A decoder layer's own buffers, for the residual-norm pattern (``patterns.residual_norm``): an output scale
(Gemma 4's ``hidden_states *= self.layer_scalar``, a one-element buffer loaded from the checkpoint) and buffers
its forward reads otherwise.

The fused forward computes the layer from its children; a buffer the layer's own code reads is not among them,
so every floating buffer held by the layer itself is probed: the probe copy gets one-element buffers at 1 (so the
formula is read without them, whatever a checkpoint holds), then each buffer another value alone. A buffer that
leaves the output unchanged is not read; a one-element buffer that multiplies the output by its new value is the
output scale, which the fused forward reads at each call (``ResidualNormSpec.output_scale``); any other use
leaves the layer alone, with the reason. (Unprobed, a scale at 1 in a freshly built model passes the formula
and a checkpoint loaded after ``optimize`` would then be ignored: a finite wrong number.)
"""
from __future__ import annotations

import torch
from torch import nn

from torchfuser.patterns import _probe
from torchfuser.patterns.base import Skip

_OTHER = 0.375  # a value no default scale has


def own_buffers(module: nn.Module) -> list[str]:
    """The floating buffers the layer holds itself (not its children's)."""
    return [n for n, b in module._buffers.items() if b is not None and b.is_floating_point()]


def neutral(module: nn.Module) -> dict:
    """Values for the probe copy: one-element buffers at 1 (CPU float64: the model may be on meta or a GPU),
    the others at fixed random values in their shape."""
    gen = _probe.generator(13)
    return {n: torch.ones(b.shape, dtype=torch.float64) if b.numel() == 1 else _probe.randn(*b.shape, gen=gen)
            for n, b in ((n, module._buffers[n]) for n in own_buffers(module))}


def find(probe, markers: dict, hidden) -> str | None | Skip:
    """The layer's output-scale buffer (None where it has none), or a Skip where its forward reads one of its
    buffers otherwise. ``hidden(out)``: the hidden states from a probe run's output."""
    base = hidden(probe.run(0.0, **markers)[0])
    found = []
    for name, value in probe.fixed.items():
        other = value * _OTHER if value.numel() == 1 else value * _OTHER + 0.125
        saved = probe.fixed
        probe.fixed = {**saved, name: other}
        try:
            out = hidden(probe.run(0.0, **markers)[0])
        except Exception:  # noqa: BLE001 - read in a way the probe cannot follow
            out = None
        finally:
            probe.fixed = saved
        if isinstance(out, torch.Tensor) and _probe.close(out, base):
            continue  # not read
        if value.numel() == 1 and isinstance(out, torch.Tensor) and _probe.close(out, base * _OTHER):
            found.append(name)
            continue
        return Skip(f"its forward reads its own buffer {name!r} (shape {tuple(value.shape)}) other than as one factor "
                    "of its output, which the fused forward, computing the layer from its children, would not follow")
    if len(found) > 1:
        return Skip(f"its output is scaled by several buffers of its own ({', '.join(map(repr, found))}); the fused "
                    "forward follows one")
    return found[0] if found else None
