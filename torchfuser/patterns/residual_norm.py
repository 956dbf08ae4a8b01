"""Pre-norm decoder layers whose residual adds can go into their norms (RMSNorm or LayerNorm).

A candidate has an attention (a block with projections that takes an attention mask), an MLP (any
other block with parameters) and one or two norm children, under any names. Its forward is probed
with stand-ins for them: simple random maps that record how they are called. The layer qualifies
when its output is exactly one of

    s = x + attention(norm_in(x))[0];   out = s + mlp(norm_mid(s))        (sequential: Llama, GPT-2)
    out = x + attention(norm_in(x))[0] + mlp(norm_mid(x))                 (parallel: GPT-NeoX)
    out = x + attention(norm(x))[0] + mlp(norm(x))                        (parallel, one norm: GPT-J, Phi)
    h = norm_in(x + attention(x)[0]);   out = norm_mid(h + mlp(h))        (post-norm: OPT-350m)

(in training mode, every dropout of the layer at p = 0.5, so that one between the blocks shows; if
one does, the layer still qualifies when the formula holds with them at 0: where each dropout acts on a
block's output (or a parallel layer's sum) in the original's order of draws, the fused forward applies it
there (``_residual_dropout``), else it runs only while they are off: ``ResidualNormSpec.dropouts``).
Variants (``_residual_forms``): blocks passed the residual that add it themselves (BLOOM, MPT), each block's
output times a float attribute of the layer (Granite, MiniCPM3: ``_residual_scale``), an MLP returning a
tuple (GPT-OSS), an attention returning three items (JetMoE). The layer qualifies when the attention receives
norm_in's output (by keyword, or as its one positional argument) and each of the forward's other
arguments unchanged, which the probe tells apart with a marker object per argument. An argument
whose marker makes the forward raise (GPT-2's encoder_hidden_states) must stay at its default for
the fused path (``at_default``). What the probe learns is the ``ResidualNormSpec``. Also: an output
times a one-element buffer (Gemma 4's ``layer_scalar``: ``_residual_output_scale``), a third block after the
others (Gemma 4's per-layer inputs: ``_residual_tail``), a cross-attention pair left to the original (BART's
decoder layers: ``_residual_roles.cross_pairs``), BERT's post-norm output sublayers (``residual_norm_output``);
RMSNorms after the blocks before their adds (OLMo-2's post-block norms: h = x + norm_in(attention(x)), then
h + norm_mid(mlp(h))), each norm and its add one kernel (``modules._post_block``).
"""
from __future__ import annotations

import inspect
import itertools
import warnings

import torch
from torch import nn

from torchfuser.modules import _layer_blocks, residual_norm, residual_output
from torchfuser.modules.norms import FusedLayerNorm, FusedRMSNorm
from torchfuser.modules.residual_norm import ResidualNormSpec
from torchfuser.modules.residual_output import ResidualOutputSpec
from torchfuser.patterns import _residual_forms, _residual_output_scale, _residual_tail, residual_norm_output
from torchfuser.patterns._residual_probe import (_EXTRA, _Marker, _Probe, _reshapes_attention_input, _run_markers, _saw_input,
                                                 sandwich_roles, tail_argument)
from torchfuser.patterns._residual_roles import (attention_like, block, cross_pairs, identities, inline_mlp, mlp_first, norm_kind,
                                                 signature, study_crosses)
from torchfuser.patterns.base import Applied, Pattern, Skip

_ROLES = ("attention", "mlp", "norm_in", "norm_mid")
_UNUSED = ("unused_attention", "unused_norm")  # (_residual_probe's stand-ins for them raise)
# Keywords transformers' decorators have accepted in place of a layer's cache argument.
_CACHE_ALIASES = ("past_key_values", "past_key_value", "cache", "layer_past")


def _first_runs(probe: _Probe, params, extra: bool):
    """(output, calls, markers, arguments left at their default, dropouts between the blocks, whether the layer
    returns the attention's second output) from the probe's first runs."""
    try:
        out, calls, markers, defaulted = _run_markers(probe, params, extra)
    except ValueError as err:  # "not enough values to unpack (expected 3, got 2)": JetMoE's attention's three
        if "expected 3" not in str(err) or not probe.attention_tuple:
            raise
        probe.attention_outputs = 3
        out, calls, markers, defaulted = _run_markers(probe, params, extra)
    dropouts = ()
    body = probe.split(out)[0]
    if isinstance(body, torch.Tensor) and probe.kind(body) is None:
        # Maybe a dropout between the blocks (Phi-3's resid_*_dropout): the fused forward serves
        # the calls where every dropout of the layer is off, and only if the forward is exact then.
        children, floats = probe.dropouts()
        dropouts = (tuple(children), tuple(floats))
        out, calls = probe.run(0.0, **markers)
    return (*probe.split(out)[:1], calls, markers, defaulted, dropouts, probe.split(out)[1])


def _study_roles(module: nn.Module, roles: dict[str, str], first: str, params, extra: bool):
    """The ResidualNormSpec the probe finds with these children in these roles, or a Skip."""
    probe = _Probe(module, roles)
    if "tail_in" in roles:  # the third block's argument gets a tensor, not a marker
        probe.tail_arg = _residual_tail.argument(probe, params)
        if probe.tail_arg is None:
            return None
        params = [p for p in params if p[0] != probe.tail_arg]
    try:
        out, calls, markers, defaulted, dropouts, returns_rest = _first_runs(probe, params, extra)
    except Exception as err:
        if not _saw_input(probe, probe.last_calls):
            return None
        first_line = str(err).splitlines()[0] if str(err) else ""
        # Its attention-like block's output used as one tensor (a linear-attention or recurrent mixer: Qwen3-Next's,
        # Jamba's, Bamba's), not as transformers' (output, weights) pair: ``ResidualNormSpec.attention_single``.
        # Or the first item of a tuple its MLP returns taken (Llama 4's MoE layers: ``hidden_states, _ = …``).
        for single, mlp_tuple in ((True, False), (False, True)):
            probe.attention_tuple, probe.attention_outputs, probe.mlp_tuple = not single, 2, mlp_tuple
            try:
                out, calls, markers, defaulted, dropouts, returns_rest = _first_runs(probe, params, extra)
                break
            except Exception:
                continue
        else:
            return Skip(f"its forward does not use its children as a pre-norm layer's attention, MLP and norms (run "
                        f"on stand-ins for them it raised {type(err).__name__}: {first_line})")
    calls = {r: c for r, c in calls.items() if r not in _UNUSED}  # (none: their stand-ins raise)
    order = [stand.role for stand in probe.last_order]  # the blocks' calls, in order
    returns_none = isinstance(out, tuple) and len(out) == 2 and out[1] is None and not returns_rest  # Bamba's mamba layers
    out = out[0] if returns_none else out
    kind = probe.kind(out)
    if not _saw_input(probe, calls) and kind not in ("post", "post_block"):
        return None  # no norm sees the layer's input, and it is not a post-norm form
    scaled = _residual_forms.scaled_kind(probe, markers, out, kind)
    if scaled is not None:
        kind, scaled = scaled
    if kind is None and "act" not in roles and (retried := _residual_forms.mlp_tuple_kind(probe, markers)) is not None:
        kind, out, calls = retried
    passes = {r: _residual_forms.passes_residual(probe, calls, r) for r in ("attention", "mlp")}
    if kind == "post_block" and (why := _residual_forms.post_block_limits(probe, markers, dropouts, scaled, passes)):
        return Skip(why)
    if any(passes.values()) and kind != "sequential":
        return Skip(_residual_forms.passed_residual_reason(probe, calls))
    if kind is None and isinstance(out, tuple):
        return Skip("its forward returns a tuple other than the hidden states alone or followed by the attention's "
                    "second output (GPT-Neo's (hidden states, cache, weights)), which the fused forward does not build")
    if kind is None:
        return Skip("its forward is not the pre-norm x + attention(norm(x)), then + mlp(norm(·)), nor their parallel "
                    "sum: something sits between the blocks (a residual scale not held in one float attribute of the "
                    "layer, a post-norm, a gate)")
    if any(len(c) != 1 for c in calls.values()):
        return Skip("its forward calls a child more than once")
    if kind == "parallel" and mlp_first(probe):
        return Skip("its forward calls the MLP before the attention, and the fused forward calls the attention "
                    "first: their random draws in training (dropout) would come in another order")
    if any(len(calls[r][0][0]) != 1 + passes.get(r, False) or calls[r][0][1] for r in calls if r != "attention"):
        return Skip("its forward passes its MLP or norms more than their input")
    (pos, kw) = calls["attention"][0]
    pos = pos[:1] if passes["attention"] else pos
    inputs = [k for k, v in kw.items() if isinstance(v, torch.Tensor)]
    repeats = len(pos) if pos and all(p is pos[0] for p in pos) else 1  # CTRL's attn(normed, normed, normed)
    if pos and (len(pos) != repeats or inputs or not isinstance(pos[0], torch.Tensor)):
        return Skip("its forward passes the attention positional arguments besides its input (other than the input "
                    "itself again, as CTRL's attn(v, k, q) takes it)")
    if not pos and len(inputs) != 1:
        return Skip("its forward does not pass the attention its input")
    attention_input = inputs[0] if not pos else ""
    if _reshapes_attention_input(probe, markers):
        return Skip("its forward reshapes the norm's output before the attention (a squeeze or a view: MiniMax-M3-VL's "
                    "vision layers squeeze a batch of one), and the fused forward passes it on as it is")
    by_marker = {id(v): k for k, v in kw.items() if isinstance(v, _Marker)}
    if len(by_marker) + len(inputs) != len(kw) or (extra and kw.get(_EXTRA) not in (None, markers[_EXTRA])):
        return Skip("its forward passes the attention arguments of its own making")
    drops_extra = extra and _EXTRA not in kw  # takes **kwargs and ignores them (StableLM)
    arguments = tuple((n, by_marker[id(markers[n])], d) for n, d in params if n in markers and id(markers[n]) in by_marker)
    # its parameters it hands no child, the output the formula with their markers: not passed on (BART's use_cache)
    unpassed = tuple(n for n, _ in params if n in markers and id(markers[n]) not in by_marker)
    renames = []
    for alias in (a for a in _CACHE_ALIASES if a not in markers and a not in defaulted):
        try:
            with warnings.catch_warnings():  # "`past_key_values` is deprecated…"
                warnings.simplefilter("ignore")
                _, calls = probe.run(**{alias: _Marker(alias)})
        except Exception:
            continue
        kw = calls["attention"][0][1]
        landed = [k for k, v in kw.items() if isinstance(v, _Marker)]
        if landed and landed != [alias]:
            renames.append((alias, landed[0]))
    sig = list(inspect.signature(type(module).forward).parameters.values())[2:]
    positional = tuple(p.name for p in itertools.takewhile(lambda p: p.kind is p.POSITIONAL_OR_KEYWORD, sig))
    mlp_view = probe.mlp_tuple and _residual_forms.mlp_flat_view(probe, markers, kind)
    placed = _residual_forms.dropout_places(probe, kind, dropouts, passes, markers)
    if placed:  # applied where the original applies them, from the same draws: none left to keep off
        dropouts = ((), ())
    if "mlp2" in roles and (kind != "sequential" or any(dropouts) or any(passes.values())
                            or probe.mlp_tuple or not {"mlp", "mlp2"} <= set(order) or order.index("mlp") > order.index("mlp2")):
        return Skip("its forward adds the sum of two MLP blocks on one norm's output (Granite 4's MoE and shared MLP) "
                    "in a form the fused forward does not: sequential, in this order, no dropout or passed residual")
    if "tail_in" in roles and (kind != "sequential" or any(dropouts) or scaled or any(passes.values()) or probe.mlp_tuple
                               or returns_rest or returns_none or "mlp2" in roles):
        return Skip("a third block follows its attention and MLP (Gemma 4's per-layer inputs), in a layer that is not "
                    "sequential, or with a dropout, a residual scale, a block adding the residual, a second MLP or a "
                    "block's second output besides, which the fused forward does not combine with it")
    if "post_attention_norm" in roles and (any(dropouts) or scaled or any(passes.values()) or probe.mlp_tuple
                                           or returns_rest or not probe.attention_tuple):
        return Skip("its norms sit before and after each block (Gemma-2's sandwich), with a dropout, a residual scale, "
                    "a block adding the residual or a block's second output besides, which the fused forward does not "
                    "combine with them")

    def hidden(o):  # the hidden states from a probe run's output
        h = probe.split(o)[0]
        return h[0] if returns_none and isinstance(h, tuple) else h

    output_scale = _residual_output_scale.find(probe, markers, hidden)
    if isinstance(output_scale, Skip):
        return output_scale
    inline = (roles.pop("fc_in"), roles.pop("act"), roles.pop("fc_out")) if "act" in roles else ()
    for r in _UNUSED:
        roles.pop(r, None)
    tail = tuple(roles.pop(r) for r in _residual_tail.ROLES) if "tail_in" in roles else ()
    if inline:
        roles["mlp"] = ""
    return ResidualNormSpec(first, attention_input, arguments, tuple(renames), extra and not drops_extra, *dropouts,
                            **roles, mlp_inline=inline, parallel=kind == "parallel", post_norm=kind == "post",
                            post_block=kind == "post_block",
                            at_default=defaulted, positional=positional,
                            drops_extra=drops_extra, returns_rest=returns_rest,
                            residual_passed=tuple(r for r in ("attention", "mlp") if passes[r]),
                            attention_dropout=placed[0] if placed else None, mlp_dropout=placed[1] if placed else None,
                            sum_dropout=placed[2] if placed else None, mlp_inner_dropout=placed[3] if placed else None,
                            attention_scale=scaled[0] if scaled else None, mlp_scale=scaled[1] if scaled else None,
                            mlp_tuple=probe.mlp_tuple,
                            attention_repeats=repeats, attention_single=not probe.attention_tuple, returns_none=returns_none, mlp_view=mlp_view,
                            norm_in_identity=_layer_blocks.is_identity(module._modules[roles["norm_in"]]),
                            output_scale=output_scale, tail=tail, tail_input=probe.tail_arg, unpassed=unpassed)


def _study(module: nn.Module, blocks: list[str], norms: list[str], first: str, params, extra: bool, inline=None,
           tail=None, tail_roles: dict | None = None, unused: tuple = ()):
    """The ResidualNormSpec of the first role assignment the probe confirms, or the likeliest one's Skip. With one
    norm, an identity child may be the first norm (ModernBERT-decoder's layer 0: ``attn_norm = nn.Identity()``).
    ``tail``: (fc_in, act, fc_out) of a third block after the others (``_residual_tail``), its norm one of ``norms``."""
    skips = []
    if tail:  # each norm tried as the third block's, the last declared first (Gemma 4's post_per_layer_input_norm)
        for t in reversed(norms):
            more = dict(zip(_residual_tail.ROLES, (*tail, t)))
            found = _study(module, blocks, [n for n in norms if n != t], first, params, extra, tail_roles=more)
            if found is not None and not isinstance(found, Skip):
                return found
            skips.append(found)
        return next((s for s in skips if s is not None), None)
    tail_roles = tail_roles or {}
    if inline:  # attention, norms and the layer's own fc_in → act → fc_out (OPT)
        (linears, act), pairs = inline, itertools.permutations(norms)
        for (fc_in, fc_out), (norm_in, norm_mid) in itertools.product(itertools.permutations(linears), pairs):
            roles = dict(attention=blocks[0], fc_in=fc_in, act=act, fc_out=fc_out, norm_in=norm_in, norm_mid=norm_mid,
                         **dict(zip(_UNUSED, unused)))
            found = _study_roles(module, roles, first, params, extra)
            if found is not None and not isinstance(found, Skip):
                return found
            skips.append(found)
        return next((s for s in skips if s is not None), Skip(
            "its norms come after its residual adds (post-norm, OPT-350m's do_layer_norm_before=False: "
            "norm(x + attention(x)), then norm(h + mlp(h))), a form no pattern fuses"))
    if len(blocks) == 3:  # two MLP blocks on norm_mid's output, summed (Granite 4's MoE + shared MLP)
        attention = [n for n in blocks if attention_like(module._modules[n])]
        if len(attention) != 1 or len(norms) != 2:
            return None
        mlps = itertools.permutations([n for n in blocks if n != attention[0]])
        for (mlp, mlp2), (norm_in, norm_mid) in itertools.product(mlps, list(itertools.permutations(norms))):
            roles = dict(attention=attention[0], mlp=mlp, mlp2=mlp2, norm_in=norm_in, norm_mid=norm_mid)
            found = _study_roles(module, roles, first, params, extra)
            if found is not None and not isinstance(found, Skip):
                return found
            skips.append(found)
        return next((s for s in skips if s is not None), None)
    for attention, mlp in sorted(itertools.permutations(blocks), key=lambda p: not attention_like(module._modules[p[0]])):
        if len(norms) == 4:  # Gemma-2's sandwich: a norm before and after each block
            tail_arg = tail_argument(module, dict(attention=attention, mlp=mlp, norm_in=norms[0], norm_mid=norms[1],
                                                   post_attention_norm=norms[2], post_mlp_norm=norms[3], **tail_roles),
                                      params) if tail_roles else ""
            roles = None if tail_arg is None else sandwich_roles(module, attention, mlp, norms, params, extra,
                                                                 tail_roles, tail_arg)
            found = None if roles is None else _study_roles(module, roles, first, params, extra)
            if found is not None and not isinstance(found, Skip):
                return found
            skips.append(found)
            continue
        pairs = [(norms[0], norms[0]), *((n, norms[0]) for n in identities(module))] if len(norms) == 1 else \
            itertools.permutations(norms)
        for norm_in, norm_mid in pairs:
            roles = dict(attention=attention, mlp=mlp, norm_in=norm_in, norm_mid=norm_mid, **tail_roles)
            found = _study_roles(module, roles, first, params, extra)
            if isinstance(found, ResidualNormSpec) and found.norm_in_identity and found.post_norm:
                found = Skip("its first norm is an identity and its norms come after the adds (post-norm): a form "
                             "no pattern fuses")
            if found is not None and not isinstance(found, Skip):
                return found
            skips.append(found)
    return next((s for s in skips if s is not None), None)


def _p(module: nn.Module, name: str) -> float:
    value = residual_norm.dropout_attr(module, name)
    return float(value.p if isinstance(value, nn.Module) else value)


class ResidualNormPattern(Pattern):
    name = "residual_norm"
    description = ("pre-norm decoder layer (sequential or parallel), post-norm one (OPT-350m), one with post-block "
                   "norms (OLMo-2: each norm and the add after it one kernel) or post-norm output sublayer (BERT's): "
                   "residual adds inside its norms' kernels")

    def __init__(self, norms_fused: bool = True, layer_norms_fused: bool = True):
        # whether the rms_norm / layer_norm patterns run in the same optimize call
        self.fused_kinds = {k for k, on in (("rms", norms_fused), ("layer", layer_norms_fused)) if on}

    def match(self, module: nn.Module):
        if isinstance(module.__dict__.get("forward"), (residual_norm.ResidualNormForward, residual_output.ResidualOutputForward)):
            return None  # already fused: optimize is idempotent
        blocks = [n for n, m in module._modules.items() if block(m)]
        if len(blocks) == 2:  # a post-norm output sublayer: norm(dropout(dense(h)) + r) (BERT's)
            return residual_norm_output.match(module, blocks, self.fused_kinds)
        inline = inline_mlp(module, blocks) if len(blocks) == 5 else None
        if isinstance(inline, Skip):
            return inline
        kinds = {n: norm_kind(module._modules[n]) for n in blocks}
        sizes = [p.shape[-1] for n in blocks if kinds[n] for p in module._modules[n].parameters()][:1]
        crosses = cross_pairs(module, blocks, kinds) if len(blocks) == 7 else []
        tail = _residual_tail.find(module, blocks, sizes[0]) if len(blocks) in (7, 9) and sizes and not crosses else None
        if crosses:  # a decoder layer's cross-attention and its norm, run only with encoder states (BART's)
            inline = crosses[0][2]
            blocks = [n for n in blocks if n not in crosses[0][:2]]
        blocks = [n for n in blocks if not tail or n not in tail]
        if not 3 <= len(blocks) <= 6 + bool(tail) and not inline:
            return None
        blocks = [n for n in blocks if not inline or n not in inline[0]]
        norms = [n for n in blocks if kinds[n]]
        blocks = [n for n in blocks if not kinds[n]]
        if len(blocks) not in ((1,) if inline else (2,) if tail else (2, 3)) or len(norms) - bool(tail) not in (1, 2, 4) \
                or len(blocks) == 3 and len(norms) != 2 or not any(attention_like(module._modules[n]) for n in blocks):
            return None  # more blocks than one attention, one MLP (or two summed) and one, two or four norms
        fused = [isinstance(module._modules[n], (FusedRMSNorm, FusedLayerNorm)) for n in norms]
        if "forward" in module.__dict__:  # fused by an earlier call (and maybe graphed since), or hooked by others
            return None if all(fused) else Skip(
                "its forward is already replaced on the instance (by accelerate's hooks?), which a fused forward "
                "would bypass")
        missing = {kinds[n] for n in norms} - self.fused_kinds
        if not all(fused) and missing:
            # Its fused forward calls the norms' kernels: with plain norms every call would run the original.
            words, pattern = ("RMSNorms", "rms_norm") if "rms" in missing else ("LayerNorms", "layer_norm")
            return Skip(f"its {words} are left unfused (the {pattern} pattern is not selected), and the residual adds "
                        f"are fused into the norms' kernels: select {pattern} to fuse this layer")
        sig = signature(module)
        if isinstance(sig, Skip):
            return sig
        if crosses:
            spec = study_crosses(module, crosses, kinds, sig, _study)
        else:
            spec = _study(module, blocks, norms, *sig, inline=inline, tail=tail)
        if spec is None:
            return None
        on = [] if isinstance(spec, Skip) else [n for n in (*spec.dropouts, *spec.float_dropouts) if _p(module, n) > 0]
        if on:  # it would fuse only calls with them off: in training, none
            return Skip(f"dropout between its blocks ({', '.join(on)}) is on, at a place the fused forward does not "
                        "apply it (not on one block's output before its residual add, nor on a parallel layer's sum of "
                        "both, in the original's order of draws), and it fuses only calls with it at 0")
        return spec

    def apply(self, root, qualname, module, spec, backend) -> Applied:
        if "forward" in module.__dict__:
            raise ValueError(f"{qualname}: the layer's forward is already replaced on the instance")
        if isinstance(spec, ResidualOutputSpec):
            residual_output.install(module, spec)
            return Applied(residual_output.ResidualOutputForward.__name__, residual_output.Uninstall(module))
        residual_norm.install(module, spec)
        return Applied(residual_norm.ResidualNormForward.__name__, residual_norm.Uninstall(module))
