"""Fused mixture-of-experts block: router top-k and the routed experts as two ops (``ops.moe``), the
shared expert (and its sigmoid gate) as the model's own modules, every parameter the original's.

The router's logits are one GEMM of the router's own weight (``F.linear``, as the router computes
them). Where the router module carries hooks (transformers records ``output_router_logits`` for the
auxiliary loss with a forward hook on it), the router module itself is called instead and its logits
taken, so that the hooks see exactly what they saw; the top-k is ours either way. Calls the fused
path cannot take (hooks on the experts, a replaced child, router jitter on in training) run the
original forward on this module and are counted (``fallbacks``).
"""
from __future__ import annotations

import contextlib
from dataclasses import dataclass

import torch
from torch import Tensor, nn

from torchfuser import functional as F
from torchfuser.modules import decode, fallbacks
from torchfuser.modules.base import FusedModule, adopt, hooked
from torchfuser.ops._call import autocast_enabled
from torchfuser.ops.moe import KERNELS as MOE_KERNELS


@dataclass(frozen=True)
class MoESpec:
    """What a sparse MoE block computes (formulas: backends/reference/moe.py)."""

    num_experts: int
    top_k: int
    router: str  # the child called as the router
    router_weight: str  # dotted path, from the block, of its (E, H) weight
    experts: str  # the child holding the stacked expert weights
    gate_up: str  # its (E, 2I, H) parameter, (E, H, 2I) if transposed
    down: str  # its (E, H, I) parameter, (E, I, H) if transposed
    activation: str  # "silu", "gelu_tanh" or "clamped_swiglu" (GPT-OSS)
    scoring: str = "softmax"  # "softmax", "sigmoid" or "softmax_topk" (softmax of the k largest logits)
    renorm: bool = False  # top-k weights divided by their sum
    scale: float = 1.0  # routed scaling factor
    router_bias: str | None = None  # dotted path of the router's (E,) bias (GPT-OSS)
    correction: str | None = None  # dotted path of an (E,) score bias used to choose only (DeepSeek-V3)
    n_group: int = 1  # experts in groups, of which only the topk_group best are chosen from
    topk_group: int = 1
    group_top: int = 2  # a group's score: the sum of its group_top best expert scores
    router_fp32: bool = False  # logits from fp32 copies of the input and weight (autocast off)
    logits_at: int | None = 0  # where the router module's output holds the logits (None: it is them)
    router_args: tuple[str, ...] = ()  # tensors of the block's own it passes the router after the hidden states
    router_flat: bool = True  # the router is called on (tokens, hidden), else on the block's input as it came
    gate_up_bias: str | None = None
    down_bias: str | None = None
    transposed: bool = False
    halves: str = "gate_up"  # order of gate and up in gate_up's output: "gate_up", "up_gate", "interleaved"
    alpha: float = 1.0  # clamped SwiGLU's σ(α·g) and clamp limit
    limit: float = 0.0
    shared: str | None = None  # child added to the routed output (a shared expert)
    shared_gate: str | None = None  # an H → 1 Linear: the shared expert is scaled by its sigmoid
    shared_flat: bool = True  # the shared expert is called on (tokens, hidden), else on the block's input
    returns: tuple[str, ...] = ("hidden",)  # the output, or a tuple of it and "weights" / "logits"
    jitter: str | None = None  # a float attribute: router input jitter in training (then unfused)
    keep: tuple[str, ...] = ()  # every other child and tensor of the block, held for state and repr

    def describe(self) -> str:
        act = {"silu": "SiLU", "gelu_tanh": "tanh-GELU", "clamped_swiglu": "clamped SwiGLU"}[self.activation]
        extra = " + shared expert" if self.shared else ""
        return f"{self.num_experts} experts, top-{self.top_k}, {self.scoring} router, {act}{extra}"


def _path(root: nn.Module, dotted: str | None):
    if dotted is None:
        return None
    *mods, leaf = dotted.split(".")
    m = root
    for name in mods:
        m = getattr(m, name)
    return getattr(m, leaf)


class FusedMoE(FusedModule):
    kernels_in = MOE_KERNELS  # backends with MoE kernels of their own (the report says which runs)

    def __init__(self, original: nn.Module, spec: MoESpec, backend: str = "auto"):
        super().__init__(spec, backend)
        names = [spec.router, spec.experts, spec.shared, spec.shared_gate, *spec.keep]
        adopt(self, original, [n for n in names if n is not None])
        # The children's classes when fused: a child swapped later (PEFT wrapping the experts' weights)
        # would be bypassed by the fused path, so such calls run the original forward.
        self._kinds = {n: type(getattr(self, n)) for n in (spec.router, spec.experts)}
        if spec.jitter is not None:
            self.__dict__[spec.jitter] = getattr(original, spec.jitter)

    def describe(self, backend_label: str) -> str:
        return f"{backend_label}: {self.spec.describe()}"

    def _unfused(self) -> str | None:
        s = self.spec
        if any(type(getattr(self, n)) is not t for n, t in self._kinds.items()):
            return "its router or experts were replaced after fusing (an adapter?): the fused path reads their weights"
        experts = getattr(self, s.experts)
        if hooked(experts) or "forward" in experts.__dict__:
            return "hooks (or a forward of its own) on its experts: the fused path would skip them"
        if s.jitter is not None and self.training and getattr(self, s.jitter) > 0:
            return "router jitter noise on in training (the fused path has none)"
        return None

    def _logits(self, x: Tensor, hidden_states: Tensor) -> Tensor:
        s = self.spec
        router = getattr(self, s.router)
        if hooked(*router.modules()) or any("forward" in m.__dict__ for m in router.modules()):
            out = router(x if s.router_flat else hidden_states, *(getattr(self, n) for n in s.router_args))
            return out if s.logits_at is None else out[s.logits_at]
        weight, bias = _path(self, s.router_weight), _path(self, s.router_bias)
        if s.router_fp32:
            off = torch.autocast(x.device.type, enabled=False) if autocast_enabled(x.device.type) else contextlib.nullcontext()
            with off:
                return nn.functional.linear(x.float(), weight.float(), None if bias is None else bias.float())
        return nn.functional.linear(x, weight, bias)

    def forward(self, hidden_states: Tensor, *args, **kwargs):
        if not torch.is_grad_enabled() and (o := decode.original(self, hidden_states)) is not None:  # a decode step
            return decode.run(o, hidden_states, *args, **kwargs)  # (its shared expert follows it)
        s = self.spec
        why = self._unfused() if not args and not kwargs else "called with more than its input"
        if why is not None:
            fallbacks.count(self, why)
            return type(self._original).forward(self, hidden_states, *args, **kwargs)
        shape = hidden_states.shape
        x = hidden_states.reshape(-1, shape[-1])
        logits = self._logits(x, hidden_states)
        correction = _path(self, s.correction)
        weights, indices = F.moe_route(logits, s.top_k, scoring=s.scoring, renorm=s.renorm, scale=s.scale,
                                       correction=None if correction is None else correction.reshape(-1),
                                       n_group=s.n_group,
                                       topk_group=s.topk_group, group_top=s.group_top, backend=self.backend)
        y = self._experts(x, weights, indices)
        if s.shared is not None:
            shared = getattr(self, s.shared)(x if s.shared_flat else hidden_states).reshape(x.shape)
            if s.shared_gate is not None:
                shared = torch.sigmoid(getattr(self, s.shared_gate)(x)) * shared
            y = y + shared
        y = y.reshape(shape)
        if s.returns == ("hidden",):
            return y
        extra = {"weights": weights.to(logits.dtype), "logits": logits}
        return (y, *(extra[r] for r in s.returns[1:]))

    def _experts(self, x: Tensor, weights: Tensor, indices: Tensor) -> Tensor:
        s = self.spec
        experts = getattr(self, s.experts)
        tensors = [getattr(experts, n) if n is not None else None for n in (s.gate_up, s.gate_up_bias, s.down,
                                                                             s.down_bias)]
        device = x.device.type
        # As F.linear under autocast: products in the autocast dtype. Otherwise, as transformers'
        # grouped experts do, the input in the weights' dtype. The output has the input's dtype. The
        # op casts the weights itself (inside each pass: fp32 parameters leave no bf16 copy saved).
        cast = autocast_enabled(device) and x.dtype in (torch.float32, torch.bfloat16, torch.float16)  # not fp64
        dtype = torch.get_autocast_dtype(device) if cast else tensors[0].dtype
        gate_up, gate_up_bias, down, down_bias = tensors
        xc = x.to(dtype)
        counted = not torch.compiler.is_compiling() and device != "meta"  # a count, not a branch
        if counted and not F.moe_grouped_gemms(xc, gate_up, down):
            fallbacks.count(self, f"experts' products ran as a loop over the experts, not grouped GEMMs "
                                  f"({str(dtype).removeprefix('torch.')} on {device}, or widths not 16-byte aligned)")
        return F.moe_experts(xc, weights, indices, gate_up, down, gate_up_bias=gate_up_bias, down_bias=down_bias,
                             transposed=s.transposed, halves=s.halves, activation=s.activation, alpha=s.alpha,
                             limit=s.limit, out_dtype=x.dtype, backend=self.backend)

