"""Self-attention blocks, recognised by structure and checked by a numerical probe.

A candidate is a module with two or more projection children (``nn.Linear`` / ``Conv1D``) that
takes an ``attention_mask`` (or whose class name says attention). From its projection shapes and
head attributes we enumerate the layouts it could have (separate q/k/v, one fused [q|k|v]
projection, GPT-NeoX's per-head interleaving), which projection is the output, which norm is
q's and which k's, where each dropout sits, and how wide the rotary part is. Each guess becomes
an ``AttentionSpec``; the first whose ``FusedAttention`` computes exactly what the module's own
forward computes on a probe wins (``_attention_probe``: a wrong rotary convention, scaling,
layout, norm or mask handling all show there). Last come a fused qkv
projection's other arrangements: q, k and v in another order, in several blocks each with its
share of the heads (CodeGen's [q|v|k] per model-parallel shard). A one-token probe traces which
rows of the projection v is read from, and only the arrangements that read v from there are
probed; when none does, the skip reason names the rows. A forward that takes a position bias (ALiBi:
BLOOM's ``alibi``, MPT's ``position_bias``) is probed with a random one in each layout and place
(``modules/attention_bias.py``), and one that requires another tensor with the residual added to its output
(BLOOM's), all found by the same probes.
"""
from __future__ import annotations

import dataclasses
import itertools
import math

from torch import nn

from torchfuser.modules.adapters import lora
from torchfuser.modules.attention import _IMPLEMENTATIONS, AttentionSpec, FusedAttention
from torchfuser.patterns import _reasons
from torchfuser.patterns._attention_projections import projection_dims
from torchfuser.patterns._attention_probe import (
    check, complex_table_args, dict_writes, extra_fields, forward_params, is_weightless_norm, mask_variants, row_runs, rows_read,
    takes_rope, value_rows,
)
from torchfuser.patterns._attention_reasons import _no_layout, _probe_failed
from torchfuser.patterns._attention_roles import _dropout_roles, _heads, _hint_rank, _int_attr, _is_norm, _norm_roles  # noqa: F401
from torchfuser.patterns.base import Pattern, Skip

# Eval probes per module and rotary-table stage before giving up (each is a few ms; hints put the right one first).
_MAX_PROBES = 24
_SOFTCAP_ATTRS = ("attn_logit_softcapping", "attn_logit_softcap", "logit_softcapping")


def _rotary_dims(module: nn.Module, head_dim: int) -> list[int]:
    """Rotary widths to try: the module's/config's partial rotary first, then the full head."""
    dims = []
    rd = _int_attr(module, "rotary_ndims", "rotary_dim", "rotary_emb_dim")
    if rd:
        dims.append(rd)
    cfg = getattr(module, "config", None)
    factor = (getattr(cfg, "rope_parameters", None) or {}).get("partial_rotary_factor")
    factor = factor if factor is not None else getattr(cfg, "partial_rotary_factor", None)
    if isinstance(factor, (int, float)) and 0 < factor < 1:
        dims.append(int(head_dim * factor))
    dims.append(head_dim)
    return list(dict.fromkeys(d for d in dims if d % 2 == 0))


def _rotary_guesses(module: nn.Module, head_dim: int, pair_tables: bool, complex_args=()):
    """AttentionSpec rotary fields to try. With (cos, sin) tables rotary_dim wide, as most models
    pass them: rotate-half at each width, then adjacent pairs (Cohere, GLM), then no rotary at all
    (NoPE layers take position embeddings and ignore them), and last one rotate-half part per axis of
    the position_ids (Gemma 4's vision attention). With tables of one entry per pair:
    adjacent pairs, (cos, sin) or (sin, cos) (GPT-J)."""
    dims = _rotary_dims(module, head_dim)
    if complex_args:  # complex tables c + i·s multiply adjacent channel pairs: "half" with per-pair tables
        for name, rd in itertools.product(complex_args, dims):
            yield dict(rotary_dim=rd, rotary_interleave="half", rotary_pair_tables=True, rotary_complex=name)
        return
    if pair_tables:
        for rd, sin_first in itertools.product(dims, (False, True)):
            yield dict(rotary_dim=rd, rotary_interleave="half", rotary_pair_tables=True, rotary_sin_first=sin_first)
        return
    yield from (dict(rotary_dim=rd) for rd in dims)
    yield from (dict(rotary_dim=rd, rotary_interleave=pairs) for rd in dims for pairs in ("pairs", "half"))
    yield from (dict(rotary_dim=rd, rotary_sin_negated=True) for rd in dims)  # [x2, -x1] (NanoChat)
    yield dict(rotary_dim=0)
    # Last (a block that matched before matches as before, within the same probes): a rotate-half part per axis of
    # B × S × n position_ids (Gemma 4's 2-D vision rotary).
    if any(p.name == "position_ids" for p in forward_params(module)):
        yield from (dict(rotary_dim=head_dim, rotary_axes=n) for n in (2, 3) if head_dim % (2 * n) == 0)


def _scaling(module: nn.Module, d: int) -> float:
    s = getattr(module, "scaling", None)
    return float(s) if isinstance(s, (int, float)) and not isinstance(s, bool) else d**-0.5


def _layouts(inputs, projs, heads, kv, d, blocks: bool):
    """(layout, q/k/v projections, further spec fields). With ``blocks``, only a fused projection's
    other arrangements: [q | k | v] in any order, in as many blocks as divide both head counts
    (few first), each block with its share of the heads."""
    if len(inputs) == 3 and not blocks:
        for q, k, v in sorted(itertools.permutations(inputs), key=lambda p: _hint_rank(p, "qkv")):
            if projs[q][1] == heads * d and projs[k][1] == projs[v][1] == kv * d:
                yield "separate", (q, k, v), {}
    elif len(inputs) == 1 and projs[inputs[0]][1] == (heads + 2 * kv) * d:
        if not blocks:
            yield "concat", (*inputs,), {}
            if heads == kv:
                yield "per_head", (*inputs,), {}
            return
        g = math.gcd(heads, kv)
        counts = [n for n in range(1, g + 1) if g % n == 0]
        for n, order in itertools.product(counts, itertools.permutations("qkv")):
            yield "concat", (*inputs,), dict(qkv_blocks=n, qkv_order=order)


def _shapes(module: nn.Module, projs, blocks: bool = False):
    """(output projection, layout, q/k/v projections, further spec fields, (heads, kv heads, head
    dim)) that the projection shapes and head attributes allow, likeliest first."""
    for out in sorted(projs, key=lambda n: _hint_rank([n], "o")):
        inputs = [n for n in projs if n != out]
        h_in = {projs[n][0] for n in inputs}
        if len(h_in) != 1 or projs[out][1] != h_in.pop():
            continue
        heads, kv, d = _heads(module, projs[out][0])
        if not (heads and kv and d) or heads % kv or projs[out][0] != heads * d:
            continue
        for layout, qkv, fields in _layouts(inputs, projs, heads, kv, d, blocks):
            yield out, layout, qkv, fields, (heads, kv, d)


class AttentionPattern(Pattern):
    name = "attention"
    description = "projections → q/k norm → rope (functional.rope) → SDPA → output projection"
    fused = FusedAttention

    def match(self, module):
        params = forward_params(module)
        names = [p.name for p in params]
        hinted = "attention" in type(module).__name__.lower()
        if not (hinted or "attention_mask" in names):
            return None
        # A projection under a PEFT adapter counts as the projection it wraps (FusedAttention runs LoRA); a module
        # wrapping one Linear (Gemma 4's clippable one) as a projection called as it is (_attention_projections).
        projs = {n: d for n, m in module._modules.items() if m is not None and (d := projection_dims(m))}
        if len(projs) < 2:
            return None
        if not hinted and next(_shapes(module, projs), None) is None:
            return None  # takes a mask but has no q/k/v/o projections (e.g. a decoder layer with an inline MLP)
        result = self._unsupported(module, names) or _reasons.no_mask(params) or next(
            filter(None, (lora.unsupported(n, module._modules[n]) for n in projs)), None)
        result = Skip(result) if result else self._parts(module, projs)
        if not isinstance(result, Skip):
            result = (*result, extra_fields(module))
        if not isinstance(result, Skip):
            positional = tuple(p.name for p in params[1:] if p.kind is p.POSITIONAL_OR_KEYWORD)
            parts, rope = result, takes_rope(module)
            result = self._search(module, projs, parts, positional, rope)
            # A required argument may be a complex rotary table (Llama 4's vision freqs_ci), or the
            # position_embeddings may be one (Llama 4's text freqs_cis).
            tables = (() if not isinstance(result, Skip) else ("position_embeddings",) if rope
                      else tuple(complex_table_args(module)))
            if tables:
                found = self._search(module, projs, parts, positional, True, tables)
                result = result if isinstance(found, Skip) else found
        if isinstance(result, Skip) and "position_ids" in names and "position_embeddings" not in names:
            # The likely cause (GPT-J and CodeGen before transformers took their tables out of the
            # attention): the fused attention is given its rotary tables, it does not build them.
            return Skip(f"it computes its rotary embedding itself from position_ids (it takes no "
                        f"position_embeddings), and the fused attention applies tables it is given: {result.reason}")
        return result

    # -- what is never fused -------------------------------------------------------------
    @staticmethod
    def _unsupported(module: nn.Module, arg_names: list[str]) -> str | None:
        cfg = getattr(module, "config", None)
        if getattr(module, "is_cross_attention", False):
            return "cross-attention (keys and values from an encoder's states) is not fused"
        for attr in _SOFTCAP_ATTRS:
            cap = getattr(module, attr, None)
            if cap is not None:
                return f"attention logit softcapping ({attr}={cap}): SDPA cannot apply tanh(s/c)·c to the scores"
        if getattr(module, "attn_temperature_tuning", False) and not getattr(module, "use_rope", True):
            # A short probe cannot see it: the factor is 1 for the first floor_scale positions.
            return ("attention temperature tuning (Llama 4's NoPE layers): queries are scaled by position "
                    "beyond floor_scale tokens, which SDPA is not told")
        clip = getattr(module, "clip_qkv", None)
        if clip:  # a probe's small values never reach the clamp: it could not tell
            return f"it clamps its q/k/v projection to ±{clip} (clip_qkv), which the fused attention does not"
        own = [n for n, p in module._parameters.items() if p is not None]
        if own:
            what = ("attention sinks (a learned logit per head in the softmax's denominator)" if "sinks" in own
                    else "parameters of its own")
            return (f"{what}: {_reasons.quoted(own)}, besides its projections; the fused attention (SDPA) computes "
                    "softmax(q·kᵀ·scale + mask)·v and nothing they add")
        impl = getattr(cfg, "_attn_implementation", None)
        if impl is None and not (cfg is None and any(f.get("bias") for f in extra_fields(module))):
            return ("its model chooses no attention implementation (config._attn_implementation is None): it "
                    "computes attention its own way (linear or recurrent attention, or an older model's own code), "
                    "which the fused attention does not assume")
        if impl not in (*_IMPLEMENTATIONS, None):
            return (f"attention implementation {impl!r}: only 'eager' and 'sdpa' are reproduced (load the model with "
                    "attn_implementation='sdpa' to fuse it)")
        if getattr(cfg, "output_attentions", False):
            return "config.output_attentions=True asks for attention weights, which SDPA does not form"
        return None

    @staticmethod
    def _parts(module: nn.Module, projs):
        """(norm children, dropout children, buffer names) or a Skip for unknown children."""
        norms, drops, unknown, weightless = [], [], [], []
        for n, m in module._modules.items():
            if m is None or n in projs:
                continue
            if isinstance(m, nn.Dropout):
                drops.append(n)
            elif type(m) is nn.Identity:  # a q/k norm or dropout switched off (InternVL's vision attention)
                continue
            elif _is_norm(m):
                norms.append(n)
            elif is_weightless_norm(m):  # RMS norms without a weight (NanoChat's q/k norms, Gemma 4's v norm)
                norms.append(n)
                weightless.append(n)
            else:
                unknown.append(n)
        if unknown:
            return Skip(f"unrecognised submodules {unknown} ({_reasons.children(module, unknown)}) besides its "
                        "projections: the fused attention reproduces projections, q, k and v norms and dropouts only")
        if len(norms) > 3 or (len(norms) == 1 and norms != weightless):
            return Skip(f"{'a single norm' if len(norms) == 1 else f'{len(norms)} norms'} ({_reasons.quoted(norms)}), "
                        "not a pair of q and k norms (with a v norm, or one weightless norm for both)")
        return norms, drops, tuple(n for n, b in module._buffers.items() if b is not None)

    # -- guesses and probes ----------------------------------------------------------------
    @staticmethod
    def _specs(module, projs, parts, positional, takes_rope, pair_tables=False, blocks=False, complex_args=(),
               after_rope=False):
        """Every spec the structure allows, dropout probabilities aside, likeliest first; with ``after_rope``,
        only those with per-head q/k norms, applied after the rotary (HunYuan, Llama 4's text qk_norm)."""
        norms, drops, buffers, extras = parts
        for out, layout, qkv, fields, (heads, kv, d) in _shapes(module, projs, blocks):
            for norm_roles in _norm_roles(module, norms, heads, kv, d):
                # Last, Dropout children of p = 0 as the identities they are (BLIP's, called on the probabilities
                # whatever the attention implementation): the fused module runs the original if one's p changes.
                idle = tuple(n for n in drops if module._modules[n].p == 0)
                for out_child, idle in [*((c, ()) for c in [None, *drops]), *([(None, idle)] if idle else [])]:
                    for rotary in _rotary_guesses(module, d, pair_tables, complex_args) if takes_rope else ({},):
                        if after_rope and not (norm_roles.get("norm_per_head") and rotary.get("rotary_dim")):
                            continue  # the same spec as with the norms before the rotary
                        for extra in extras:
                            if extra["residual"] is not None and extra["residual"] == rotary.get("rotary_complex"):
                                continue
                            yield AttentionSpec(
                                layout=layout, qkv=qkv, out=out, num_heads=heads, num_kv_heads=kv, head_dim=d,
                                scaling=_scaling(module, d), **fields, **rotary, **norm_roles, **extra,
                                norm_after_rope=after_rope, out_dropout=out_child, idle_dropouts=idle,
                                is_causal=bool(getattr(module, "is_causal", True)), positional=positional, keep=buffers,
                            )

    def _search(self, module, projs, parts, positional, takes_rope, complex_args=()):
        """The first spec both probes accept, else a Skip. Two stages keep the search small: the
        eval probe fixes layout, norms, rotary and output Dropout child; the training probe then
        picks the dropout probabilities."""
        first_reason, cut = None, False
        # Rotary tables as most models pass them first, through every structure within the probe
        # budget, so that every block that matched before matches as before; only then tables of
        # one entry per pair (GPT-J), with a budget of their own. Last, with budgets of their own
        # too, a fused projection's other arrangements of q, k and v (CodeGen's), each probed only
        # if it reads v from the rows the module does (one-token probes, one per table width).
        # A forward that ignores the mask it is given (found once an output differs) is probed as such.
        tables = [False, True] if takes_rope and not complex_args else [False]
        v_rows, tried, v_fits, ignored, writes = {}, set(), False, [None], None
        # q/k norms after the rotary are a stage of their own, after every placement before it.
        placements = (False, True) if parts[0] and takes_rope else (False,)
        for after_rope, blocks, pair_tables in itertools.product(placements, (False, True), tables):
            budget = _MAX_PROBES * len(parts[3])  # a budget per bias / residual variant
            for spec in self._specs(module, projs, parts, positional, takes_rope, pair_tables, blocks, complex_args,
                                    after_rope):
                if blocks:
                    key = (spec.qkv, spec.out, spec.rotary_table_dim)
                    if key not in v_rows:
                        v_rows[key] = value_rows(module, spec)
                    if v_rows[key] is None or v_rows[key] != rows_read(spec):
                        continue
                    v_fits = True
                    if spec in tried:
                        continue
                if not budget:
                    cut = True
                    break
                if writes is None:  # what it hands on through dict arguments: found once its forward runs
                    writes = dict_writes(module, spec)
                if writes and len(writes) == 1:  # one entry: its (k, v), if the probe agrees
                    spec = dataclasses.replace(spec, kv_out=writes[0])
                for spec in mask_variants(module, spec, ignored):
                    if not budget:
                        cut = True
                        break
                    budget -= 1
                    tried.add(spec)
                    reason = check(module, spec, training=False)
                    if reason is None:
                        return self._pick_dropouts(module, spec, parts[1])
                    first_reason = first_reason or reason
        if first_reason is None:
            return Skip(_no_layout(module, projs))
        mine = next(((key[0][0], rows) for key, rows in v_rows.items() if rows is not None), None)
        if mine is not None and not v_fits:
            return Skip(f"fused projection {mine[0]!r} holds v in its output rows {row_runs(mine[1])}; no layout "
                        "reads v from there (q, k and v in any order, in as many blocks as divide the heads)")
        return Skip(_probe_failed(module, first_reason, len(tried), cut))

    @staticmethod
    def _pick_dropouts(module, spec: AttentionSpec, drops):
        drops = [n for n in drops if n not in spec.idle_dropouts]
        for prob, out in _dropout_roles(module, drops, spec.out_dropout, spec.bias is not None):
            candidate = dataclasses.replace(spec, dropout=prob, out_dropout=out)
            if check(module, candidate, training=True) is None:
                return candidate
        return Skip("in training its output differs from SDPA with every placement of the dropouts found: it drops "
                    "out something the fused attention does not")

