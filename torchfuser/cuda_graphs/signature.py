"""A layer call's signature: its tensors in order, and a key for everything else a CUDA graph fixes."""
from __future__ import annotations

import itertools

import torch
from torch import Tensor

_SCALARS = (bool, int, float, str)
# transformers hands the loss's keyword arguments down to every decoder layer, which ignores them;
# a count that changes with every batch must not make every call a new signature.
_LOSS_ONLY = ("num_items_in_batch",)


def split_call(args: tuple, kwargs: dict):
    """(layout, tensors) of a call, or (None, type name) when an argument cannot be captured.

    layout: one entry per argument — ``(name, "t")`` a tensor, ``(name, "seq", n)`` a tuple of
    n tensors (rotary cos/sin), ``(name, "v", type, value)`` a constant."""
    layout, tensors = [], []
    for name, v in itertools.chain(enumerate(args), kwargs.items()):
        if name in _LOSS_ONLY:
            continue
        if isinstance(v, Tensor):
            layout.append((name, "t"))
            tensors.append(v)
        elif isinstance(v, tuple) and v and all(isinstance(x, Tensor) for x in v):
            layout.append((name, "seq", len(v)))
            tensors.extend(v)
        elif v is None or type(v) in _SCALARS:
            layout.append((name, "v", type(v), v))
        else:
            return None, type(v).__name__
    return tuple(layout), tensors


def join_call(layout, tensors):
    """The (args, kwargs) that ``split_call`` took apart, with ``tensors`` in their places."""
    it = iter(tensors)
    args, kwargs = [], {}
    for entry in layout:
        name, kind = entry[0], entry[1]
        value = next(it) if kind == "t" else tuple(itertools.islice(it, entry[2])) if kind == "seq" else entry[3]
        if isinstance(name, int):
            args.append(value)
        else:
            kwargs[name] = value
    return tuple(args), kwargs


def tensor_key(tensors) -> tuple:
    return tuple((t.shape, t.stride(), t.dtype, t.device, t.requires_grad) for t in tensors)


def autocast_key() -> tuple:
    return (torch.is_autocast_enabled("cuda"), torch.get_autocast_dtype("cuda"))


def param_key(params) -> tuple:
    return tuple((id(p), p.data_ptr(), p.requires_grad) for p in params)
