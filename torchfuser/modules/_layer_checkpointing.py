"""Gradient checkpointing of a fused decoder layer as transformers does it (``modules.residual_norm``): whether
transformers' wrapper of the layer class's ``forward`` would checkpoint a call, and the keywords it passes on."""
from __future__ import annotations

import logging

import torch
from torch import nn

_log = logging.getLogger(__name__)
# Keywords a layer's KV cache goes by (transformers versions and families): a checkpointed layer must not
# get one, or its recompute in the backward would write the cache a second time.
_CACHE_KWARGS = ("cache", "past_key_values", "past_key_value", "layer_past")
_WARNED: set[type] = set()  # layer classes told so (once, as transformers does)


def _forward_level_checkpointing() -> type | None:
    """transformers' GradientCheckpointingLayer when it checkpoints in its subclasses' ``forward``
    (transformers 5.25), None when it does so in ``__call__`` (5.17: around any forward) or is absent."""
    try:
        from transformers.modeling_layers import GradientCheckpointingLayer
    except ImportError:  # pragma: no cover - no transformers: no HF checkpointing
        return None
    return None if "__call__" in vars(GradientCheckpointingLayer) else GradientCheckpointingLayer


_CHECKPOINTED_CLASS = _forward_level_checkpointing()


def checkpoints(layer: nn.Module) -> bool:
    """Whether transformers' wrapper of the layer class's ``forward`` would checkpoint this call: the
    wrapper's own conditions (gradient checkpointing on, training, grad enabled)."""
    return (_CHECKPOINTED_CLASS is not None and isinstance(layer, _CHECKPOINTED_CLASS)
            and bool(layer.gradient_checkpointing) and layer.training and torch.is_grad_enabled())


def without_cache(layer: nn.Module, kwargs: dict) -> dict:
    """The keywords as transformers' checkpointing wrapper passes them on: no KV cache (the recompute
    would update it twice) unless the layer only reads it, ``use_cache`` off."""
    dropped = [n for n in _CACHE_KWARGS if kwargs.get(n) is not None]
    if getattr(layer, "_can_checkpoint_with_cache", False):
        dropped = []
    if not dropped and not kwargs.get("use_cache"):
        return kwargs
    if type(layer) not in _WARNED:
        _WARNED.add(type(layer))
        _log.warning("torchfuser: caching is incompatible with gradient checkpointing in %s: it runs without a "
                     "KV cache", type(layer).__name__)
    return {**kwargs, **{n: None for n in dropped}, **({"use_cache": False} if "use_cache" in kwargs else {})}
