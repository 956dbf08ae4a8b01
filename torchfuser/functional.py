"""Fused ops on tensors. Each call checks its inputs, picks the backend for the tensors'
device (``backend=None``) and runs the ``torchfuser::`` custom ops, forward and backward."""
from __future__ import annotations

import torch
from torch import Tensor

from torchfuser import ops
from torchfuser.backends import resolve
from torchfuser.ops._call import autocast_enabled

__all__ = ["rms_norm", "add_rms_norm", "layer_norm", "swiglu", "geglu", "gelu", "activation", "rope", "linear_cross_entropy", "moe_route",
           "moe_experts"]

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
    device = check_add_rms_norm(x, residual, weight, out_dtype)
    return ops.add_rms_norm(x, residual, weight, float(eps), float(offset), backend_for(backend, device), out_dtype)


def check_add_rms_norm(x: Tensor, residual: Tensor, weight: Tensor, out_dtype: torch.dtype | None) -> torch.device:
    """add_rms_norm's checks of its inputs; their device."""
    return _check_norm_and_add("add_rms_norm", "x", x, residual, weight, "out_dtype", out_dtype)


def _check_norm_and_add(op: str, first: str, t: Tensor, residual: Tensor, weight: Tensor, dtype_name: str,
                        dtype: torch.dtype | None) -> torch.device:
    """The checks of a norm fused with a residual add (``t`` named ``first``, the output dtype ``dtype_name``);
    their device."""
    for name, v in ((first, t), ("residual", residual), ("weight", weight)):
        _check_float(name, v, op)
    if t.shape != residual.shape:
        raise ValueError(f"{op}: {first} and residual must have the same shape, got {tuple(t.shape)} and {tuple(residual.shape)}")
    _check_vector(op, "weight", weight, t.shape[-1])
    device = _check_same_device(op, **{first: t, "residual": residual, "weight": weight})
    if dtype is not None and dtype not in _FLOATS:
        raise TypeError(f"{op}: {dtype_name} must be a floating dtype or None, got {dtype}")
    return device


def rms_norm_add(
    a: Tensor, residual: Tensor, weight: Tensor, eps: float = 1e-6, *, offset: float = 0.0,
    y_dtype: torch.dtype | None = None, backend: str | None = None,
) -> Tensor:
    """residual + rms_norm(a) in one forward kernel: a norm on a block's output, then the residual add (OLMo-2's
    post-block norms). The norm is rounded to ``y_dtype`` (default a's) and added in torch's promoted dtype of
    residual and it, as ``residual + norm(a)`` would."""
    device = check_rms_norm_add(a, residual, weight, y_dtype)
    return ops.rms_norm_add(a, residual, weight, float(eps), float(offset), backend_for(backend, device), y_dtype)


def check_rms_norm_add(a: Tensor, residual: Tensor, weight: Tensor, y_dtype: torch.dtype | None) -> torch.device:
    """rms_norm_add's checks of its inputs; their device."""
    return _check_norm_and_add("rms_norm_add", "a", a, residual, weight, "y_dtype", y_dtype)


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
    backend = backend_for(backend, check_gated(op, gate, up))
    return getattr(ops, op)(gate, up, backend) if up is not None else getattr(ops, f"{op}_packed")(gate, backend)


def check_gated(op: str, gate: Tensor, up: Tensor | None) -> torch.device:
    """A gated activation's checks of its inputs (``up=None``: one [gate | up] tensor); their device."""
    if up is not None:
        return _check_pair(op, gate, up)
    _check_float("gate", gate, op)
    if gate.dim() == 0 or gate.shape[-1] % 2:
        raise ValueError(f"{op}: with up=None, gate holds [gate | up] along its last dim, which must be even; "
                         f"got shape {tuple(gate.shape)}")
    return gate.device


def swiglu(gate: Tensor, up: Tensor | None = None, *, backend: str | None = None) -> Tensor:
    """silu(gate) · up. With ``up=None``, ``gate`` is one [gate | up] tensor (a fused gate_up
    projection's output) and its gradient comes back as one tensor, never concatenated."""
    return _gated("swiglu", gate, up, backend)


def geglu(gate: Tensor, up: Tensor | None = None, *, approximate: str = "tanh", backend: str | None = None) -> Tensor:
    """gelu_tanh(gate) · up, or with ``approximate="none"`` exact (erf) gelu(gate) · up; ``up=None`` as for ``swiglu``."""
    if approximate not in ("none", "tanh"):
        raise ValueError(f"geglu: approximate must be 'none' or 'tanh', got {approximate!r}")
    return _gated("geglu" if approximate == "tanh" else "geglu_erf", gate, up, backend)


def gelu(x: Tensor, approximate: str = "none", *, backend: str | None = None) -> Tensor:
    """GELU, exact (``"none"``) or tanh-approximated (``"tanh"``)."""
    _check_float("x", x, "gelu")
    if approximate not in ("none", "tanh"):
        raise ValueError(f"gelu: approximate must be 'none' or 'tanh', got {approximate!r}")
    return ops.gelu(x, approximate, backend_for(backend, x.device))


def activation(x: Tensor, kind: str, *, backend: str | None = None) -> Tensor:
    """A plain MLP's hidden activation besides GELU: ``"relu"`` max(x, 0) or ``"relu2"`` max(x, 0)²."""
    _check_float("x", x, "activation")
    if kind not in ("relu", "relu2"):
        raise ValueError(f"activation: kind must be 'relu' or 'relu2', got {kind!r}")
    return ops.activation(x, kind, backend_for(backend, x.device))


def rope(q: Tensor, k: Tensor, cos: Tensor, sin: Tensor, *, backend: str | None = None) -> tuple[Tensor, Tensor]:
    """Rotary embedding in Hugging Face layout, rotate-half convention.

    q: B×Hq×S×D, k: B×Hk×S×D, cos and sin: B×S×R (or 1×S×R), shared by all heads; R < D rotates the
    first R channels of each head and passes the rest through (partial rotary).
    cos and sin are constants: rope does not differentiate through them.
    """
    return ops.rope(q, k, cos, sin, backend_for(backend, check_rope(q, k, cos, sin)))


def check_rope(q: Tensor, k: Tensor, cos: Tensor, sin: Tensor) -> torch.device:
    """rope's checks of its inputs; their device."""
    for name, t in (("q", q), ("k", k), ("cos", cos), ("sin", sin)):
        _check_float(name, t, "rope")
        if t.dim() != (4 if name in "qk" else 3):
            want = "B×H×S×D" if name in "qk" else "B×S×D"
            raise ValueError(f"rope: {name} must be {'4' if name in 'qk' else '3'}-D {want}, got shape {tuple(t.shape)}")
    b, _, s, d = q.shape
    if k.shape[0] != b or k.shape[2:] != q.shape[2:]:
        raise ValueError(f"rope: k must be B×Hk×S×D matching q {tuple(q.shape)}, got {tuple(k.shape)}")
    if d % 2:
        raise ValueError(f"rope: head dim must be even, got {d}")
    r = cos.shape[-1] if cos.dim() == 3 else d  # r < d: partial rotary (the first r channels rotate)
    width_ok = 0 < r <= d or r == d == 0  # an empty head rotates its empty width
    if cos.shape != sin.shape or cos.shape[1:] != (s, r) or cos.shape[0] not in (1, b) or r % 2 or not width_ok:
        raise ValueError(f"rope: cos and sin must be {b}×{s}×R or 1×{s}×R with R even and at most the head dim {d}, "
                         f"got {tuple(cos.shape)} and {tuple(sin.shape)}")
    if q.dtype != k.dtype:
        raise TypeError(f"rope: q and k must have the same dtype, got {q.dtype} and {k.dtype}")
    if torch.is_grad_enabled() and (cos.requires_grad or sin.requires_grad):
        raise ValueError("rope: cos and sin require grad, but rope treats them as constants; pass cos.detach(), sin.detach()")
    return _check_same_device("rope", q=q, k=k, cos=cos, sin=sin)


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
    fp8: str | None = None,
) -> Tensor:
    """cross_entropy(softcap(hidden @ weight.T + bias), labels) without holding all logits.

    hidden: (..., H); weight: V×H; labels: hidden's leading shape, int64. ``reduction`` is
    ``"mean"`` (over tokens whose label is not ``ignore_index``) or ``"sum"``. Under autocast the
    matrix product runs in the autocast dtype, as ``nn.Linear`` would. Returns an fp32 scalar.

    ``fp8="rowwise"`` or ``"tensorwise"``: the three products (the logits h·Wᵀ, dh = dl·W, dW = dlᵀ·h)
    run as FP8 (e4m3) GEMMs with current scaling along each one's inner dimension (per row, or one
    scale per tensor); lossy (docs/usage.md#fp8). It needs bf16 operands (bf16 autocast or bf16
    tensors) and tokens, H and V in multiples of 16, else ValueError
    (``linear_cross_entropy_fp8_blocker`` says why beforehand). On the CPU it runs on the reference
    backend whatever ``backend`` says: the MLIR backend has no FP8 GEMMs.

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
    name = resolve(backend, device)
    if fp8 is not None:
        if fp8 not in _FP8_RECIPES:
            raise ValueError(f"{op}: fp8 must be None, 'rowwise' or 'tensorwise', got {fp8!r}")
        why = _fp8_blocker(h.shape[0], h.shape[1], weight.shape[0], h.dtype, weight.dtype)
        if why is not None:
            raise ValueError(f"{op}: fp8={fp8!r} cannot run here: {why}")
        if name == "mlir":
            # The MLIR backend has no FP8 GEMMs; the reference backend's are torch._scaled_mm (or its
            # fp32 emulation, _fp8_gemm.mm) on the CPU, with the same quantisation the Triton kernels give.
            name = "reference"
    return ops.linear_cross_entropy(h, weight, bias, y, int(ignore_index), softcap, reduction, name, fp8)


_FP8_RECIPES = ("rowwise", "tensorwise")


def _fp8_blocker(n: int, hdim: int, vocab: int, h_dtype: torch.dtype, w_dtype: torch.dtype) -> str | None:
    if h_dtype != torch.bfloat16 or w_dtype != torch.bfloat16:
        dtype = h_dtype if h_dtype != torch.bfloat16 else w_dtype
        return (f"its products would run in {str(dtype).removeprefix('torch.')}; FP8 GEMMs need bf16 operands "
                "(bf16 autocast or bf16 hidden states and weight)")
    if n % 16 or hdim % 16 or vocab % 16:
        # FP8 GEMM kernels take multiples of 16; the tokens are dW's inner dimension (and each chunk's rows)
        return f"{n} tokens × {hdim} → {vocab} is not in multiples of 16 (pad the batch's tokens to a multiple of 16)"
    return None


def linear_cross_entropy_fp8_blocker(hidden: Tensor, weight: Tensor) -> str | None:
    """Why ``linear_cross_entropy(hidden, weight, ..., fp8=...)`` cannot run FP8 GEMMs now (under the
    autocast state of this call), or None where it can: the fused LM head asks before each call and
    counts a call that runs bf16 instead."""
    device = hidden.device.type
    if autocast_enabled(device):
        h_dtype = w_dtype = torch.get_autocast_dtype(device)
    else:
        h_dtype, w_dtype = hidden.dtype, weight.dtype
    hdim = hidden.shape[-1]
    return _fp8_blocker(hidden.numel() // max(hdim, 1), hdim, weight.shape[0], h_dtype, w_dtype)


_SCORINGS = ("softmax", "sigmoid", "softmax_topk")
_MOE_ACTS = ("silu", "gelu_tanh", "clamped_swiglu")
_HALVES = ("gate_up", "up_gate", "interleaved")


def moe_route(
    logits: Tensor, top_k: int, *, scoring: str = "softmax", renorm: bool = False, scale: float = 1.0,
    correction: Tensor | None = None, n_group: int = 1, topk_group: int = 1, group_top: int = 2,
    backend: str | None = None,
) -> tuple[Tensor, Tensor]:
    """A router's top-k: logits (T, E) → (weights (T, k) fp32, indices (T, k) int64). ``scoring``:
    softmax or sigmoid scores, of which the k best are chosen (after adding ``correction`` and
    keeping the ``topk_group`` best of ``n_group`` groups, as DeepSeek-V3), or ``softmax_topk``,
    the softmax of the k largest logits (GPT-OSS). Then renormalised to sum 1 and scaled. Only the
    weights are differentiable (w.r.t. logits). Formulas: backends/reference/moe.py."""
    op = "moe_route"
    _check_float("logits", logits, op)
    if logits.dim() != 2:
        raise ValueError(f"{op}: logits must be 2-D (tokens, experts), got shape {tuple(logits.shape)}")
    e = logits.shape[1]
    if scoring not in _SCORINGS:
        raise ValueError(f"{op}: scoring must be one of {_SCORINGS}, got {scoring!r}")
    if not 1 <= top_k <= e:
        raise ValueError(f"{op}: top_k must be in 1..{e} (the number of experts), got {top_k}")
    if n_group < 1 or e % n_group or not 1 <= topk_group <= n_group or (n_group > 1 and not 1 <= group_top <= e // n_group):
        raise ValueError(f"{op}: {e} experts do not split into n_group={n_group} groups with topk_group={topk_group}, "
                         f"group_top={group_top}")
    _check_vector(op, "correction", correction, e)
    device = _check_same_device(op, logits=logits, correction=correction)
    return ops.moe_route(logits, correction, int(top_k), scoring, bool(renorm), int(n_group), int(topk_group),
                         int(group_top), float(scale), backend_for(backend, device))


def moe_experts(
    x: Tensor, weights: Tensor, indices: Tensor, gate_up: Tensor, down: Tensor, *, gate_up_bias: Tensor | None = None,
    down_bias: Tensor | None = None, transposed: bool = False, halves: str = "gate_up", activation: str = "silu",
    alpha: float = 1.0, limit: float = 0.0, out_dtype: torch.dtype | None = None, backend: str | None = None,
) -> Tensor:
    """Routed gated experts: y[t] = Σ_j weights[t, j] · expert_{indices[t, j]}(x[t]) with expert_e(x) =
    (act(x·gate_up[e]ᵀ + b) · down[e]ᵀ + d). x (T, H); gate_up (E, 2I, H) and down (E, H, I), or
    (E, H, 2I) and (E, I, H) with ``transposed``; biases (E, 2I) and (E, H). ``halves`` orders gate
    and up in gate_up's output; ``activation`` silu, gelu_tanh or clamped_swiglu (GPT-OSS, with
    ``alpha`` and ``limit``). The products run in x's dtype (the weights are cast to it inside the op,
    and their gradients come back in their own dtype); y has ``out_dtype`` (default x's), summed over
    the k experts in fp32."""
    op = "moe_experts"
    for name, t in (("x", x), ("weights", weights), ("gate_up", gate_up), ("down", down)):
        _check_float(name, t, op)
    if x.dim() != 2 or gate_up.dim() != 3 or down.dim() != 3:
        raise ValueError(f"{op}: x must be 2-D and gate_up, down 3-D, got {tuple(x.shape)}, {tuple(gate_up.shape)}, "
                         f"{tuple(down.shape)}")
    e, h = gate_up.shape[0], x.shape[1]
    two_i = gate_up.shape[2] if transposed else gate_up.shape[1]
    want_gu = (e, h, two_i) if transposed else (e, two_i, h)
    want_dn = (e, two_i // 2, h) if transposed else (e, h, two_i // 2)
    if tuple(gate_up.shape) != want_gu or tuple(down.shape) != want_dn or two_i % 2:
        raise ValueError(f"{op}: for x of width {h}, gate_up {tuple(gate_up.shape)} and down {tuple(down.shape)} do not "
                         f"fit (transposed={transposed})")
    if indices.dtype != torch.int64 or indices.dim() != 2 or indices.shape[0] != x.shape[0] or weights.shape != indices.shape:
        raise ValueError(f"{op}: indices must be int64 (tokens, k) and weights the same shape, got {indices.dtype} "
                         f"{tuple(indices.shape)} and {tuple(weights.shape)} for {x.shape[0]} tokens")
    for name, b, n in (("gate_up_bias", gate_up_bias, two_i), ("down_bias", down_bias, h)):
        if b is not None and tuple(b.shape) != (e, n):
            raise ValueError(f"{op}: {name} must have shape ({e}, {n}), got {tuple(b.shape)}")
    for name, b in (("gate_up_bias", gate_up_bias), ("down_bias", down_bias)):
        if b is not None:
            _check_float(name, b, op)
    if halves not in _HALVES or activation not in _MOE_ACTS:
        raise ValueError(f"{op}: halves must be one of {_HALVES} and activation one of {_MOE_ACTS}")
    device = _check_same_device(op, x=x, weights=weights, indices=indices, gate_up=gate_up, down=down,
                                gate_up_bias=gate_up_bias, down_bias=down_bias)
    return ops.moe_experts(x, weights, indices, gate_up, gate_up_bias, down, down_bias, bool(transposed), halves,
                           activation, alpha, limit, out_dtype, backend_for(backend, device))


def moe_grouped_gemms(x: Tensor, *weights: Tensor) -> bool:
    """Whether ``moe_experts`` runs its products as grouped GEMMs for these operands (else a loop over experts)."""
    return ops.moe.grouped_gemms(x, *weights)
