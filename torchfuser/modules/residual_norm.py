"""A pre-norm decoder layer with its residual adds fused into its norms (RMSNorm or LayerNorm).

    x ─ norm_in ─ attention ─ (+ x) ─ s ─ norm_mid ─ MLP ─ (+ s) ─ out          (sequential)
    x ─ attention ─ (+ x) ─ norm_in ─ h ─ MLP ─ (+ h) ─ norm_mid ─ out          (``post_norm``: OPT-350m)
    x ─ attention ─ norm_in ─ (+ x) ─ h ─ MLP ─ norm_mid ─ (+ h) ─ out          (``post_block``: OLMo-2, ``_post_block``)
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

Dropouts between the blocks are applied where the original applies them, by the same call, so that from one
seed the masks are the original's (``attention_dropout``, ``mlp_dropout``, ``sum_dropout``); a residual scale
attribute is read at each call (``attention_scale``, ``mlp_scale``); blocks passed the residual (BLOOM, MPT)
get the norms' opening residuals (``residual_passed``).

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
``__call__``, around this forward: nothing to do there (``modules._layer_checkpointing``).
"""
from __future__ import annotations

import inspect
from dataclasses import dataclass
from functools import partial

import torch
from torch import nn

from torchfuser.modules import _post_block, decode, fallbacks, fp8, offload
from torchfuser.modules._layer_blocks import (adds as _adds, as_class as _as_class, attend as _attend, child as _child,
                                              is_identity as _is_identity, made_again as _made_again, maxima as _maxima,
                                              mlp_call as _mlp, projection_dtype as _projection_dtype, tail as _tail,
                                              unfused_norms as _unfused_norms)
from torchfuser.modules._layer_checkpointing import checkpoints as _checkpoints, without_cache as _without_cache
from torchfuser.modules.base import callee, follow_replicas, unfollow_replicas

_NO_MAXIMA = (False, False)
_MISSING = "a required argument is missing"
_NO_TAIL_INPUT = "no tensor given for its third block's argument (the original forward raises without one)"


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
    post_block: bool = False  # h = x + norm_in(attention(x)); out = h + norm_mid(mlp(h)) (OLMo-2; RMSNorms)
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
    # "attention" / "mlp": the block takes the residual as its second positional argument and adds it itself
    # (BLOOM's both, MPT's MLP); sequential layers only. Its sum's two gradients still meet in a norm's kernel.
    residual_passed: tuple[str, ...] = ()
    # The layer's dropout on the attention's / the MLP's output before its residual add (``dropout_attr``'s names),
    # applied here as the original applies it, from the same draws (``patterns._residual_dropout``).
    attention_dropout: str | None = None
    mlp_dropout: str | None = None
    sum_dropout: str | None = None  # parallel: on attention + MLP output, once (Falcon's dropout_add)
    mlp_inner_dropout: str | None = None  # an inline MLP's, on act(fc_in(·)) (BioGPT's activation_dropout)
    # A float attribute of the layer each block's output is multiplied by before its add (Granite's
    # residual_multiplier), read at each call as the original reads it.
    attention_scale: str | None = None
    mlp_scale: str | None = None
    mlp_tuple: bool = False  # the MLP returns a tuple whose first item the layer adds (GPT-OSS's MoE block)
    mlp2: str | None = None  # a second MLP block on the same input, summed with the first (Granite 4's shared MLP)
    mlp_view: bool = False  # that item viewed to the MLP input's shape (Llama 4's MoE block returns (tokens, hidden))
    # norm_in is an ``nn.Identity`` (ModernBERT-decoder's layer 0): the attention gets x itself; not post-norm
    norm_in_identity: bool = False
    # the attention is passed its input positionally this many times (CTRL's ``attn(normed, normed, normed)``: v, k, q)
    attention_repeats: int = 1
    # norms on the attention's / the MLP's output before its residual add (Gemma-2's sandwich; sequential only)
    post_attention_norm: str | None = None
    post_mlp_norm: str | None = None
    returns_none: bool = False  # it returns (hidden states, None) (Bamba's mamba layers)
    attention_single: bool = False  # it returns one tensor, not (output, weights): a linear-attention / recurrent mixer
    # a one-element buffer of the layer its output is multiplied by (Gemma 4's ``layer_scalar``), read at each call
    output_scale: str | None = None
    # (fc_in, act, fc_out, norm): a third block on the output so far, times the forward's argument ``tail_input``
    # (Gemma 4's per-layer inputs: ``out + norm(fc_out(act(fc_in(out)) * per_layer_input))``), run as the original runs it
    tail: tuple[str, ...] = ()
    tail_input: str = ""
    unpassed: tuple[str, ...] = ()  # its parameters the original hands no child (BART's use_cache): not passed on


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
        for name in s.unpassed:
            kwargs.pop(name, None)
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
        if not torch.is_grad_enabled():  # a decode step: the unfused layer (modules.decode)
            out = decode.layer_call(layer, args, kwargs, s.first)
            if out is not decode.NOT_DECODE:
                return out
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
        g = rest.pop(s.tail_input, None) if s.tail_input else None
        call = None if x is None else self._attention_kwargs(rest)
        why = self._unfused(args, x, call) or (_NO_TAIL_INPUT if s.tail and g is None else None)
        if why is not None:
            fallbacks.count(layer, why)
            return type(layer).forward(layer, *args, **kwargs)  # checkpointed there, when it checkpoints
        if checkpointing:  # x (and g) positional: reentrant checkpointing passes gradients only to those
            return layer._gradient_checkpointing_func(partial(self._fused, call), x, *(() if g is None else (g,)))
        if own is not None:  # optimize(checkpointing=...): the input kept (on the host), the rest made again
            return own.run(partial(self._fused, call, g=g), x)
        return self._fused(call, x, g)

    def _fused(self, call: dict, x: torch.Tensor, g: torch.Tensor | None = None) -> torch.Tensor:
        """The fused computation (run twice under checkpointing: ``call`` is not changed)."""
        layer, s = self.layer, self.spec
        norm_in, attention, mlp = _child(layer, s.norm_in), _child(layer, s.attention), _mlp(layer, s, self._drop)
        if s.post_norm:
            return self._post(call, x, norm_in, attention, mlp)
        if s.post_block:
            return _post_block.forward(self, call, x, attention, mlp)
        # (no autocast: no projection dtype; FP8 producers off: no maxima; no_grad: nothing made again. Each
        # asked without a call where it is off: host time of a decode step)
        low = _projection_dtype(x, attention, mlp) if not s.parallel and torch._C._is_any_autocast_enabled() else None
        if s.norm_in_identity:  # x's two gradients (attention, residual) summed by autograd, as unfused
            y, maxima = x, False
        else:
            maxima = fp8._SWITCHES.fp8_norm_producers and _maxima(attention, "in", x, low)
            y, x = norm_in.opening_residual(x, low, maxima)
        args = (y, x) if "attention" in s.residual_passed else (y,) * s.attention_repeats  # (BLOOM's: x + its output)
        if not torch.is_grad_enabled():  # nothing made again, and no nn.Module.__call__ where no hook would run
            a = _attend(callee(attention), args, s.attention_input, call)
        else:
            with _made_again(norm_in, y, x, maxima or s.parallel):  # (parallel: y feeds the MLP too)
                a = _attend(attention, args, s.attention_input, call)
        a0 = a if s.attention_single else a[0]
        if s.post_attention_norm is not None:
            a0 = _child(layer, s.post_attention_norm)(a0)
        out = self._body(x, y, self._scaled(s.attention_scale, self._drop(s.attention_dropout, a0)), low, attention, mlp)
        return self._output(_tail(layer, s.tail, out, g) if s.tail else out, a)

    def _post(self, call: dict, x, norm_in, attention, mlp):
        """Post-norm: each residual add inside the norm after it (``add_layer_norm``; its sum is not needed
        afterwards, so only the norm's gradient flows back through it)."""
        s = self.spec
        a = _attend(attention, (x,) * s.attention_repeats, s.attention_input, call)
        h = norm_in.add(x, self._drop(s.attention_dropout, a if s.attention_single else a[0]))[1]
        out = getattr(self.layer, s.norm_mid).add(h, self._drop(s.mlp_dropout, mlp(h)))[1]
        return self._output(out, a)

    def _output(self, out, a):
        """What the layer returns: its hidden states (times its output scale), with the attention's second output
        or None after them where the original returns those."""
        s = self.spec
        if s.output_scale is not None:  # as the original's ``out *= scale``: the product in the promoted dtype, then out's
            out = torch.mul(out, getattr(self.layer, s.output_scale)).to(out.dtype)
        return (out, a[1]) if s.returns_rest else (out, None) if s.returns_none else out

    def _body(self, x, y, a, low, attention, mlp):
        """The layer's output from its input x (as norm_in's opening residual gave it back), norm_in's
        output y and the attention's output a."""
        s = self.spec
        norm_mid = _child(self.layer, s.norm_mid)
        # then dropout(mlp(…)) · scale is added, not mlp(…) inside its GEMM
        dropping = self._on(s.mlp_dropout) or s.mlp_scale is not None or self._on(s.sum_dropout) or s.post_mlp_norm
        if s.parallel:  # x + a + mlp(…): with a gated MLP the last add inside its down projection's GEMM
            y = y if s.norm_mid == s.norm_in else norm_mid(x)
            if _adds(mlp) and not dropping:
                return mlp.add_to(x + a, y)
            m = self._scaled(s.mlp_scale, self._drop(s.mlp_dropout, mlp(y)))
            return x + self._drop(s.sum_dropout, a + m) if s.sum_dropout else x + a + m
        if "attention" in s.residual_passed:  # a is the sum already: h's two gradients summed in norm_mid's backward
            maxima = _NO_MAXIMA
            y, h = norm_mid.opening_residual(a, low)
        elif not fp8._SWITCHES.fp8_norm_producers:  # (no maxima asked for: host time of a decode step)
            maxima = _NO_MAXIMA
            h, y = norm_mid.add(x, a, low, maxima)
        else:
            # (not the attention output's gradient maxima under its dropout or scale: that gradient is not its output's)
            plain = not self._on(s.attention_dropout) and s.attention_scale is None and s.post_attention_norm is None
            out_maxima = a.requires_grad and plain and _maxima(attention, "out", a, None)
            maxima = (not (s.mlp_inline or s.mlp_tuple) and _maxima(mlp, "in", x, low), out_maxima)
            h, y = norm_mid.add(x, a, low, maxima)
        with _made_again(norm_mid, y, h, any(maxima)):
            if "mlp" in s.residual_passed:  # it adds h itself (BLOOM, MPT)
                return mlp(y, h)
            if _adds(mlp) and not dropping:
                return mlp.add_to(h, y)
            m = mlp(y) if s.post_mlp_norm is None else _child(self.layer, s.post_mlp_norm)(mlp(y))
            return h + self._scaled(s.mlp_scale, self._drop(s.mlp_dropout, m))

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
        if s.post_block:
            why = _post_block.unfused(layer, s)
        elif s.norm_in_identity:
            first = _child(layer, s.norm_in)
            if not (_is_identity(first) and _as_class(first)):
                return "its first norm is no longer a plain nn.Identity (replaced, or hooked)"
            why = _unfused_norms(_child(layer, s.norm_mid))
        else:
            why = _unfused_norms(_child(layer, s.norm_in), _child(layer, s.norm_mid))
        if why:
            return why
        return ("a dropout between the blocks is on, at a place the fused forward does not apply it"
                if self._dropping() else None)

    def _on(self, name: str | None) -> bool:
        """Whether the placed dropout ``name`` drops now (training, p > 0)."""
        return name is not None and self.layer.training and float(dropout_attr(self.layer, name)) > 0

    def _drop(self, name: str | None, t: torch.Tensor) -> torch.Tensor:
        """The layer's dropout ``name`` on t as the original applies it: its nn.Dropout child called, or the
        functional dropout with the p it reads (an attribute, or its config's field) and the layer's mode."""
        if name is None:
            return t
        layer = self.layer
        child = None if name.startswith("config.") else getattr(layer, name)
        if isinstance(child, nn.Module):
            return child(t)
        return nn.functional.dropout(t, float(dropout_attr(layer, name)), layer.training)

    def _scaled(self, name: str | None, t: torch.Tensor) -> torch.Tensor:
        """t times the layer's residual scale attribute ``name`` (as the original multiplies it), or t."""
        return t if name is None else t * getattr(self.layer, name)

    def _dropping(self) -> bool:
        """Whether a dropout between the blocks that the fused forward does not apply (no place found) is on now."""
        layer, s = self.layer, self.spec
        if not layer.training or not (s.dropouts or s.float_dropouts):  # (no generator where none: host time)
            return False
        return any(float(dropout_attr(layer, n)) > 0 for n in (*s.dropouts, *s.float_dropouts))

    def rebind(self, replica: nn.Module) -> None:
        """An nn.DataParallel replica gets a forward of its own (it holds the replica's parameters)."""
        replica.__dict__["forward"] = ResidualNormForward(replica, self.spec)


def dropout_attr(layer: nn.Module, name: str):
    """A dropout's probability: ``name`` an nn.Dropout child, a float attribute, or ``config.<field>``."""
    owner = layer.config if name.startswith("config.") else layer
    value = getattr(owner, name.removeprefix("config."))
    return value.p if isinstance(value, nn.Module) else value


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
        decode.clear(self.layer)
        unfollow_replicas(self.layer)
