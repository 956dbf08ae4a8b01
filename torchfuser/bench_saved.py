"""Saved activations per decoder layer, for ``torchfuser bench``: the bytes autograd saves for the backward
while each layer of the model's decoder stack runs (each storage counted once, in the layer that saved it
first), next to the step's total (``demo._SavedBytes``, which this extends).

The stack is found by structure, not by name: the ``nn.ModuleList`` of same-class children holding the most
parameters (a PEFT or torch.compile wrapper's inner model included). Forward hooks on its layers say which
layer runs; they are put on only for the step counted (``per_layer=True``) and taken off after it.
"""
from __future__ import annotations

import torch
from torch import nn

from torchfuser import demo


def decoder_layers(model: nn.Module) -> list[nn.Module]:
    """The layers of the model's decoder stack, or [] where there is none."""
    best, size = [], 0
    for module in model.modules():
        if not isinstance(module, nn.ModuleList) or len(module) < 1:
            continue
        if len({type(m) for m in module}) != 1:
            continue
        n = sum(p.numel() for p in module.parameters())
        if n > size:
            best, size = list(module), n
    return best


class SavedPerLayer(demo._SavedBytes):
    """``total`` as ``demo._SavedBytes`` counts it, and ``layers[i]``: the part saved while layer i ran."""

    def __init__(self, model: nn.Module, per_layer: bool = True):
        super().__init__()
        self._layers = decoder_layers(model) if per_layer else []
        self.layers = [0] * len(self._layers)
        self._now: int | None = None
        self._handles = []

    def __enter__(self):
        for i, layer in enumerate(self._layers):
            self._handles.append(layer.register_forward_pre_hook(lambda *_, i=i: self._enter(i)))
            self._handles.append(layer.register_forward_hook(lambda *_: self._enter(None)))
        super().__enter__()
        return self

    def __exit__(self, *exc):
        super().__exit__(*exc)
        for h in self._handles:
            h.remove()
        self._handles.clear()

    def _enter(self, i):
        self._now = i

    def _count(self, nbytes: int) -> None:
        super()._count(nbytes)
        if self._now is not None:
            self.layers[self._now] += nbytes
