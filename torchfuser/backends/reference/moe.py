"""Mixture-of-experts: the router's top-k, and the routed experts' gated MLPs.

Route (logits (T, E) → weights (T, k) in fp32 (fp64 for fp64 logits), indices (T, k) int64):
    softmax:      s = softmax(l);  choose top-k of s + c (c: a score correction, DeepSeek-V3's bias),
                  within the topk_group groups (of n_group) whose group_top best s + c sum highest;
                  w = s[chosen]
    sigmoid:      the same with s = sigmoid(l)
    softmax_topk: w = softmax(the k largest l)                        (GPT-OSS, Granite)
    then w /= Σw + 1e-20 if renorm, and w *= scale. Only w is differentiable (the choice is not): the
    backward recomputes w from the saved logits and indices.

Experts (x (T, H), w, indices; stacked gate_up (E, 2I, H) and down (E, H, I), or (E, H, 2I) and
(E, I, H) when ``transposed``; optional biases (E, 2I) and (E, H); products in x's dtype, the weights
cast to it inside each pass, so that fp32 parameters under autocast leave no bf16 copy saved for the
backward; gradients in the weights' own dtypes):
    y[t] = Σ_j w[t, j] · (act(x[t] · GUᵀ + b) · Dᵀ + d)   for the expert e = indices[t, j]
act splits h = [gate | up] (``halves``: "gate_up", "up_gate" or "interleaved" as GPT-OSS's
gate = h[::2], up = h[1::2]) and gives silu(g)·u, gelu_tanh(g)·u, or GPT-OSS's clamped SwiGLU
(u.clamp(±limit) + 1) · g·σ(α·g) with g = g.clamp(max=limit). The T·k slots are sorted by expert
(one stable sort, no host sync), the tokens gathered in that order, both products are grouped GEMMs,
and the weighted sum over each token's k slots is taken in fp32 in slot order (deterministic: no
atomics). Saved for the backward: the pre-activation h (S, 2I), the sort order and group offsets;
the gathered x is gathered again there, never kept.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from . import grouped_mm as gmm
from ._autodiff import compute_dtype, value_and_vjp, vjp

_RENORM_EPS = 1e-20  # DeepSeek-V3's; below half an ulp of any softmax top-k sum, so a no-op there


def _scores(logits, scoring: str):
    l = logits.to(compute_dtype(logits))
    return torch.sigmoid(l) if scoring == "sigmoid" else torch.softmax(l, dim=-1)


def choose(logits, correction, top_k: int, scoring: str, n_group: int, topk_group: int, group_top: int):
    """The experts each token goes to, (T, k) int64, best first (ties as torch.topk breaks them)."""
    if scoring == "softmax_topk":
        return logits.to(compute_dtype(logits)).topk(top_k, dim=-1).indices
    choice = _scores(logits, scoring)
    if correction is not None:
        choice = choice + correction.to(choice.dtype)
    if n_group > 1:
        t, e = choice.shape
        grouped = choice.view(t, n_group, e // n_group)
        best = grouped.topk(group_top, dim=-1).values.sum(-1)  # (T, n_group)
        keep = torch.zeros_like(best, dtype=torch.bool).scatter_(1, best.topk(topk_group, dim=-1).indices, True)
        choice = grouped.masked_fill(~keep.unsqueeze(-1), float("-inf")).view(t, e)
    return choice.topk(top_k, dim=-1).indices


def route_weights(logits, indices, scoring: str, renorm: bool, scale: float):
    """The (differentiable) weights of the chosen experts."""
    if scoring == "softmax_topk":
        w = torch.softmax(logits.to(compute_dtype(logits)).gather(-1, indices), dim=-1)
    else:
        w = _scores(logits, scoring).gather(-1, indices)
        if renorm:
            w = w / (w.sum(-1, keepdim=True) + _RENORM_EPS)
    return w * scale if scale != 1.0 else w


def moe_route_fwd(logits, correction, top_k, scoring, renorm, n_group, topk_group, group_top, scale):
    with torch.no_grad():
        indices = choose(logits, correction, top_k, scoring, n_group, topk_group, group_top)
    return route_weights(logits, indices, scoring, renorm, scale).contiguous(), indices.contiguous()


def moe_route_bwd(dw, logits, indices, scoring, renorm, scale):
    (dl,) = vjp(route_weights, (logits,), dw, indices, scoring, renorm, scale)
    return dl.contiguous()


def _halves(h, halves: str):
    if halves == "interleaved":
        return h[..., 0::2], h[..., 1::2]
    a, b = h.chunk(2, dim=-1)
    return (a, b) if halves == "gate_up" else (b, a)


def activation(h, halves: str, act: str, alpha: float, limit: float):
    """(S, 2I) pre-activations → (S, I), computed in fp32 (fp64 for fp64), rounded once."""
    g, u = _halves(h, halves)
    ct = compute_dtype(h)
    g, u = g.to(ct), u.to(ct)
    if act == "silu":
        a = F.silu(g) * u
    elif act == "gelu_tanh":
        a = F.gelu(g, approximate="tanh") * u
    elif act == "clamped_swiglu":
        g = g.clamp(max=limit)
        a = (u.clamp(-limit, limit) + 1) * (g * torch.sigmoid(g * alpha))
    else:
        raise ValueError(f"unknown MoE activation {act!r}")
    return a.to(h.dtype)


def _forward_layouts(gate_up, down, transposed: bool):
    """The weights as the (E, K, N) right operands of the forward's products (views, no copies)."""
    return (gate_up, down) if transposed else (gate_up.transpose(1, 2), down.transpose(1, 2))


def _gathered_bias(bias, ids, dtype):
    return None if bias is None else bias.to(dtype)[ids]


def _slot_sum(rows, inv, t: int, k: int):
    """Rows in expert order (S, N) → the sum over each token's k slots (T, N), in fp32 or fp64."""
    return rows[inv].view(t, k, rows.shape[-1]).to(compute_dtype(rows)).sum(1)


def moe_experts_fwd(x, weights, indices, gate_up, gate_up_bias, down, down_bias, transposed, halves, act,
                    alpha, limit, out_dtype=None):
    """Returns (y (T, H) in out_dtype or x's, h (S, 2I), order (S,) int64, offs (E,) int32)."""
    t, k = indices.shape
    order, offs = gmm.sort_by_expert(indices, gate_up.shape[0])
    token, ids = order // k, indices.reshape(-1)[order]
    gu, dn = _forward_layouts(gate_up.to(x.dtype), down.to(x.dtype), transposed)  # cast here, never saved
    h = gmm.rows(x[token], gu, offs)
    if gate_up_bias is not None:
        h = h + _gathered_bias(gate_up_bias, ids, h.dtype)
    o = gmm.rows(activation(h, halves, act, alpha, limit), dn, offs)
    if down_bias is not None:
        o = o + _gathered_bias(down_bias, ids, o.dtype)
    ws = weights.reshape(-1)[order].to(compute_dtype(o, weights)).unsqueeze(-1)
    y = _slot_sum(o.to(ws.dtype) * ws, gmm.inverse(order), t, k)
    return y.to(out_dtype or x.dtype).contiguous(), h.contiguous(), order, offs


def moe_experts_bwd(dy, x, weights, indices, gate_up, gate_up_bias, down, down_bias, h, order, offs, transposed,
                    halves, act, alpha, limit):
    """(dx, dweights, dgate_up, dgate_up_bias, ddown, ddown_bias); the bias gradients None without biases.

    With o = a · Dᵀ + d per slot and y = Σ w · o: the gradient reaching o is w·g (g = dy of the slot's
    token), so dD = Σ (w·g)ᵀ a, dd = Σ w·g, and dw = ⟨g, o⟩ = ⟨g·D, a⟩ + ⟨g, d⟩ (o itself is not kept).
    """
    t, k = indices.shape
    ct = h.dtype  # the dtype the products ran in
    token, ids, inv = order // k, indices.reshape(-1)[order], gmm.inverse(order)
    f = compute_dtype(h, weights)
    ws = weights.reshape(-1)[order].to(f).unsqueeze(-1)
    g = dy[token].to(ct)
    gu, dn = _forward_layouts(gate_up.to(ct), down.to(ct), transposed)
    u = gmm.rows(g, dn.transpose(1, 2), offs)  # (S, I): g · D
    a, (dh,) = value_and_vjp(activation, (h,), (u.to(f) * ws).to(ct), halves, act, alpha, limit)
    dws = (u.to(f) * a.to(f)).sum(-1)
    if down_bias is not None:
        dws = dws + (g.to(f) * _gathered_bias(down_bias, ids, f)).sum(-1)
    gw = (g.to(f) * ws).to(ct)
    ddown = gmm.k(a.t(), gw, offs) if transposed else gmm.k(gw.t(), a, offs)
    ddown_bias = None if down_bias is None else torch.zeros_like(down_bias, dtype=f).index_add_(0, ids, gw.to(f))
    xs = x[token].to(ct)
    dgate_up = gmm.k(xs.t(), dh, offs) if transposed else gmm.k(dh.t(), xs, offs)
    dgate_up_bias = None if gate_up_bias is None else torch.zeros_like(gate_up_bias, dtype=f).index_add_(0, ids, dh.to(f))
    dx = _slot_sum(gmm.rows(dh, gu.transpose(1, 2), offs), inv, t, k)
    dweights = dws[inv].view(t, k)
    cast = lambda d, like: None if d is None else d.to(like.dtype).contiguous()  # noqa: E731
    return (dx.to(x.dtype).contiguous(), cast(dweights, weights), cast(dgate_up, gate_up),
            cast(dgate_up_bias, gate_up_bias), cast(ddown, down), cast(ddown_bias, down_bias))
