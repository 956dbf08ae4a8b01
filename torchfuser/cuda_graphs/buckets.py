"""Length buckets: one set of graphs serves every sequence length that rounds up to the same bucket.

A call of sequence length S replays the graphs captured for length L = ``bucket_length(S)`` ≥ S:
its tensors are copied into the first S positions of the graphs' static buffers and the rest of
each buffer is filled so that the S real positions compute exactly what the unpadded call
computes — the same values, and gradients that get no contribution from the padding:

- hidden states, rotary cos/sin and other float tensors along the sequence: zeros;
- position ids, cache positions and other integer tensors: the positions go on (S, S+1, …), so
  nothing looks like a new packed sample starting;
- a 4-D attention mask (B, h, S, S): the real rows see none of the padded keys; a padded row sees
  the keys up to itself (causal), so that no row is all-masked (its softmax would be NaN, and a
  NaN times a zero gradient is still NaN in the weights' gradients).

Real queries then never attend to padded keys (a causal decoder's attention, or the mask), and every
other op is per position, so a padded position's gradient is exactly zero. That is an assumption about
the layer, so it is checked once per stack, before the first padded capture: layer 0 is run on the
padded call twice, the padding filled with zeros and then with noise, and its real rows must not
change (any leak of the padding into them would), and must equal the unpadded call's to rounding.
A layer that fails (bidirectional attention, an MoE with token capacities) gets graphs per exact length.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from torch import Tensor

KEEP, SEQ0, SEQ1, MASK = "keep", "seq0", "seq1", "mask"


@dataclass(frozen=True)
class GraphOptions:
    """``optimize(model, cuda_graphs=GraphOptions(...))``; ``cuda_graphs=True`` takes these defaults.

    pad_lengths: round each call's sequence length up to a bucket and replay that bucket's graphs
        (False: one set of graphs per exact length).
    per_octave: bucket lengths per doubling of the length: with 4, lengths 1025–2048 fall in the
        buckets 1280, 1536, 1792, 2048 (at most 25 % padding, 12 % on average); lengths are at least
        multiples of 8.
    max_buckets: sets of graphs kept per stack of layers; a new length beyond it drops the least
        recently used set (its memory goes back to the stack's pool for the next capture).
    pool_gib: a bound on the memory the kept sets hold (activations, gradients and scratch of each
        bucket's capture); least recently used sets are dropped to stay within it. None: no bound
        but ``max_buckets``.
    """

    pad_lengths: bool = True
    per_octave: int = 4
    max_buckets: int = 8
    pool_gib: float | None = None

    def __post_init__(self):
        if not isinstance(self.per_octave, int) or self.per_octave < 1:
            raise ValueError(f"GraphOptions.per_octave must be an int ≥ 1, got {self.per_octave!r}")
        if not isinstance(self.max_buckets, int) or self.max_buckets < 1:
            raise ValueError(f"GraphOptions.max_buckets must be an int ≥ 1, got {self.max_buckets!r}")
        if self.pool_gib is not None and not self.pool_gib > 0:
            raise ValueError(f"GraphOptions.pool_gib must be a positive number of GiB or None, got {self.pool_gib!r}")


def bucket_length(s: int, per_octave: int = 4) -> int:
    """The smallest multiple of max(8, 2^⌊log₂ s⌋ / per_octave) that is ≥ s."""
    step = max(8, (1 << (max(s, 1).bit_length() - 1)) // per_octave)
    return math.ceil(s / step) * step


@dataclass(frozen=True)
class Padding:
    """How one call's tensors map to its graphs' static buffers: real length s, bucket length l, and per
    tensor one of KEEP (as is), SEQ0 / SEQ1 (padded along dim 0 / 1), MASK (a 4-D attention mask)."""

    s: int
    l: int
    rules: tuple[str, ...]

    @staticmethod
    def exact(tensors) -> "Padding":
        return Padding(0, 0, (KEEP,) * len(tensors))

    @property
    def pads(self) -> bool:
        return self.l != self.s

    def shape(self, t: Tensor, rule: str) -> tuple[int, ...]:
        shape = list(t.shape)
        if rule == SEQ0:
            shape[0] = self.l
        elif rule == SEQ1:
            shape[1] = self.l
        elif rule == MASK:
            shape[-2:] = [self.l, self.l]
        return tuple(shape)

    def sample(self, tensors, noise: bool = False) -> list[Tensor]:
        """New tensors of the bucket's shapes holding ``tensors``, padded (the tails random with ``noise``)."""
        out = []
        for t, rule in zip(tensors, self.rules):
            buf = t if rule == KEEP else t.new_zeros(self.shape(t, rule))
            if rule != KEEP:
                fill(buf, t, rule, self.s, noise)
            out.append(buf.detach().requires_grad_(t.requires_grad) if buf is not t else t)
        return out

    def real(self, t: Tensor, rule: str) -> Tensor:
        """A view of the real positions of a static tensor padded by ``rule``."""
        if not self.pads or rule == KEEP:
            return t
        if rule == MASK:
            return t[..., : self.s, : self.s]
        return t.narrow(0 if rule == SEQ0 else 1, 0, self.s)

    def unpad(self, out: Tensor) -> Tensor:
        """A view of a static output's real positions (outputs run along dim 1, as the hidden states)."""
        if self.pads and out.dim() >= 2 and out.shape[1] == self.l:
            return out[:, : self.s]
        return out


def padding(layout, tensors, options: GraphOptions) -> Padding | str:
    """This call's Padding, or why its lengths cannot be padded (then its graphs are per exact length)."""
    if not options.pad_lengths:
        return "lengths are not padded (GraphOptions(pad_lengths=False))"
    names = [e[0] for e in layout for _ in range(1 if e[1] == "t" else e[2] if e[1] == "seq" else 0)]
    if not tensors or tensors[0].dim() != 3 or names[0] not in (0, "hidden_states"):
        return "the layer's first argument is not a (batch, sequence, hidden) tensor"
    s = tensors[0].shape[1]
    rules = [SEQ1]
    for name, t in zip(names[1:], tensors[1:]):
        if name == "attention_mask":
            usable = t.dtype == torch.bool or t.is_floating_point()
            if t.dim() != 4 or tuple(t.shape[-2:]) != (s, s) or not usable:
                return f"an attention mask of shape {tuple(t.shape)} (only (batch, heads, {s}, {s}) masks are padded)"
            rules.append(MASK)
            continue
        at = [d for d, n in enumerate(t.shape) if n == s]
        if not at:
            rules.append(KEEP)
        elif at[0] == 1 and t.dim() >= 2:
            rules.append(SEQ1)
        elif at == [0] and t.dim() == 1:
            rules.append(SEQ0)
        else:
            return f"argument {name!r} of shape {tuple(t.shape)} has the sequence length {s} where it cannot be padded"
    return Padding(s, bucket_length(s, options.per_octave), tuple(rules))


@torch.no_grad()
def fill(static: Tensor, t: Tensor, rule: str, s: int, noise: bool = False) -> None:
    """Write ``t`` into ``static`` (of the bucket's shape) and fill the padding (module docstring)."""
    if rule == KEEP:
        static.copy_(t)
        return
    if rule == MASK:
        _fill_mask(static, t, s)
        return
    dim = 0 if rule == SEQ0 else 1
    n = static.shape[dim]
    static.narrow(dim, 0, s).copy_(t)
    if n == s:
        return
    tail = static.narrow(dim, s, n - s)
    if t.is_floating_point():
        tail.normal_() if noise else tail.zero_()
    elif t.dtype == torch.bool:
        tail.zero_()
    else:
        ramp = torch.arange(1, n - s + 1, device=t.device, dtype=t.dtype)
        tail.copy_(t.narrow(dim, s - 1, 1) + (ramp if dim == 0 else ramp.view(1, -1, *[1] * (t.dim() - 2))))


def _fill_mask(static: Tensor, t: Tensor, s: int) -> None:
    n = static.shape[-1]
    static[..., :s, :s].copy_(t)
    if n == s:
        return
    if t.dtype == torch.bool:
        allowed, blocked = True, False
    else:
        allowed, blocked = 0.0, torch.finfo(t.dtype).min
    static[..., :s, s:].fill_(blocked)
    rows = torch.arange(s, n, device=t.device)[:, None]
    causal = torch.arange(n, device=t.device)[None, :] <= rows
    tail = causal if t.dtype == torch.bool else torch.where(causal, allowed, blocked).to(t.dtype)
    static[..., s:, :].copy_(tail)


@torch.no_grad()
def check(forward, layout, tensors, pad: Padding, join) -> str | None:
    """None when padding is exact for this layer (module docstring), else why not. ``forward`` is
    layer 0's own forward; it runs in eval mode (no dropout) three times: unpadded, padded with zeros,
    padded with noise."""
    def run(ts):
        args, kwargs = join(layout, ts)
        out = forward(*args, **kwargs)
        return [o for o in (out if isinstance(out, (tuple, list)) else (out,)) if isinstance(o, Tensor)]

    real, zeros, noisy = run(list(tensors)), run(pad.sample(tensors)), run(pad.sample(tensors, noise=True))
    if len(real) != len(zeros):
        return "the padded call returned other outputs"
    for r, z, q in zip(real, zeros, noisy):
        z, q = pad.unpad(z), pad.unpad(q)
        if z.shape != r.shape:
            return f"an output of shape {tuple(r.shape)} came back as {tuple(z.shape)} when padded"
        scale = r.detach().abs().max().float().clamp_min(1e-30)
        if not torch.isfinite(z).all() or (z - q).abs().max() > 1e-6 * scale:
            return "the padding changed the real positions' outputs (attention that is not causal, or tokens that interact)"
        tol = 1e-4 if r.dtype in (torch.float32, torch.float64) else 2e-2
        if (z.float() - r.float()).abs().max() > tol * scale:
            return "the padded call's real positions differ from the unpadded call's"
    return None
