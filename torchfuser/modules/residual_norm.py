"""A pre-norm decoder layer with its residual adds fused into its norms (RMSNorm or LayerNorm).

    x ─ norm_in ─ attention ─ (+ x) ─ s ─ norm_mid ─ MLP ─ (+ s) ─ out          (sequential)
    x ─ attention ─ (+ x) ─ norm_in ─ h ─ MLP ─ (+ h) ─ norm_mid ─ out          (``post_norm``: OPT-350m)
    out = x + attention(norm_in(x)) + MLP(norm_mid(x))                         (``parallel``: GPT-NeoX,
          with norm_mid = norm_in where one norm feeds both (GPT-J, Phi, Cohere))

``s = x + attention(…)`` and ``norm_mid(s)`` run as one kernel forward and one backward
(``add_rms_norm``; the backward sums s's gradients from the MLP branch and from ``out`` inside
the norm's kernel), and x's gradients from norm_in and from the residual are summed inside
norm_in's backward kernel (``rms_norm_opening_residual``). Unfused, each of those is an add
kernel of its own over the fp32 residual stream, and the backward's cast of s's gradient for the
bf16 attention output one more. The last add, ``s + MLP(…)``, happens inside the MLP's down
projection GEMM under autocast (``FusedGatedMLP.add_to``). Under autocast the norms write bf16
where the blocks after them only project it (``_projection_dtype``). With rowwise FP8 on the blocks
the norms can be the producers of three FP8 GEMM operands (``_maxima``; off by default, measured slower:
the switch ``fp8_norm_producers``, ``torchfuser.switches``): norm_in's output (the q/k/v projections'
input), norm_mid's (the gate/up projections'), and the gradient norm_mid's backward hands the
attention's output (the output projection's dy) carry their maxima to the GEMMs.
The norms' outputs are not kept by the projections after them: the backward makes them again from what the
norms keep (``FusedRMSNorm.made_again``, ``modules.recompute``).

The layer keeps its class, children and parameters: only its ``forward`` is replaced, on the
instance, by a ``ResidualNormForward``. That calls the children with the arguments the original
forward passes them (the pattern's probe found which, ``ResidualNormSpec``), and hands anything
else to the original forward: extra positional arguments, norms that are not fused RMSNorms or
have hooks or a forward of their own (the fused path calls their kernels, not the modules; the
MLP is then called as itself too), and code that torch.compile
traces (Inductor fuses the adds into its own norm kernels there). Each such call but the traced
ones is counted with its reason (``modules.fallbacks``), and the report lists them.

Gradient checkpointing: transformers 5.25 checkpoints a ``GradientCheckpointingLayer`` in a wrapper
around its class's ``forward``, which a forward on the instance bypasses; so this forward checkpoints
its fused computation itself, under the same conditions and through the same function
(``layer._gradient_checkpointing_func``, set by ``gradient_checkpointing_enable``), and once: a fallback
goes through the class's wrapper, which checkpoints it. transformers 5.17 checkpoints in the layer's
``__call__``, around this forward: nothing to do there (``_checkpoints``).
"""
from __future__ import annotations

import contextlib
import inspect
import logging
from dataclasses import dataclass
from functools import partial

import torch
from torch import nn

from torchfuser.modules import fallbacks, fp8, offload
from torchfuser.modules.attention import FusedAttention
from torchfuser.modules.base import callee, follow_replicas, hooked, unfollow_replicas
from torchfuser.modules.mlp import FusedGatedMLP, FusedMLP
from torchfuser.modules.norms import FusedLayerNorm, FusedRMSNorm
from torchfuser.ops._call import autocast_enabled

_log = logging.getLogger(__name__)
_NOTHING = contextlib.nullcontext()  # reusable
_NO_MAXIMA = (False, False)
# Keywords a layer's KV cache goes by (transformers versions and families): a checkpointed layer must not
# get one, or its recompute in the backward would write the cache a second time.
_CACHE_KWARGS = ("cache", "past_key_values", "past_key_value", "layer_past")
_MISSING = "a required argument is missing"
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


def _checkpoints(layer: nn.Module) -> bool:
    """Whether transformers' wrapper of the layer class's ``forward`` would checkpoint this call: the
    wrapper's own conditions (gradient checkpointing on, training, grad enabled)."""
    return (_CHECKPOINTED_CLASS is not None and isinstance(layer, _CHECKPOINTED_CLASS)
            and bool(layer.gradient_checkpointing) and layer.training and torch.is_grad_enabled())


def _without_cache(layer: nn.Module, kwargs: dict) -> dict:
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


@dataclass(frozen=True)
class ResidualNormSpec:
    """How the original forward calls its children.

    ``first``: the name of its hidden-states parameter. ``attention_input``: the keyword under which
    it passes norm_in's output to the attention. ``arguments``: (its parameter, the attention's
    keyword, the parameter's default) for every parameter it passes on. ``renames``: (a keyword its
    decorators accept in place of a parameter, the attention's keyword it ends up as).
    ``passes_extra``: whether it passes unknown keywords on to the attention unchanged (``**kwargs``).
    ``dropouts`` / ``float_dropouts``: the layer's dropouts, when one sits between the blocks: the
    fused forward runs only while all are off (eval mode, or p = 0), the original one otherwise.
    """

    first: str
    attention_input: str
    arguments: tuple[tuple[str, str, object], ...]
    renames: tuple[tuple[str, str], ...] = ()
    passes_extra: bool = True
    dropouts: tuple[str, ...] = ()  # nn.Dropout children between the blocks: fused only while off
    float_dropouts: tuple[str, ...] = ()  # the same as float attributes read by functional dropouts
    attention: str = "self_attn"
    mlp: str = "mlp"
    norm_in: str = "input_layernorm"
    norm_mid: str = "post_attention_layernorm"  # = norm_in: one norm feeds both blocks (parallel only)
    parallel: bool = False  # out = x + attention(norm_in(x)) + mlp(norm_mid(x))
    post_norm: bool = False  # h = norm_in(x + attention(x)); out = norm_mid(h + mlp(h)) (OPT-350m)
    # Parameters the original forward does not hand to the attention and that must be at their default
    # (None) for the fused path (GPT-2's encoder_hidden_states); any other value runs the original forward.
    at_default: tuple[str, ...] = ()
    positional: tuple[str, ...] = ()  # the forward's parameters after the hidden states that may come positionally
    drops_extra: bool = False  # it takes **kwargs and hands them to no child (StableLM): ignored here too
    # It returns (hidden states, the attention's second output) (Falcon; GPT-J in transformers 5.17).
    # An argument whose default is ``inspect.Parameter.empty`` is required (Falcon's attention_mask, 5.17's alibi).
    returns_rest: bool = False
    # (fc_in, activation, fc_out): the layer's own children computing its MLP (OPT), with ``mlp`` = ""
    mlp_inline: tuple[str, ...] = ()


class ResidualNormForward:
    """``layer.forward`` of a fused layer: the original forward's computation with the residual adds
    inside the norms. An object, not a closure, so that a model saved whole keeps it."""

    def __init__(self, layer: nn.Module, spec: ResidualNormSpec):
        self.layer, self.spec = layer, spec

    def _attention_kwargs(self, kwargs: dict) -> dict | str | None:
        """The keywords the original forward would pass to the attention, or None if unsure (``_MISSING``
        without a required argument)."""
        s = self.spec
        # Loops, not generators: every call of the layer runs this (host time of a decode step).
        for name in s.at_default:
            if kwargs.pop(name, None) is not None:
                return None
        call = {}
        for name, key, default in s.arguments:
            value = call[key] = kwargs.pop(name, default)
            if value is inspect.Parameter.empty:
                return _MISSING  # the original forward raises as it would have
        for old, key in s.renames:
            if old in kwargs:
                call[key] = kwargs.pop(old)
        if kwargs and s.drops_extra:
            kwargs = {}
        if kwargs and not s.passes_extra:
            return None
        call.update(kwargs)
        return call

    def __call__(self, *args, **kwargs):
        layer, s = self.layer, self.spec
        own = layer.__dict__.get(offload.KEY)  # (offload.of inline: host time, as below)
        if torch.compiler.is_compiling():  # Inductor fuses the adds into its own norm kernels
            if own is not None and own.applies(layer):  # checkpointed as asked: run eagerly, a graph break
                return offload.eager(self, args, kwargs)  # type: ignore[misc]
            return type(layer).forward(layer, *args, **kwargs)
        if len(args) > 1 and len(args) - 1 <= len(s.positional) and not any(n in kwargs for n in s.positional[:len(args) - 1]):
            # as keywords, the names its forward gives them (GPT2Model passes cache, mask, encoder states so)
            kwargs, args = {**kwargs, **dict(zip(s.positional, args[1:]))}, args[:1]
        checkpointing = torch.is_grad_enabled() and _checkpoints(layer)  # (no_grad, decode: no call)
        own = own if own is not None and own.applies(layer) else None  # HF's checkpointing wins where it is on
        if checkpointing or own is not None:
            kwargs = _without_cache(layer, kwargs)
        rest = dict(kwargs)
        x = args[0] if len(args) == 1 else None if args else rest.pop(s.first, None)
        call = None if x is None else self._attention_kwargs(rest)
        why = self._unfused(args, x, call)
        if why is not None:
            fallbacks.count(layer, why)
            return type(layer).forward(layer, *args, **kwargs)  # checkpointed there, when it checkpoints
        if checkpointing:  # x positional: reentrant checkpointing passes gradients only to those
            return layer._gradient_checkpointing_func(partial(self._fused, call), x)
        if own is not None:  # optimize(checkpointing=...): the input kept (on the host), the rest made again
            return own.run(partial(self._fused, call), x)
        return self._fused(call, x)

    def _fused(self, call: dict, x: torch.Tensor) -> torch.Tensor:
        """The fused computation (run twice under checkpointing: ``call`` is not changed)."""
        layer, s = self.layer, self.spec
        norm_in, attention, mlp = _child(layer, s.norm_in), _child(layer, s.attention), _mlp(layer, s)
        if s.post_norm:
            return self._post(call, x, norm_in, attention, mlp)
        # (no autocast: no projection dtype; FP8 producers off: no maxima; no_grad: nothing made again. Each
        # asked without a call where it is off: host time of a decode step)
        low = _projection_dtype(x, attention, mlp) if not s.parallel and torch._C._is_any_autocast_enabled() else None
        maxima = fp8._SWITCHES.fp8_norm_producers and _maxima(attention, "in", x, low)
        y, x = norm_in.opening_residual(x, low, maxima)
        if not torch.is_grad_enabled():
            run = callee(attention)
            a = run(y, **call) if not s.attention_input else run(**{s.attention_input: y}, **call)
        else:
            with _made_again(norm_in, y, x, maxima or s.parallel):  # (parallel: y feeds the MLP too)
                a = attention(y, **call) if not s.attention_input else attention(**{s.attention_input: y}, **call)
        out = self._body(x, y, a[0], low, attention, mlp)
        return (out, a[1]) if s.returns_rest else out

    def _post(self, call: dict, x, norm_in, attention, mlp):
        """Post-norm: each residual add inside the norm after it (``add_layer_norm``; its sum is not needed
        afterwards, so only the norm's gradient flows back through it)."""
        s = self.spec
        a = attention(x, **call) if not s.attention_input else attention(**{s.attention_input: x}, **call)
        h = norm_in.add(x, a[0])[1]
        out = getattr(self.layer, s.norm_mid).add(h, mlp(h))[1]
        return (out, a[1]) if s.returns_rest else out

    def _body(self, x, y, a, low, attention, mlp):
        """The layer's output from its input x (as norm_in's opening residual gave it back), norm_in's
        output y and the attention's output a."""
        s = self.spec
        norm_mid = _child(self.layer, s.norm_mid)
        if s.parallel:  # x + a + mlp(…): with a gated MLP the last add inside its down projection's GEMM
            y = y if s.norm_mid == s.norm_in else norm_mid(x)
            if isinstance(mlp, FusedGatedMLP) and _as_class(mlp):
                return mlp.add_to(x + a, y)
            return x + a + mlp(y)
        maxima = (not s.mlp_inline and _maxima(mlp, "in", x, low), a.requires_grad and _maxima(attention, "out", a, None)
                  ) if fp8._SWITCHES.fp8_norm_producers else _NO_MAXIMA
        h, y = norm_mid.add(x, a, low, maxima)
        if not torch.is_grad_enabled():
            return mlp.add_to(h, y) if isinstance(mlp, FusedGatedMLP) and _as_class(mlp) else h + mlp(y)
        with _made_again(norm_mid, y, h, any(maxima)):
            return mlp.add_to(h, y) if isinstance(mlp, FusedGatedMLP) and _as_class(mlp) else h + mlp(y)

    def _unfused(self, args, x, call) -> str | None:
        """Why this call runs the original forward, or None."""
        if len(args) > 1:
            return "positional arguments after the hidden states"
        if x is None:
            return "called without hidden states"
        if call is _MISSING:
            return _MISSING
        if call is None:
            return "keywords its forward does not pass on to the attention"
        layer, s = self.layer, self.spec
        if why := _unfused_norms(_child(layer, s.norm_in), _child(layer, s.norm_mid)):
            return why
        return "a dropout between the blocks is on (the fused forward has none)" if self._dropping() else None

    def _dropping(self) -> bool:
        """Whether a dropout between the blocks is on now (the fused forward has none)."""
        layer, s = self.layer, self.spec
        if not layer.training or not (s.dropouts or s.float_dropouts):  # (no generator where none: host time)
            return False
        return any(float(dropout_attr(layer, n)) > 0 for n in (*s.dropouts, *s.float_dropouts))

    def rebind(self, replica: nn.Module) -> None:
        """An nn.DataParallel replica gets a forward of its own (it holds the replica's parameters)."""
        replica.__dict__["forward"] = ResidualNormForward(replica, self.spec)


def _made_again(norm: nn.Module, y: torch.Tensor, src: torch.Tensor, maxima: bool):
    """The block after an RMSNorm does not keep the norm's output y: the backward makes it again from src
    (``FusedRMSNorm.made_again``); not with FP8 maxima (another kernel), nor for LayerNorms."""
    if maxima or not torch.is_grad_enabled() or not isinstance(norm, FusedRMSNorm) or not y.numel():
        return _NOTHING  # (no_grad: nothing is saved for a backward, so nothing to make again)
    return norm.made_again(y, src)


def _child(layer: nn.Module, name: str):
    """``getattr(layer, name)`` for a submodule, read from ``_modules`` without nn.Module's ``__getattr__`` frame."""
    child = layer._modules.get(name)
    return child if child is not None else getattr(layer, name)


def _mlp(layer: nn.Module, s: ResidualNormSpec):
    """The layer's MLP block, or for an inline one (OPT) a function computing fc_out(act(fc_in(·)))."""
    if not s.mlp_inline:
        return _child(layer, s.mlp)
    fc_in, act, fc_out = (getattr(layer, n) for n in s.mlp_inline)
    return lambda y: fc_out(act(fc_in(y)))


def dropout_attr(layer: nn.Module, name: str):
    """A dropout's probability: ``name`` an nn.Dropout child, a float attribute, or ``config.<field>``."""
    owner = layer.config if name.startswith("config.") else layer
    value = getattr(owner, name.removeprefix("config."))
    return value.p if isinstance(value, nn.Module) else value


def _unfused_norms(*norms: nn.Module) -> str | None:
    """Why the fused path cannot use these norms' kernels in place of calling them, or None."""
    for n in norms:  # (a loop, not a generator: host time)
        if not isinstance(n, (FusedRMSNorm, FusedLayerNorm)):
            return "its norms are no longer fused RMSNorms or LayerNorms"
    if not _as_class(*norms):
        return "hooks (or a forward of their own) on its norms: the fused path would skip them"
    return None


def _as_class(*modules: nn.Module) -> bool:
    """Whether calling these modules would run just their class's forward (no hooks, no forward
    replaced on the instance), so that this forward may call their methods instead."""
    if hooked(*modules):
        return False
    for m in modules:  # (a loop, not a generator: host time)
        if "forward" in m.__dict__:
            return False
    return True


def _projection_dtype(x, attention: nn.Module, mlp: nn.Module) -> torch.dtype | None:
    """Under autocast, the dtype the norms may write their outputs in: the autocast dtype when both
    blocks first project their input with plain ``nn.Linear``s, which would cast it to that dtype
    anyway (the same values; the norm writes half the bytes, the cast kernel goes, and the backward
    reads a bf16 dy, as autocast's own cast gives). Else None: the norms' own dtype."""
    device = x.device.type
    if not autocast_enabled(device) or x.dtype != torch.float32:
        return None
    if not (isinstance(attention, FusedAttention) and isinstance(mlp, FusedGatedMLP)):
        return None
    inputs = [(attention, n) for n in attention.spec.qkv]
    inputs += [(mlp, n) for n in (mlp.spec.gate, mlp.spec.up, mlp.spec.gate_up) if n is not None]
    linears = [getattr(block, name) for block, name in inputs]
    if all(type(m) is nn.Linear for m in linears) and not hooked(*linears):
        return torch.get_autocast_dtype(device)
    return None


def _projections(block: nn.Module, which: str) -> list[nn.Module]:
    """A fused block's projections of its input (``which="in"``) or, attention's, of its output (``"out"``)."""
    if isinstance(block, FusedAttention):
        names = block.spec.qkv if which == "in" else (block.spec.out,)
    elif isinstance(block, FusedGatedMLP) and which == "in":
        names = (block.spec.gate, block.spec.up, block.spec.gate_up)
    elif isinstance(block, FusedMLP) and which == "in":
        names = (block.spec.fc_in,)
    else:
        names = ()
    return [getattr(block, n) for n in names if n is not None]


def _maxima(block: nn.Module, which: str, t: torch.Tensor, dtype: torch.dtype | None) -> bool:
    """Whether a norm's output (``which="in"``: in ``dtype``, None for t's) or the gradient the middle
    norm's backward hands the attention's output t (``"out"``) should carry its FP8 maxima to ``block``'s
    projections that take it (``modules.fp8.producer_maxima``: the kernels are the layer's norms, the
    recipe the block's)."""
    if not fp8._SWITCHES.fp8_norm_producers or fp8.recipe_of(block) is None:
        return False
    linears = _projections(block, which)
    return bool(linears) and fp8.producer_maxima(block, t, linears, dtype)


def install(layer: nn.Module, spec: ResidualNormSpec) -> None:
    fused = ResidualNormForward(layer, spec)
    layer.__dict__["forward"] = fused
    follow_replicas(layer, fused.rebind)


@dataclass
class Uninstall:
    """Undo of ``install``: the class's forward again. An object, so that a saved model keeps it."""

    layer: nn.Module

    def __call__(self) -> None:
        if isinstance(self.layer.__dict__.get("forward"), ResidualNormForward):
            del self.layer.__dict__["forward"]
        self.layer.__dict__.pop(offload.KEY, None)
        fallbacks.clear(self.layer)
        unfollow_replicas(self.layer)
