"""Probe of a forward that scores only the positions after a fixed number of leading ones: GIT puts its image's
positions before the text in its decoder's output and computes its loss from ``logits[:, N:-1]`` (N its image
positions, read off its first layer) against ``labels[:, 1:]``, the labels being the text's alone.

The forward runs on the stub copy of ``_lm_head_probe`` with a decoder output much longer than the labels, a head
whose logits carry their position in their first column, and a loss function of its own (what transformers'
``loss_function`` property returns where ``_loss_function`` is set) that records the logits it is given: the
positions it gets tell N. N must not move with the output's length (a forward that scores the last positions,
however many there are, is another form). ``probe_loss`` then checks the whole loss at that geometry.
"""
from __future__ import annotations

import torch
from torch import nn

from torchfuser.modules.lm_head import CaptureHead
from torchfuser.patterns import _probe
from torchfuser.patterns._lm_head_probe import _B, _run, forward_inputs, head_of, length

_LONG = (2048, 1536)  # decoder outputs this much longer than the labels: N below the shorter is found


class _Positions(CaptureHead):
    """A head whose logits are (position, 0, 0) at each position."""

    def forward(self, hidden):
        out = hidden.new_zeros(*hidden.shape[:-1], 3)
        out[..., 0] = torch.arange(hidden.shape[-2], dtype=hidden.dtype, device=hidden.device)
        return out


def _first_scored(model: nn.Module, head: str, extra: int, labels: torch.Tensor, inputs: dict) -> int | None:
    seen = []

    def record(*args, **kwargs):
        seen.append(kwargs.get("logits", args[0] if args else None))
        return torch.zeros((), dtype=torch.float64)

    _run(model, head, lambda real: _Positions(real=real), extra=extra, loss_function=record, labels=labels,
         inputs=inputs)
    if len(seen) != 1 or not isinstance(seen[0], torch.Tensor) or seen[0].dim() != 3 or seen[0].shape[1] == 0:
        return None
    pos = seen[0][..., 0]
    first = int(pos[0, 0])
    if not torch.equal(pos, torch.arange(first, first + pos.shape[1], dtype=pos.dtype).expand_as(pos)):
        return None  # not one run of consecutive positions, the same in every row
    return first


def leading_positions(model: nn.Module, head: str) -> int | None:
    """N where the forward (given labels of the probe's length) scores the decoder's output from position N on, N
    fixed (0 < N, the same for two lengths of output); None otherwise or where it does not run that way."""
    inputs = forward_inputs(model)
    if inputs is None:
        return None
    labels = torch.randint(0, head_of(model, head).out_features, (_B, length(inputs)), generator=_probe.generator(19))
    firsts = [_first_scored(model, head, extra, labels.clone(), inputs) for extra in _LONG]
    if firsts[0] is None or firsts[0] != firsts[1] or not 0 < firsts[0] <= min(_LONG):
        return None
    return firsts[0]
