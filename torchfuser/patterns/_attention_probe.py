"""The attention pattern's probe: the module and a FusedAttention built from a guessed spec run on
float64 CPU copies whose projections are random and narrow on the model side (8 wide), whose norms
are random stand-ins and whose dropouts are visible marks, with random cos/sin and a causal mask
with padding, so that a wrong rotary convention, scaling, layout, norm or mask handling all show;
and the one-token probe that traces which rows of a fused qkv projection v is read from."""
from __future__ import annotations

import copy
import dataclasses
import inspect
import itertools
import weakref

import torch
from torch import nn

from torchfuser.modules.attention import AttentionSpec, FusedAttention, split_concat
from torchfuser.modules.attention_bias import BIAS_ARGS, BIAS_MODES
from torchfuser.patterns import _probe
from torchfuser.patterns._attention_projections import linear_of, projection_dims

_MODEL_WIDTH = 8  # probe width on the model side of the projections
_BATCH, _SEQ = 2, 5


class ProbeNorm(nn.Module):
    """Random-weight RMSNorm standing in for a q/k norm: where it is applied shows in the output."""

    def __init__(self, width: int, gen: torch.Generator):
        super().__init__()
        self.weight = nn.Parameter(_probe.randn(width, gen=gen), requires_grad=False)

    def forward(self, x):
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6) * self.weight


class ProbeDropout(nn.Module):
    """Stands in for a dropout: a scale of its own wherever it is called (so two dropouts cannot
    be mistaken for each other), while ``.p`` still reads as the real p."""

    def __init__(self, p: float, factor: float):
        super().__init__()
        self.p, self.factor = p, factor

    def forward(self, x):
        return self.factor * x


_EPS_ATTRS = ("variance_epsilon", "eps", "epsilon")


def is_weightless_norm(m: nn.Module) -> bool:
    """A child without parameters or children computing x·rsqrt(mean(x²) + eps) over the last dim, eps its
    own attribute (Llama 4's text ``qk_norm``): checked on a float64 probe, not taken from its name."""
    if m._modules or any(p is not None for p in m._parameters.values()) or isinstance(m, (nn.Dropout, nn.Identity)):
        return False
    eps = next((v for n in _EPS_ATTRS if isinstance(v := getattr(m, n, None), float)), None)
    if eps is None:
        return False
    x = _probe.randn(3, 6, gen=_probe.generator(7))
    try:
        with torch.no_grad():
            got = m(x)
    except Exception:
        return False
    want = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps)
    return isinstance(got, torch.Tensor) and got.shape == x.shape and _probe.close(got, want)


def forward_params(module: nn.Module) -> list[inspect.Parameter]:
    try:
        return list(inspect.signature(module.forward).parameters.values())
    except (TypeError, ValueError):
        return []


def takes_rope(module: nn.Module) -> bool:
    return any(p.name == "position_embeddings" for p in forward_params(module))


# Arguments a forward may take that are never a rotary table.
_NOT_TABLES = frozenset({"attention_mask", "position_ids", "position_embeddings", "cache_position", "output_attentions",
                         "use_cache", "cache", "past_key_values", "layer_past", "head_mask"})


def _required(module: nn.Module) -> list[inspect.Parameter]:
    return [p for p in forward_params(module)[1:] if p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY)
            and p.default is p.empty]


def dict_args(module: nn.Module) -> list[str]:
    """Required arguments annotated as dicts (Gemma 4's ``shared_kv_states``, where a layer hands its k and v on
    to later layers): the probes give each a dict of its own, and what the forward writes there is compared."""
    return [p.name for p in _required(module) if "dict" in str(p.annotation).lower()]


def complex_table_args(module: nn.Module) -> list[str]:
    """Required arguments after the hidden states that might carry a complex rotary table (Llama 4's
    vision ``freqs_ci``): only the probe decides whether one does."""
    dicts = dict_args(module)
    return [p.name for p in _required(module) if p.name not in _NOT_TABLES and p.name not in BIAS_ARGS
            and p.name not in dicts]


def dict_writes(module: nn.Module, spec: AttentionSpec) -> tuple[tuple[str, str], ...] | None:
    """(argument, key) of every entry the module's forward writes into the dicts it is given (``dict_args``);
    None where it does not run with ``spec``'s probe."""
    if not dict_args(module):
        return ()
    try:
        probe, x, kwargs = probe_copy(module, spec)
        probe.training = False
        with torch.no_grad(), _probe.saved_rng():
            type(probe).forward(probe, x, **kwargs)
    except Exception:
        return None
    return tuple((n, key) for n in dict_args(module) for key in kwargs[n])


def extra_fields(module: nn.Module) -> list[dict]:
    """AttentionSpec fields to try for what a forward requires besides the usual arguments: a position
    bias (``BIAS_ARGS``, unless the config switches it off) in each layout and place, with a float or a
    True-hides boolean mask; and a required argument the output may be added to (BLOOM's residual)."""
    names = [p.name for p in forward_params(module)]
    cfg = getattr(module, "config", None)
    bias = next((a for a in BIAS_ARGS if a in names and getattr(cfg, a, None) is not False), None)
    fields = [{}]
    if bias is not None:
        impl = getattr(cfg, "_attn_implementation", None)  # None: the module holds no config (BLOOM, MPT)
        fields = [dict(bias=bias, bias_batched=batched, bias_mode=mode, mask_fill=fill, implementation=impl)
                  for fill in (False, True) for batched in (True, False) for mode in BIAS_MODES]
    # None too: a required argument may be something else, a complex rotary table (Llama 4's vision freqs_ci)
    fields = [dict(f, residual=r) for r in [None, *complex_table_args(module)] for f in fields]
    # Last, a forward taking q, k and v's inputs apart (CTRL's forward(v, k, q), called (n, n, n)): two required
    # arguments after the input, of names the probe does not pass otherwise, and three input projections besides
    # the output's; each given the input too.
    known = {*BIAS_ARGS, *_NOT_TABLES, *dict_args(module)}
    same = tuple(p.name for p in itertools.takewhile(lambda p: p.default is p.empty and p.kind is p.POSITIONAL_OR_KEYWORD
                                                       and p.name not in known, forward_params(module)[1:]))
    projections = [m for m in module._modules.values() if projection_dims(m)]
    same = same if len(same) == 2 and len(projections) == 4 else ()
    return fields + [dict(f, same_input=same) for f in fields if f["residual"] is None] if same else fields


def ignores_mask(module: nn.Module, spec: AttentionSpec) -> bool | None:
    """Whether ``module`` computes the same with the probe's causal, padded mask as with none hidden:
    a forward that drops the mask it is given (Llama 4's vision attention) must not be fused as one
    that applies it. None where the forward does not run with this spec."""
    try:
        probe, x, kwargs = probe_copy(module, spec)
        probe.training = False
        with torch.no_grad():
            masked = type(probe).forward(probe, x, **kwargs)[0]
            kwargs["attention_mask"] = torch.zeros_like(kwargs["attention_mask"])
            open_ = type(probe).forward(probe, x, **kwargs)[0]
    except TypeError as err:  # it passes a mask of its own on (None: BLIP-2's vision attention), whatever it is given
        return True if _own_mask(module, err) else None
    except Exception:
        return None
    return bool(torch.equal(masked, open_))


def _own_mask(module: nn.Module, err: Exception) -> bool:
    """Whether ``err`` says the forward, which takes no mask by name, passed a mask of its own on beside the one
    given (BLIP-2's vision attention: ``attention_mask=None``): it got that far, and it ignores any mask."""
    return (isinstance(err, TypeError) and "multiple values for keyword argument 'attention_mask'" in str(err)
            and not any(p.name == "attention_mask" for p in forward_params(module)))


def mask_variants(module: nn.Module, spec: AttentionSpec, ignored: list):
    """``spec``, then, once the module is found to ignore its mask (``ignored[0]``, decided on the
    first spec whose output differs), the same spec ignoring the mask, non-causal first."""
    yield spec  # the caller goes on here only where spec failed its probe
    if ignored[0] is None:
        ignored[0] = ignores_mask(module, spec)
    if ignored[0]:
        yield from (dataclasses.replace(spec, uses_mask=False, is_causal=c) for c in (False, True))


# module → the model-side width its probes take where the narrow one fails: heads · head_dim for a forward that
# reads its head width from its input's width (BLIP's); None where that was tried and did not help either.
_WIDE = weakref.WeakKeyDictionary()
_MAX_WIDE = 2048  # wider than this, a float64 probe costs more than the block is worth probing


def probe_copy(module: nn.Module, spec: AttentionSpec, flat_tables: bool = False, width: int | None = None):
    """(probe module, input, kwargs): ``module`` on random float64 CPU parts (never the model's own
    tensors, which may be on the meta device or a GPU), narrow on the model side (``width`` wide)."""
    width = width or _WIDE.get(module) or _MODEL_WIDTH
    gen = _probe.generator(5)
    probe = _probe.shallow_copy(module)
    proj = {n: linear_of(module._modules[n]) for n in (*spec.qkv, spec.out)}  # a LoRA layer: its base
    for n in spec.qkv:
        probe._modules[n] = _probe.small_projection(proj[n], width, _probe.projection_dims(proj[n])[1], gen)
    n_out = _probe.projection_dims(proj[spec.out])[0]
    probe._modules[spec.out] = _probe.small_projection(proj[spec.out], n_out, width, gen)
    for n in (spec.q_norm, spec.k_norm, spec.v_norm):
        if n is not None and getattr(module._modules[n], "weight", None) is not None:  # a weightless one stays
            probe._modules[n] = ProbeNorm(module._modules[n].weight.shape[0], gen)
    # Every dropout gets its own p (and every Dropout child its own mark), so that the training
    # probe tells which one the forward applies where.
    drops = [n for n, m in module._modules.items() if isinstance(m, nn.Dropout)]
    for i, n in enumerate(drops):
        # A module adding a position bias computes attention itself and calls its own dropouts: real ones
        # there (identities in eval), whose draws in training match SDPA's math kernel's from one seed.
        probe._modules[n] = (nn.Identity() if n in spec.idle_dropouts else nn.Dropout(0.15 + 0.1 * i).eval()
                             if spec.bias else ProbeDropout(0.15 + 0.1 * i, 3.0 + 2 * i))
    for i, n in enumerate(_probe.float_dropouts(module)):
        probe.__dict__[n] = 0.2 + 0.1 * i
    for n, b in module._buffers.items():
        if b is not None:
            probe._buffers[n] = torch.zeros(b.shape, dtype=torch.float64 if b.is_floating_point() else b.dtype)
    x = _probe.randn(_BATCH, _SEQ, width, gen=gen)
    low = torch.finfo(torch.float64).min
    mask = torch.full((_SEQ, _SEQ), low, dtype=torch.float64).triu(1).expand(_BATCH, 1, _SEQ, _SEQ).clone()
    mask[1, :, :, 1] = low  # a padded key in the second sequence
    # A forward that takes no mask by name and is probed as one ignoring it gets none (BLIP-2's passes its own on).
    named = any(p.name == "attention_mask" for p in forward_params(module))
    kwargs = {"attention_mask": mask} if named or spec.uses_mask else {}
    kwargs.update(dict.fromkeys(spec.same_input, x))  # (CTRL's k and q: the input itself)
    # A position-bias argument without a default gets None unless the spec adds it (the pattern probes
    # none where the config switches it off: Falcon's alibi in transformers 5.17, with alibi=False).
    kwargs.update({p.name: None for p in forward_params(module)[1:] if p.default is p.empty and p.name in BIAS_ARGS})
    if spec.bias is not None:  # random, so that a wrong layout, scale or place shows; MPT's table is wider
        heads = spec.num_heads
        shape = (_BATCH * heads, 1, _SEQ) if spec.bias_batched else (heads, 1, _SEQ + 3)
        kwargs[spec.bias] = _probe.randn(*shape, gen=gen)
    if spec.mask_fill:
        kwargs["attention_mask"] = mask == low
    if spec.residual is not None:
        kwargs[spec.residual] = _probe.randn(_BATCH, _SEQ, width, gen=gen)
    kwargs.update({n: {} for n in dict_args(module)})
    if spec.rotary_complex:  # S × 1 × D/2 as Llama 4's vision tower passes it (B × S × D/2: its text model's);
        # random, so that any other convention shows
        shape = (_BATCH, _SEQ, spec.rotary_dim // 2) if flat_tables else (_SEQ, 1, spec.rotary_dim // 2)
        kwargs[spec.rotary_complex] = torch.complex(_probe.randn(*shape, gen=gen), _probe.randn(*shape, gen=gen))
    elif spec.rotary_dim or takes_rope(module):
        # Random, not true cos/sin: any convention other than rotate-half shows, and a module that
        # rotates when the spec says it does not (a NoPE guess) cannot match.
        # flat_tables: one (S × D) table for every row (Pixtral's 2-D patch positions), not B × S × D.
        shape = (_SEQ, spec.rotary_table_dim or spec.head_dim) if flat_tables else (_BATCH, _SEQ, spec.rotary_table_dim or spec.head_dim)
        kwargs["position_embeddings"] = (_probe.randn(*shape, gen=gen), _probe.randn(*shape, gen=gen))
    if spec.rotary_axes > 1:  # B × S × axes positions (Gemma 4's patch coordinates; its forward reads their width)
        kwargs["position_ids"] = torch.randint(0, _SEQ, (_BATCH, _SEQ, spec.rotary_axes), generator=gen)
    return probe, x, kwargs


def value_rows(module: nn.Module, spec: AttentionSpec) -> tuple[int, ...] | None:
    """The rows of the fused qkv projection's output that ``module`` reads v from, in v's channel
    order per query head; None where it does not run or v is no plain selection of rows. A single
    token attends only to itself, so the output is its own v whatever q, k, norms and rotary do:
    with identities for the projections and the row numbers as the input, the output *is* those rows."""
    n = projection_dims(module._modules[spec.qkv[0]])[1]
    try:
        probe, _, kwargs = probe_copy(module, spec)
        for name, m in probe._modules.items():
            if name in (*spec.qkv, spec.out) or isinstance(m, ProbeDropout):
                probe._modules[name] = nn.Identity()
        kwargs = {k: tuple(t[:1, :1] for t in v) for k, v in kwargs.items() if k == "position_embeddings"}
        kwargs["attention_mask"] = torch.zeros(1, 1, 1, 1, dtype=torch.float64)
        with torch.no_grad():
            rows = type(probe).forward(probe, torch.arange(n, dtype=torch.float64).view(1, 1, n), **kwargs)[0].flatten()
    except Exception:
        return None
    if not torch.equal(rows, rows.round()) or not 0 <= rows.min() <= rows.max() < n:
        return None
    return tuple(int(r) for r in rows)


def rows_read(spec: AttentionSpec) -> tuple[int, ...]:
    """The rows FusedAttention(spec) reads v from, as ``_value_rows`` lists them (a "concat" spec)."""
    n = (spec.num_heads + 2 * spec.num_kv_heads) * spec.head_dim
    v = split_concat(spec, torch.arange(n))[2].view(spec.num_kv_heads, spec.head_dim)
    return tuple(v.repeat_interleave(spec.num_heads // spec.num_kv_heads, dim=0).flatten().tolist())


def row_runs(rows: tuple[int, ...]) -> str:
    """[0, 1, 2, 7, 8] → '0-2, 7-8'."""
    runs = [[rows[0], rows[0]]]
    for r in rows[1:]:
        if r == runs[-1][1] + 1:
            runs[-1][1] = r
        else:
            runs.append([r, r])
    return ", ".join(f"{a}-{b}" if a != b else f"{a}" for a, b in runs)


def run_both(probe: nn.Module, spec: AttentionSpec, x, kwargs, training: bool):
    """(original output, fused output). In training both run the sdpa path from one seed: equal
    outputs then mean the same dropouts with the same p at the same places."""
    if training and spec.bias is None:
        probe = copy.copy(probe)
        probe.config = copy.copy(probe.config)
        probe.config.__dict__["_attn_implementation_internal"] = "sdpa"
    probe.training = training
    for m in probe._modules.values():
        if isinstance(m, nn.Dropout):  # the probe's own (bias specs), not the model's
            m.training = training
    fused = FusedAttention(probe, spec, "reference")
    fused.training = training
    # A dict argument of each its own (``dict_args``): what each forward writes there is compared.
    want_kw, got_kw = ({k: {} if isinstance(v, dict) else v for k, v in kwargs.items()} for _ in range(2))
    with torch.no_grad(), _probe.saved_rng():
        _probe.seed_cpu(0)
        want = type(probe).forward(probe, x, **want_kw)  # the class's forward: no hooks
        _probe.seed_cpu(0)
        got = fused(x, **got_kw)
    return want, got, [(n, want_kw[n], got_kw[n]) for n, v in kwargs.items() if isinstance(v, dict)]


def _writes_differ(written) -> str | None:
    """Why what the fused forward wrote into the dict arguments is not what the module wrote, or None."""
    for name, want, got in written:
        if want.keys() != got.keys():
            return (f"it writes {sorted(map(str, want))} into its argument {name!r} (the fused attention writes "
                    f"{sorted(map(str, got))}: its k and v, where a layer hands them on as one entry)")
        for key in want:
            a, b = want[key], got[key]
            same = (isinstance(a, tuple) and isinstance(b, tuple) and len(a) == len(b)
                    and all(isinstance(t, torch.Tensor) and t.shape == u.shape and _probe.close(u, t) for t, u in zip(a, b)))
            if not same:
                return f"what it writes into {name!r}[{key!r}] is not the (k, v) the fused attention attends over"
    return None


def check(module: nn.Module, spec: AttentionSpec, training: bool) -> str | None:
    """None if FusedAttention(spec) computes what ``module`` computes, else why not."""
    # A wrong guess often fails on shapes. Then: rotary tables shared by the batch, S × D (Pixtral / Mistral 3's
    # vision attention; complex ones per row); and, once a module, the model-side width heads · head_dim.
    attempts = [{}, *([dict(flat_tables=True)] if spec.rotary_dim else [])]
    wide = spec.num_heads * spec.head_dim
    if module not in _WIDE and _MODEL_WIDTH < wide <= _MAX_WIDE:
        attempts.append(dict(width=wide))
    first = None
    for kw in attempts:
        try:
            probe, x, kwargs = probe_copy(module, spec, **kw)
            want, got, written = run_both(probe, spec, x, kwargs, training)
            break
        except Exception as err:
            first = first or err
            if "width" in kw:  # a forward that got as far as passing its own mask on took the width
                _WIDE[module] = kw["width"] if _own_mask(module, err) else None
    else:
        return f"{type(first).__name__}: {first}"
    if "width" in kw:  # the module's other probes (its mask's, v's rows, dict writes) at that width too
        _WIDE[module] = kw["width"]
    if not (isinstance(want, tuple) and len(want) == 2 and isinstance(want[0], torch.Tensor)):
        return "forward does not return (output, attention weights)"
    if not _probe.close(got[0], want[0]):
        return "output differs" + (" in training (dropout)" if training else " (scaling, rotary convention, norms or mask)")
    return _writes_differ(written)
