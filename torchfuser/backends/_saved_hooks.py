"""Saved-tensor hooks (activation offloading, memory accounting) and torch.func.

torch.func refuses to run while the caller has saved-tensor hooks registered. Backends that
derive gradients or trace graphs with it do so on tensors internal to one kernel, never saved
into the caller's autograd graph, so the caller's hooks are set aside for that span and put back
after.
"""
from __future__ import annotations

import contextlib

import torch

_autograd = torch._C._autograd


@contextlib.contextmanager
def hooks_set_aside():
    stack = []
    while (top := _autograd._top_saved_tensors_default_hooks(True)) is not None:
        stack.append(top)
        _autograd._pop_saved_tensors_default_hooks()
    try:
        yield
    finally:
        for pack, unpack in reversed(stack):
            _autograd._push_saved_tensors_default_hooks(pack, unpack)
