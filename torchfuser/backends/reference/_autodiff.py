"""Backward passes derived from the forward definitions by autograd, never written by hand."""
from __future__ import annotations

from typing import Callable, Sequence

import torch

from torchfuser.backends._saved_hooks import hooks_set_aside


def compute_dtype(*tensors: torch.Tensor | None) -> torch.dtype:
    """fp32 for fp16/bf16/fp32 inputs, fp64 when any input is fp64 (the test oracle)."""
    for t in tensors:  # a loop, not a generator: every reference kernel call runs this (host time)
        if t is not None and t.dtype == torch.float64:
            return torch.float64
    return torch.float32


def cast(t: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """``t.to(dtype)``, without the dispatcher call where t has that dtype already (the same tensor either
    way): a decode step's kernels are microseconds, and each such call costs about one."""
    return t if t.dtype == dtype else t.to(dtype)


def widened(t: torch.Tensor, out_dtype: torch.dtype | None) -> torch.Tensor:
    """``t`` for an op whose result is to be ``out_dtype``: widened where out_dtype is not narrower than t's dtype,
    so that the result is rounded once, to out_dtype (a bf16 input's fp32 result has fp32's precision, not bf16's
    widened). Every backend's kernels round this way."""
    if out_dtype is None or out_dtype == t.dtype:
        return t
    wide = torch.promote_types(t.dtype, out_dtype)
    return t if wide == t.dtype else t.to(wide)


def vjp(fn: Callable, inputs: Sequence[torch.Tensor | None], grads, *args) -> tuple:
    return value_and_vjp(fn, inputs, grads, *args)[1]


def value_and_vjp(fn: Callable, inputs: Sequence[torch.Tensor | None], grads, *args) -> tuple:
    """``fn(*inputs, *args)`` and its gradients w.r.t. each tensor of ``inputs`` for output cotangents
    ``grads``; a ``None`` input gets a ``None`` gradient.

    ``torch.func.vjp`` rather than ``torch.autograd.grad``: custom-op implementations run below
    the autograd dispatch key, where only functorch's transforms still differentiate.
    """
    present = [i for i, t in enumerate(inputs) if t is not None]

    def only_present(*xs):
        full = list(inputs)
        for i, x in zip(present, xs):
            full[i] = x
        return fn(*full, *args)

    with hooks_set_aside():
        value, pullback = torch.func.vjp(only_present, *[inputs[i] for i in present])
        if not isinstance(grads, (tuple, list, torch.Tensor)):
            grads = torch.full_like(value, grads)
        got = iter(pullback(grads))
    return value, tuple(next(got) if t is not None else None for t in inputs)

