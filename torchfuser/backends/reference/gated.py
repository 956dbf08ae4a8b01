"""Gated activations: swiglu = silu(gate) · up, geglu = gelu_tanh(gate) · up, geglu_erf = gelu(gate) · up
(exact, erf GELU: LLaVA-family projectors, Pixtral's vision MLP); and plain gelu.
The ``*_packed`` variants take one [gate | up] tensor and give its gradient as one tensor."""
from __future__ import annotations

import torch
import torch.nn.functional as F

from ._autodiff import cast, compute_dtype, vjp


def swiglu(gate, up):
    ct = compute_dtype(gate, up)
    return cast(F.silu(cast(gate, ct)) * cast(up, ct), gate.dtype)


def geglu(gate, up):
    ct = compute_dtype(gate, up)
    return (F.gelu(gate.to(ct), approximate="tanh") * up.to(ct)).to(gate.dtype)


def geglu_erf(gate, up):
    ct = compute_dtype(gate, up)
    return (F.gelu(gate.to(ct)) * up.to(ct)).to(gate.dtype)


def geglu_erf_fwd(gate, up):
    return geglu_erf(gate, up).contiguous()


def geglu_erf_bwd(dy, gate, up):
    return tuple(g.contiguous() for g in vjp(geglu_erf, (gate, up), dy))


def geglu_erf_packed_fwd(gate_up):
    return geglu_erf_fwd(*halves(gate_up))


def geglu_erf_packed_bwd(dy, gate_up):
    (d,) = vjp(lambda gu: geglu_erf(*halves(gu)), (gate_up,), dy)
    return d.contiguous()


def gelu(x, approximate: str):
    return F.gelu(x.to(compute_dtype(x)), approximate=approximate).to(x.dtype)


def swiglu_fwd(gate, up):
    return swiglu(gate, up).contiguous()


def swiglu_infer(gate, up):
    """``swiglu_fwd`` for a call with no backward (``ops._call.nograd_forward``): the same values, without the
    cast calls where gate and up are fp32 already and without the copy to a contiguous layout. Tensors of
    their own, never views (called unwrapped)."""
    if gate.dtype == torch.float32 and up.dtype == torch.float32:
        return F.silu(gate) * up
    return swiglu(gate, up)


def swiglu_bwd(dy, gate, up):
    return tuple(g.contiguous() for g in vjp(swiglu, (gate, up), dy))


def geglu_fwd(gate, up):
    return geglu(gate, up).contiguous()


def geglu_bwd(dy, gate, up):
    return tuple(g.contiguous() for g in vjp(geglu, (gate, up), dy))


def halves(gate_up):
    """[gate | up] along the last dim → (gate, up), views."""
    n = gate_up.shape[-1] // 2
    return gate_up[..., :n], gate_up[..., n:]


def swiglu_packed_fwd(gate_up):
    return swiglu_fwd(*halves(gate_up))


def swiglu_packed_bwd(dy, gate_up):
    (d,) = vjp(lambda gu: swiglu(*halves(gu)), (gate_up,), dy)
    return d.contiguous()


def geglu_packed_fwd(gate_up):
    return geglu_fwd(*halves(gate_up))


def geglu_packed_bwd(dy, gate_up):
    (d,) = vjp(lambda gu: geglu(*halves(gu)), (gate_up,), dy)
    return d.contiguous()


def gelu_fwd(x, approximate):
    return gelu(x, approximate).contiguous()


def gelu_bwd(dy, x, approximate):
    (dx,) = vjp(gelu, (x,), dy, approximate)
    return dx.contiguous()
