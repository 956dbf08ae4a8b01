"""Which child plays which part in an attention block, guessed from names and shapes (the probe decides): the
head counts and width from the module's attributes or config, the q, k and v projections' name hints, q / k / v
norms (weighted, or weightless RMS norms) and their placement per head or over all heads, and which dropout is the
probabilities' and which the output's."""
from __future__ import annotations

import itertools

from torch import nn

from torchfuser.patterns import _probe


def _int_attr(obj, *names):
    for n in names:
        try:
            v = getattr(obj, n, None)
        except Exception:  # e.g. transformers' per-layer configs refuse global reads of per-layer fields
            v = None
        if isinstance(v, int) and not isinstance(v, bool) and v > 0:
            return v
    return None


def _heads(module: nn.Module, q_in: int):
    """(num_heads, num_kv_heads, head_dim) from the module's attributes, falling back on its config."""
    cfg = getattr(module, "config", None)
    heads = _int_attr(module, "num_heads", "num_attention_heads", "n_heads") or _int_attr(cfg, "num_attention_heads", "n_head")
    d = _int_attr(module, "head_dim", "head_size") or _int_attr(cfg, "head_dim")
    if d is None and heads:
        d = q_in // heads
    groups = _int_attr(module, "num_key_value_groups")
    kv = _int_attr(module, "num_key_value_heads", "num_kv_heads")
    if kv is None and groups and heads:
        kv = heads // groups
    kv = kv or _int_attr(cfg, "num_key_value_heads") or heads
    return heads, kv, d


def _hint_rank(names, roles) -> int:
    """How many names disagree with the role letters (q/k/v, o): orders guesses, decides nothing."""
    words = {"q": ("q", "query"), "k": ("k", "key"), "v": ("v", "value"), "o": ("o_", "out", "c_proj", "dense", "wo", "projection")}
    return sum(not any(n.lower().startswith(w) or w in n.lower() for w in words[r]) for n, r in zip(names, roles))


def _is_norm(m: nn.Module) -> bool:
    params = {n: p for n, p in m._parameters.items() if p is not None}
    return not m._modules and "weight" in params and params["weight"].dim() == 1 and set(params) <= {"weight", "bias"}


def _norm_placements(module, name, d, all_heads) -> list[bool]:
    """Whether a norm child may run per head (over head_dim) or over all heads at once (``all_heads`` wide):
    what its weight's width allows, both for a weightless one (the probe decides)."""
    weight = getattr(module._modules[name], "weight", None)
    if weight is None:
        return [True, False]
    return [per for per, width in ((True, d), (False, all_heads)) if weight.shape[0] == width]


def _norm_roles(module, norms, heads, kv, d):
    """q, k (and v) norm roles the norm children may play, likeliest first: one weightless norm is q's and k's
    (Llama 4's text qk_norm), two are q's and k's, three q's, k's and v's (Gemma 4's weightless v_norm)."""
    if not norms:
        yield {}
        return
    if len(norms) == 1:  # one weightless norm applied to q and to k (Llama 4's text qk_norm)
        yield dict(q_norm=norms[0], k_norm=norms[0], norm_per_head=True)
        return
    letters = "qkv"[:len(norms)]
    for names in sorted(itertools.permutations(norms), key=lambda p: _hint_rank(p, letters)):
        qk = [per for per in _norm_placements(module, names[0], d, heads * d)
              if per in _norm_placements(module, names[1], d, kv * d)]
        vs = _norm_placements(module, names[2], d, kv * d) if len(names) == 3 else [None]
        for per, v_per in itertools.product(qk, vs):
            v = {} if v_per is None else dict(v_norm=names[2], v_norm_per_head=v_per)
            yield dict(q_norm=names[0], k_norm=names[1], norm_per_head=per, **v)


def _dropout_roles(module: nn.Module, drops: list[str], out_child: str | None, bias: bool = False):
    """(attention-prob dropout, output dropout) pairs given the output Dropout child the eval probe
    found. The prob dropout is a float attribute or another Dropout child (its ``.p``); without an
    output child, a float attribute may be a functional dropout on the output (Starcoder2)."""
    floats = _probe.float_dropouts(module)
    probs = [*floats, *(n for n in drops if n != out_child), None]
    outs = [out_child] if out_child is not None else [None, *floats]
    if bias:  # real dropouts in its probes (identities in eval): any child may be the output's too
        outs = [None, *floats, *drops]
    for out in outs:
        for prob in probs:
            if prob is None or prob != out:
                yield prob, out
