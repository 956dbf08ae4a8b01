"""Fused ops on tensors. Each call checks its inputs, picks the backend for the tensors'
device (``backend=None``) and runs the ``torchfuser::`` custom ops, forward and backward."""
from __future__ import annotations

import torch
from torch import Tensor

from torchfuser import ops
from torchfuser.backends import resolve
from torchfuser.ops._call import autocast_enabled

__all__ = ["rms_norm", "add_rms_norm", "layer_norm", "swiglu", "geglu", "gelu", "rope", "linear_cross_entropy"]

_FLOATS = (torch.float32, torch.bfloat16, torch.float16, torch.float64)


def _check_float(name: str, t: Tensor, op: str) -> None:
    if not isinstance(t, Tensor):
        raise TypeError(f"{op}: {name} must be a torch.Tensor, got {type(t).__name__}")
    if t.dtype not in _FLOATS:
        raise TypeError(f"{op}: {name} must be float32, bfloat16, float16 or float64, got {t.dtype}")


def _check_same_device(op: str, **tensors: Tensor | None) -> torch.device:
    devices = {n: t.device for n, t in tensors.items() if t is not None}
    first = next(iter(devices.values()))
    if any(d != first for d in devices.values()):
        found = ", ".join(f"{n} on {d}" for n, d in devices.items())
        raise ValueError(f"{op}: all tensors must be on one device, got {found}")
    return first


def backend_for(backend: str | None, device: torch.device) -> str:
    """The backend for tensors on ``device``. Meta tensors hold no values, only shapes: the reference
    backend's PyTorch propagates them (forward and backward) whichever backend was asked for, as the
    unfused model's PyTorch does."""
    return resolve(backend, device) if device.type != "meta" else "reference"


def _check_vector(op: str, name: str, t: Tensor | None, size: int) -> None:
    if t is not None and (t.dim() != 1 or t.shape[0] != size):
        raise ValueError(f"{op}: {name} must have shape ({size},) to match the last dim of x, got {tuple(t.shape)}")


def rms_norm(x: Tensor, weight: Tensor, eps: float = 1e-6, *, offset: float = 0.0, backend: str | None = None) -> Tensor:
    """x · rsqrt(mean(x², -1) + eps) · (offset + weight); offset=1 gives Gemma's norm. Output dtype: x's."""
    return ops.rms_norm(x, weight, float(eps), float(offset), backend_for(backend, check_rms_norm(x, weight)))


def check_rms_norm(x: Tensor, weight: Tensor) -> torch.device:
    """rms_norm's checks of its inputs; their device."""
    _check_float("x", x, "rms_norm")
    _check_float("weight", weight, "rms_norm")
    _check_vector("rms_norm", "weight", weight, x.shape[-1])
    return _check_same_device("rms_norm", x=x, weight=weight)


def add_rms_norm(
    x: Tensor, residual: Tensor, weight: Tensor, eps: float = 1e-6, *, offset: float = 0.0,
    out_dtype: torch.dtype | None = None, backend: str | None = None,
) -> tuple[Tensor, Tensor]:
    """(s, rms_norm(s)) with s = x + residual, in one kernel forward and one backward: a residual add
    and the norm after it. s has the promoted dtype of x and residual (fp32 for an fp32 residual
    stream plus a bf16 output under autocast), as ``x + residual`` would; the norm's output has s's,
    or ``out_dtype`` (bf16 for a projection under autocast, which would cast it to that anyway)."""
    op = "add_rms_norm"
    for name, t in (("x", x), ("residual", residual), ("weight", weight)):
        _check_float(name, t, op)
    if x.shape != residual.shape:
        raise ValueError(f"{op}: x and residual must have the same shape, got {tuple(x.shape)} and {tuple(residual.shape)}")
    _check_vector(op, "weight", weight, x.shape[-1])
    device = _check_same_device(op, x=x, residual=residual, weight=weight)
    if out_dtype is not None and out_dtype not in _FLOATS:
        raise TypeError(f"{op}: out_dtype must be a floating dtype or None, got {out_dtype}")
    return ops.add_rms_norm(x, residual, weight, float(eps), float(offset), backend_for(backend, device), out_dtype)


def layer_norm(
    x: Tensor, weight: Tensor, bias: Tensor | None = None, eps: float = 1e-5, *, backend: str | None = None
) -> Tensor:
    """(x − mean) · rsqrt(var + eps) · weight + bias over the last dim. Output dtype: x's."""
    _check_float("x", x, "layer_norm")
    _check_float("weight", weight, "layer_norm")
    _check_vector("layer_norm", "weight", weight, x.shape[-1])
    if bias is not None:
        _check_float("bias", bias, "layer_norm")
        _check_vector("layer_norm", "bias", bias, x.shape[-1])
    device = _check_same_device("layer_norm", x=x, weight=weight, bias=bias)
    return ops.layer_norm(x, weight, bias, float(eps), backend_for(backend, device))


def _check_pair(op: str, gate: Tensor, up: Tensor) -> torch.device:
    _check_float("gate", gate, op)
    _check_float("up", up, op)
    if gate.shape != up.shape:
        raise ValueError(f"{op}: gate and up must have the same shape, got {tuple(gate.shape)} and {tuple(up.shape)}")
    if gate.dtype != up.dtype:
        raise TypeError(f"{op}: gate and up must have the same dtype, got {gate.dtype} and {up.dtype}")
    return _check_same_device(op, gate=gate, up=up)


def _gated(op: str, gate: Tensor, up: Tensor | None, backend: str | None) -> Tensor:
    if up is not None:
        return getattr(ops, op)(gate, up, backend_for(backend, _check_pair(op, gate, up)))
    _check_float("gate", gate, op)
    if gate.dim() == 0 or gate.shape[-1] % 2:
        raise ValueError(f"{op}: with up=None, gate holds [gate | up] along its last dim, which must be even; "
                         f"got shape {tuple(gate.shape)}")
    return getattr(ops, f"{op}_packed")(gate, backend_for(backend, gate.device))


def swiglu(gate: Tensor, up: Tensor | None = None, *, backend: str | None = None) -> Tensor:
    """silu(gate) · up. With ``up=None``, ``gate`` is one [gate | up] tensor (a fused gate_up
    projection's output) and its gradient comes back as one tensor, never concatenated."""
    return _gated("swiglu", gate, up, backend)


def geglu(gate: Tensor, up: Tensor | None = None, *, backend: str | None = None) -> Tensor:
    """gelu_tanh(gate) · up; ``up=None`` as for ``swiglu``."""
    return _gated("geglu", gate, up, backend)


def gelu(x: Tensor, approximate: str = "none", *, backend: str | None = None) -> Tensor:
    """GELU, exact (``"none"``) or tanh-approximated (``"tanh"``)."""
    _check_float("x", x, "gelu")
    if approximate not in ("none", "tanh"):
        raise ValueError(f"gelu: approximate must be 'none' or 'tanh', got {approximate!r}")
    return ops.gelu(x, approximate, backend_for(backend, x.device))


def rope(q: Tensor, k: Tensor, cos: Tensor, sin: Tensor, *, backend: str | None = None) -> tuple[Tensor, Tensor]:
    """Rotary embedding in Hugging Face layout, rotate-half convention.

    q: B×Hq×S×D, k: B×Hk×S×D, cos and sin: B×S×D (or 1×S×D), shared by all heads.
    cos and sin are constants: rope does not differentiate through them.
    """
    for name, t in (("q", q), ("k", k), ("cos", cos), ("sin", sin)):
        _check_float(name, t, "rope")
        if t.dim() != (4 if name in "qk" else 3):
            want = "B×H×S×D" if name in "qk" else "B×S×D"
            raise ValueError(f"rope: {name} must be 4-D {want}" if name in "qk" else f"rope: {name} must be 3-D {want}, got shape {tuple(t.shape)}")
    b, _, s, d = q.shape
    if k.shape[0] != b or k.shape[2:] != q.shape[2:]:
        raise ValueError(f"rope: k must be B×Hk×S×D matching q {tuple(q.shape)}, got {tuple(k.shape)}")
    if d % 2:
        raise ValueError(f"rope: head dim must be even, got {d}")
    if cos.shape != sin.shape or cos.shape[1:] != (s, d) or cos.shape[0] not in (1, b):
        raise ValueError(f"rope: cos and sin must be {b}×{s}×{d} or 1×{s}×{d}, got {tuple(cos.shape)} and {tuple(sin.shape)}")
    if q.dtype != k.dtype:
        raise TypeError(f"rope: q and k must have the same dtype, got {q.dtype} and {k.dtype}")
    if torch.is_grad_enabled() and (cos.requires_grad or sin.requires_grad):
        raise ValueError("rope: cos and sin require grad, but rope treats them as constants; pass cos.detach(), sin.detach()")
    device = _check_same_device("rope", q=q, k=k, cos=cos, sin=sin)
    return ops.rope(q, k, cos, sin, backend_for(backend, device))


def linear_cross_entropy(
    hidden: Tensor,
    weight: Tensor,
    labels: Tensor,
    *,
    bias: Tensor | None = None,
    ignore_index: int = -100,
    reduction: str = "mean",
    softcap: float | None = None,
    backend: str | None = None,
) -> Tensor:
    """cross_entropy(softcap(hidden @ weight.T + bias), labels) without holding all logits.

    hidden: (..., H); weight: V×H; labels: hidden's leading shape, int64. ``reduction`` is
    ``"mean"`` (over tokens whose label is not ``ignore_index``) or ``"sum"``. Under autocast the
    matrix product runs in the autocast dtype, as ``nn.Linear`` would. Returns an fp32 scalar.

    A label outside ``[0, V)`` that is not ``ignore_index`` raises ``IndexError`` where checking
    is free: labels on the CPU (every backend, eager or compiled). Elsewhere (CUDA/ROCm, the
    reference backend on any other device) a host check would wait for the device, so such a
    row's loss, hence the returned loss, is NaN instead, and so are the gradients, eager and
    under torch.compile alike (no graph break).
    """
    op = "linear_cross_entropy"
    _check_float("hidden", hidden, op)
    _check_float("weight", weight, op)
    if weight.dim() != 2 or weight.shape[1] != hidden.shape[-1]:
        raise ValueError(f"{op}: weight must be V×{hidden.shape[-1]}, got {tuple(weight.shape)}")
    _check_vector(op, "bias", bias, weight.shape[0])
    if not isinstance(labels, Tensor) or labels.dtype not in (torch.int64, torch.int32):
        raise TypeError(f"{op}: labels must be an int64 tensor, got {getattr(labels, 'dtype', type(labels).__name__)}")
    if labels.shape != hidden.shape[:-1]:
        raise ValueError(f"{op}: labels must have shape {tuple(hidden.shape[:-1])} (hidden without its last dim), got {tuple(labels.shape)}")
    if reduction not in ("mean", "sum"):
        raise ValueError(f"{op}: reduction must be 'mean' or 'sum', got {reduction!r}")
    if softcap is not None and not softcap > 0:
        raise ValueError(f"{op}: softcap must be a positive number or None, got {softcap!r}")
    device = _check_same_device(op, hidden=hidden, weight=weight, bias=bias, labels=labels)
    if autocast_enabled(device.type):
        dtype = torch.get_autocast_dtype(device.type)
        hidden, weight = hidden.to(dtype), weight.to(dtype)
        bias = None if bias is None else bias.to(dtype)
    elif hidden.dtype != weight.dtype:
        raise TypeError(f"{op}: hidden and weight must have the same dtype outside autocast, got {hidden.dtype} and {weight.dtype}")
    h = hidden.reshape(-1, hidden.shape[-1])
    y = labels.reshape(-1).long()
    softcap = None if softcap is None else float(softcap)
    return ops.linear_cross_entropy(h, weight, bias, y, int(ignore_index), softcap, reduction, resolve(backend, device))
