"""Fused MLP blocks. The projections stay the original ``nn.Linear`` / ``Conv1D`` submodules;
what is fused is the activation (and, for gated MLPs, the gating product, on the one [gate | up]
output of a fused gate_up projection or, under autocast, of gate and up run as one GEMM)."""
from __future__ import annotations

import contextlib
import functools
from dataclasses import dataclass

import torch
from torch import Tensor, nn

from torchfuser import functional as F, ops
from torchfuser.functional import backend_for
from torchfuser.modules import decode, fp8, recompute
from torchfuser.modules.adapters import lora
from torchfuser.modules.base import FusedModule, adopt, apply_dropout, decided, dropout_p, keep_dropout
from torchfuser.modules.projections import call_linear, joint, residual_linear, single
from torchfuser.ops import gated as gated_ops


@dataclass(frozen=True)
class GatedMLPSpec:
    """down(act(gate(x)) · up(x)); with ``gate_up`` one projection yields both halves."""

    activation: str  # "silu" → swiglu, "gelu_tanh" → geglu, "gelu" (erf) → geglu(approximate="none")
    down: str
    gate: str | None = None
    up: str | None = None
    gate_up: str | None = None
    gate_first: bool = True  # order of the halves of gate_up's output
    dropout: str | None = None  # after down: an nn.Dropout child or a float p attribute (Seed-OSS)
    keep: tuple[str, ...] = ()  # other parameter-free submodules kept for state and repr
    inner_dropout: str | None = None  # on act(gate)·up, before down (ModernBERT-decoder's ``drop``)


@dataclass(frozen=True)
class MLPSpec:
    """dropout(fc_out(inner_dropout(act(fc_in(x))))) (+ residual)."""

    fc_in: str
    fc_out: str
    approximate: str  # GELU's: "none" (erf GELU) or "tanh"
    dropout: str | None = None  # after fc_out: an nn.Dropout child or a float p attribute (Starcoder2)
    keep: tuple[str, ...] = ()
    activation: str = "gelu"  # "gelu" (per ``approximate``), "relu" or "relu2" (functional.activation)
    residual: str | None = None  # a forward argument added after the dropout (BLOOM's and MPT's MLPs)
    inner_dropout: str | None = None  # on the activation's output, before fc_out (ProphetNet's activation_dropout)


class _WithLoRA:
    """``lora_summary`` ('LoRA r=16' while PEFT adapters are active on the projections, read by the
    report) and the same in ``extra_repr``."""

    _projections: tuple[str, ...] = ()

    @property
    def lora_summary(self) -> str | None:
        return lora.summary(self, [getattr(self.spec, n) for n in self._projections])

    def extra_repr(self) -> str:
        return super().extra_repr() + (f", with {t}" if (t := self.lora_summary) else "")


_NOTHING = contextlib.nullcontext()  # reusable
_GATED_OPS = {"silu": "swiglu", "gelu_tanh": "geglu", "gelu": "geglu_erf"}  # the torchfuser.ops names
_GATED_ACTS = {"silu": F.swiglu, "gelu_tanh": F.geglu, "gelu": functools.partial(F.geglu, approximate="none")}


class FusedGatedMLP(_WithLoRA, FusedModule):
    _projections = ("gate", "up", "gate_up", "down")

    def __init__(self, original: nn.Module, spec: GatedMLPSpec, backend: str = "auto"):
        super().__init__(spec, backend)
        names = (spec.gate, spec.up, spec.gate_up, spec.down, keep_dropout(self, original, spec.dropout),
                 keep_dropout(self, original, spec.inner_dropout)) + spec.keep
        adopt(self, original, [n for n in names if n is not None])
        self._act = _GATED_ACTS[spec.activation]

    def forward(self, x: Tensor) -> Tensor:
        if not torch.is_grad_enabled() and (o := decode.original(self, x)) is not None:  # a decode step: unfused
            return o(x)
        s = self.spec
        h, make = self._gated(x)
        with self._h_made_again(h, make):
            h = apply_dropout(self, s.inner_dropout, h)  # the original's functional dropout, in its order
            return apply_dropout(self, s.dropout, single(h, getattr(self, s.down), self))

    def add_to(self, residual: Tensor, x: Tensor) -> Tensor:
        """``residual + self(x)``, the sum inside the down projection's GEMM where it can be
        (``projections.residual_linear``: under autocast, with an fp32 residual and no dropout on)."""
        s = self.spec
        h, make = self._gated(x)
        epilogue = (s.dropout is None or dropout_p(self, s.dropout) == 0) and self.__dict__.get("_fp8") is None
        if not torch.is_grad_enabled():  # nothing made again (host time: no context manager)
            out = residual_linear(residual, h, getattr(self, s.down)) if epilogue else None
            return out if out is not None else residual + apply_dropout(self, s.dropout, single(h, getattr(self, s.down), self))
        with self._h_made_again(h, make):
            h = apply_dropout(self, s.inner_dropout, h)
            out = residual_linear(residual, h, getattr(self, s.down)) if epilogue else None
            return out if out is not None else residual + apply_dropout(self, s.dropout, single(h, getattr(self, s.down), self))

    def _h_made_again(self, h: Tensor, make):
        """The down projection does not keep its input h: the backward makes it again (modules.recompute)."""
        if make is None or not torch.is_grad_enabled():  # (no_grad: nothing is saved, nothing to make again)
            return _NOTHING
        return recompute.made_again(h, make)

    def _gated(self, x: Tensor):
        """(h, a function that makes h again from tensors the activation keeps for its backward, or None)."""
        s, act, backend = self.spec, self._activate, self.backend
        if s.gate_up is not None:
            packed, gate_first = single(x, getattr(self, s.gate_up), self), s.gate_first
        else:  # gate and up as one GEMM under autocast; None where that would differ
            linears = [getattr(self, s.gate), getattr(self, s.up)]
            packed, gate_first = joint(x, linears, self), True
        if packed is None:
            gate, up = call_linear(linears[0], x), call_linear(linears[1], x)
            return act(gate, up, backend=backend), lambda: act(gate, up, backend=backend)
        if gate_first:  # one [gate | up] tensor: its gradient comes back whole, not concatenated
            h = self._packed_act(packed, x)
            return h, (lambda: act(packed, backend=backend)) if fp8.recipe_of(self) is None else None
        up, gate = packed.chunk(2, dim=-1)
        return act(gate, up, backend=backend), lambda: act(gate, up, backend=backend)

    def _activate(self, gate: Tensor, up: Tensor | None = None, backend: str | None = None) -> Tensor:
        """The activation (``functional.swiglu`` / ``geglu``: up=None for one [gate | up] tensor) with its checks
        and backend decided once per call signature (``base.decided``); ``backend`` is always this module's."""
        op = _GATED_OPS[self.spec.activation]
        key = (op, (type(gate), gate.dtype, gate.device, gate.shape),  # base.signature inline (host time)
               None if up is None else (type(up), up.dtype, up.device, up.shape), self.backend)
        backend = decided(self, key, lambda: F.backend_for(self.backend, F.check_gated(op, gate, up)))
        return getattr(ops, op)(gate, up, backend) if up is not None else getattr(ops, f"{op}_packed")(gate, backend)

    def _packed_act(self, packed: Tensor, x: Tensor) -> Tensor:
        """The activation on [gate | up]; with rowwise FP8, the producer of the down projection's operand
        (and, backward, of the gate/up projection's gradient), handing their maxima on (modules.fp8)."""
        s = self.spec
        # No FP8 producer kernel for erf GELU: its down projection quantises its own operand.
        # Nor with a dropout between it and the down projection: its operand is no longer h.
        if s.activation == "gelu" or s.inner_dropout is not None or not fp8.producer_maxima(self, packed, [getattr(self, s.down)]):
            return self._activate(packed)
        ups = [getattr(self, n) for n in (s.gate_up,) if n] or [getattr(self, s.gate), getattr(self, s.up)]
        grad_amax = x.requires_grad and fp8.producer_maxima(self, packed, ups)
        name = "swiglu" if s.activation == "silu" else "geglu"
        return gated_ops.packed_fp8_producer(name, packed, backend_for(self.backend, packed.device), grad_amax)


class FusedMLP(_WithLoRA, FusedModule):
    _projections = ("fc_in", "fc_out")

    def __init__(self, original: nn.Module, spec: MLPSpec, backend: str = "auto"):
        super().__init__(spec, backend)
        names = (spec.fc_in, spec.fc_out, keep_dropout(self, original, spec.dropout),
                 keep_dropout(self, original, spec.inner_dropout)) + spec.keep
        adopt(self, original, [n for n in names if n is not None])

    def forward(self, x: Tensor, *args, **kwargs) -> Tensor:
        if not torch.is_grad_enabled() and (o := decode.original(self, x)) is not None:  # a decode step: unfused
            return o(x, *args, **kwargs)
        s = self.spec
        h = self._hidden(x)
        if s.residual is None:
            if args or kwargs:
                raise TypeError(f"FusedMLP takes the hidden states alone, got {len(args) + len(kwargs)} more arguments")
            return apply_dropout(self, s.dropout, single(h, getattr(self, s.fc_out), self))
        residual = args[0] if args else kwargs.get(s.residual)
        if residual is None or len(args) + len(kwargs) != 1:
            raise TypeError(f"FusedMLP takes the hidden states and {s.residual!r}, as the original MLP does")
        return self._plus(residual, h, first=False)

    def add_to(self, residual: Tensor, x: Tensor) -> Tensor:
        """``residual + self(x)`` for an MLP that takes no residual itself, the sum inside fc_out's GEMM where
        it can be (``projections.residual_linear``: under autocast, a bias-free ``nn.Linear``, no dropout on)."""
        return self._plus(residual, self._hidden(x))

    def _hidden(self, x: Tensor) -> Tensor:
        """fc_out's input: inner_dropout(act(fc_in(x)))."""
        s = self.spec
        h = single(x, getattr(self, s.fc_in), self)
        if s.activation == "gelu":
            h = F.gelu(h, s.approximate, backend=self.backend)
        else:
            h = F.activation(h, s.activation, backend=self.backend)
        return apply_dropout(self, s.inner_dropout, h)

    def _plus(self, residual: Tensor, h: Tensor, first: bool = True) -> Tensor:
        """residual + dropout(fc_out(h)) (``first=False``: that + residual, the original's order; the same sum)."""
        s = self.spec
        if dropout_p(self, s.dropout) == 0 and fp8.recipe_of(self) is None:
            out = residual_linear(residual, h, getattr(self, s.fc_out))
            if out is not None:
                return out
        out = apply_dropout(self, s.dropout, single(h, getattr(self, s.fc_out), self))
        return residual + out if first else out + residual
