"""Which dtype a norm returns for each input and weight dtype, probed: the families differ, and a fused
module must return what the original returns.

    Llama, Qwen, Mistral   weight * x.to(input_dtype)           promote(x, w): bf16 x, fp32 w → fp32
    Gemma, nn.RMSNorm,     (…).type_as(x), F.layer_norm          x's dtype
      nn.LayerNorm
    T5                     x.to(w.dtype) if w is half; w * x     w's if half, else fp32

The probe copy runs on a few rows in each of fp32 / bf16 / fp16 for x and for the weights (combinations
the original refuses are left out) and the rule (``modules.norms.OUT_DTYPE_RULES``) that names every
dtype seen is the spec's ``out_dtype``. Under autocast: CPU autocast is probed as it is; CUDA's (and
XPU's) runs layer_norm, rms_norm, pow, rsqrt and the other ops of ATen's ``AT_FORALL_FP32`` list in fp32
(nn.LayerNorm returns fp32 there whatever its input), which cannot run here, so a function mode casts
those ops' half inputs to fp32 as that policy does (``_gpu_autocast``), and the rule seen is the
spec's ``autocast_out_dtype`` (None where it is the plain one).
"""
from __future__ import annotations

import contextlib
import itertools
import warnings

import torch
from torch import nn
from torch.overrides import TorchFunctionMode
from torch.utils._pytree import tree_map

from torchfuser.modules.norms import OUT_DTYPE_RULES, output_dtype
from torchfuser.patterns import _probe
from torchfuser.patterns.base import Skip

_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
_HALF = (torch.bfloat16, torch.float16)

# ATen's AT_FORALL_FP32 and AT_FORALL_FP32_SET_OPT_DTYPE (aten/src/ATen/autocast_mode.h): what CUDA
# autocast runs in fp32, by the name the Python functions and methods carry. rms_norm joined the list in
# PyTorch 2.12 (pytorch#174824); before it, CUDA autocast leaves rms_norm alone.
_FP32_UNDER_GPU_AUTOCAST = frozenset((
    "acos", "asin", "cosh", "erfinv", "exp", "expm1", "log", "log10", "log2", "log1p", "reciprocal", "rsqrt",
    "sinh", "tan", "pow", "__pow__", "__rpow__", "float_power", "softplus", "layer_norm", "native_layer_norm",
    "group_norm", "norm", "frobenius_norm", "nuclear_norm", "cosine_similarity", "dist", "pdist",
    "cdist", "renorm", "logsumexp", "prod", "softmax", "log_softmax", "cumprod", "cumsum", "sum",
    "linalg_vector_norm", "vector_norm", "linalg_matrix_norm", "matrix_norm",
)) | (frozenset(("rms_norm",)) if torch.torch_version.TorchVersion(torch.__version__) >= (2, 12) else frozenset())


class _GPUAutocastPolicy(TorchFunctionMode):
    """CUDA autocast's fp32 list, emulated on the CPU: those ops' bf16 / fp16 tensor inputs cast to fp32, while
    autocast is on (a module may turn it off around its own ops)."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if (getattr(func, "__name__", None) in _FP32_UNDER_GPU_AUTOCAST and torch.is_autocast_enabled("cpu")
                and torch.is_autocast_enabled("cuda")):
            args, kwargs = tree_map(_to_fp32, (args, kwargs))
        return func(*args, **kwargs)


@contextlib.contextmanager
def _gpu_autocast():
    """CUDA bf16 autocast as the probe's CPU tensors can see it: the policy above, and autocast's state on for
    code that reads it (Nemotron's norm casts its inputs to ``torch.get_autocast_dtype(x.device.type)`` where
    ``torch.is_autocast_enabled()``, then turns autocast off for x's device type): CUDA's flag and dtype, and
    CPU autocast in bf16 (which casts no op a norm runs; ``out_dtypes`` checks its rule is the plain one)."""
    was = torch.is_autocast_enabled("cuda"), torch.get_autocast_dtype("cuda")
    torch.set_autocast_enabled("cuda", True)
    torch.set_autocast_dtype("cuda", torch.bfloat16)
    try:
        with torch.autocast("cpu", dtype=torch.bfloat16), _GPUAutocastPolicy():
            yield
    finally:
        torch.set_autocast_enabled("cuda", was[0])
        torch.set_autocast_dtype("cuda", was[1])


def _to_fp32(t):
    return t.float() if isinstance(t, torch.Tensor) and t.dtype in _HALF else t


def _seen(probe: nn.Module, x64: torch.Tensor, context) -> dict:
    """{(x dtype, weight dtype): the output's dtype} where the probe copy runs on them."""
    seen = {}
    for xd, wd in itertools.product(_DTYPES, _DTYPES):
        copy = _probe.shallow_copy(probe)
        copy._parameters = {n: None if p is None else nn.Parameter(p.detach().to(wd), requires_grad=False)
                            for n, p in probe._parameters.items()}
        try:  # the probe's own warnings (PyTorch's "Mismatch dtype ... fused implementation") are not the user's
            with context(), warnings.catch_warnings():
                warnings.simplefilter("ignore")
                y = _probe.run(copy, x64.to(xd))
        except Exception:  # a combination the original refuses (nn.LayerNorm: fp32 x, bf16 weight)
            continue
        if isinstance(y, torch.Tensor):
            seen[xd, wd] = y.dtype
    return seen


def _rule(seen: dict, autocast: torch.dtype | None = None) -> str | None:
    return next((r for r in OUT_DTYPE_RULES
                 if all(output_dtype(r, xd, wd, autocast) == out for (xd, wd), out in seen.items())), None)


def _table(seen: dict) -> str:
    name = lambda d: str(d).removeprefix("torch.")  # noqa: E731
    return ", ".join(f"{name(xd)} x with {name(wd)} weights → {name(out)}" for (xd, wd), out in seen.items())


def out_dtypes(probe: nn.Module, x64: torch.Tensor) -> tuple[str, str | None] | Skip:
    """(``out_dtype``, ``autocast_out_dtype``) of a norm's probe copy (float64 parameters) on ``x64``, or a
    Skip where its output dtype follows none of the rules."""
    plain = _seen(probe, x64, contextlib.nullcontext)
    rule = _rule(plain)
    if rule is None:
        return Skip(f"its output dtype follows none of the rules a fused norm reproduces ({_table(plain)})")
    cpu = _seen(probe, x64, lambda: torch.autocast("cpu", dtype=torch.bfloat16))
    if _rule(cpu) != rule:
        return Skip(f"its output dtype under CPU autocast differs from without it ({_table(cpu)}), which a fused "
                    "norm does not reproduce")
    gpu = _rule(_seen(probe, x64, _gpu_autocast), torch.bfloat16)
    if gpu is None:
        return Skip("its output dtype under CUDA autocast follows none of the rules a fused norm reproduces")
    return rule, (None if gpu == rule else gpu)

