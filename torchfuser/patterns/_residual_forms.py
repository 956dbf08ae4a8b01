"""The residual-norm pattern's forms beyond the plain pre-norm layer (``patterns.residual_norm``): blocks passed
the residual (BLOOM, MPT), an MLP returning a tuple (GPT-OSS), a residual scale (Granite), dropouts between the
blocks placed where the fused forward applies them."""
from __future__ import annotations

import torch

from torchfuser.patterns import _probe, _residual_dropout, _residual_scale

_POST_BLOCK = ("its norms normalise each block's output before its residual add (OLMo-2's post-block norms: s = x + "
               "norm(attention(x)), then s + norm(mlp(s)))")


def post_block_limits(probe, markers: dict, dropouts: tuple, scaled, passes: dict) -> str | None:
    """Why a post-block layer (``ResidualNormSpec.post_block``) is not fused, or None: only RMSNorms (the norm-then-add
    kernel is ``rms_norm_add``), two blocks, no dropout between them, no residual scale or block adding the residual
    (nor a float attribute its forward reads: ``_residual_scale`` reads pre-norm factors only), no third block or
    sandwich norms."""
    from torchfuser.patterns._residual_roles import norm_kind  # (imports the norm patterns: not at this module's import)

    module, roles = probe.module, probe.roles
    kinds = {norm_kind(module._modules[roles[r]]) for r in ("norm_in", "norm_mid")}
    if kinds != {"rms"}:
        return _POST_BLOCK + (", and they are LayerNorms (or an identity): the norm-then-add kernel (rms_norm_add) is "
                              "an RMSNorm's, none is built for LayerNorm")
    if any(dropouts):
        return _POST_BLOCK + ", with a dropout between its blocks, which the fused forward does not apply"
    if scaled or any(passes.values()) or _reads_floats(probe, markers):
        return _POST_BLOCK + (", with a residual scale or a block adding the residual itself besides, which the fused "
                              "forward does not combine with them")
    if {"mlp2", "tail_in", "post_attention_norm", "act"} & set(roles):
        return _POST_BLOCK + (", with a second MLP, a third block or an inline MLP besides, which the fused forward "
                              "does not combine with them")
    return None



def _reads_floats(probe, markers: dict) -> list[str]:
    """The layer's float attributes (not dropouts) that change its output when set to another value: a residual scale
    the post-block form does not follow (the fused forward would not read it)."""
    read = []
    for name, value in vars(probe.module).items():
        if not isinstance(value, float) or isinstance(value, bool) or "drop" in name:
            continue
        probe.attrs = {name: 0.375 if value != 0.375 else 0.625}
        try:
            same = probe.kind(probe.split(probe.run(0.0, **markers)[0])[0]) == "post_block"
        except Exception:  # noqa: BLE001 - read in a way the probe cannot follow
            same = False
        finally:
            probe.attrs = {}
        if not same:
            read.append(name)
    return read


def passes_residual(probe, calls: dict, role: str) -> bool:
    """Whether the block in ``role`` gets a second positional tensor of the layer's shape (its residual: the
    probe's stand-in adds it, as BLOOM's attention and MLP and MPT's MLP do, and the formula checks which)."""
    firsts = [c[0] for c in calls.get(role, [])[:1]]
    return any(len(pos) == 2 and isinstance(pos[1], torch.Tensor) and pos[1].shape == probe.x.shape for pos in firsts)


def passed_residual_reason(probe, calls: dict) -> str:
    """Why a layer whose blocks are passed a residual (and add it themselves) is not the fused form."""
    first = "its attention or MLP is passed a residual and adds it itself (BLOOM's and MPT's blocks do), but "
    residuals = [pos[1] for r in ("attention", "mlp") for pos, _ in calls.get(r, [])[:1] if len(pos) == 2]
    if any(_probe.close(t, probe.fns["norm_in"](probe.x)) for t in residuals):
        return first + ("the residual is the norm's output, not the layer's input (BLOOM's apply_residual_connection_"
                        "post_layernorm): h = n + attention(n) with n = norm(x), a form no pattern fuses")
    mlp = calls.get("mlp", [])[:1]
    if probe.roles["norm_in"] == probe.roles["norm_mid"] and mlp and len(mlp[0][0]) == 2 and mlp[0][0][1] is probe.x:
        return first + ("the module is not a whole pre-norm layer of that form: its blocks are a norm, an attention and "
                        "an output block adding the input (a pre-LN BERT attention sublayer: x + output(attention("
                        "norm(x))), whose MLP half sits in a sibling module), a form no pattern fuses")
    return first + ("with stand-ins adding it the layer is not the pre-norm x + attention(norm(x)), then "
                    "+ mlp(norm(·)), a form no pattern fuses")


def mlp_tuple_kind(probe, markers: dict):
    """(the layer's form, its output, the calls) where the layer takes the first of a tuple its MLP returns
    (GPT-OSS's ``hidden_states, _ = self.mlp(…)``: the MoE block's router scores after its output), else None."""
    probe.mlp_tuple = True
    try:
        out, calls = probe.run(0.0, **markers)
        kind = probe.kind(probe.split(out)[0])
    except Exception:
        kind = None
    if kind is None:
        probe.mlp_tuple = False
        return None
    return kind, probe.split(out)[0], calls


def mlp_flat_view(probe, markers: dict, kind: str) -> bool:
    """Whether the layer views a tuple-returning MLP's output back to its input's shape (Llama 4's
    ``residual + hidden_states.view(residual.shape)`` after a MoE block returning (tokens, hidden) rows): the
    formula still holds with the stand-in MLP's output flattened."""
    probe.mlp_flat = True
    try:
        out, _ = probe.run(0.0, **markers)
        return probe.kind(probe.split(out)[0]) == kind
    except Exception:
        return False
    finally:
        probe.mlp_flat = False


def scaled_kind(probe, markers: dict, out, kind: str | None):
    """(the layer's form, (attention's, MLP's) residual scale attribute) where each block's output is added
    times a float attribute of the layer (Granite, MiniCPM3: ``_residual_scale``), else None. For a layer
    already of a form (``kind``), only an attribute at 1.0 today is looked for (Granite's default multiplier:
    set later, the fused forward must follow it)."""
    if not isinstance(out, torch.Tensor) or kind == "post":
        return None
    if kind is not None:
        if not any(v == 1.0 for v in vars(probe.module).values() if isinstance(v, float)):
            return None
        found = _residual_scale.scales(probe, markers)
        return None if found is None or found == (None, None) else (kind, found)
    found = _residual_scale.scales(probe, markers)
    if found is None or found == (None, None):
        return None
    probe.scales = tuple(1.0 if n is None else float(getattr(probe.module, n)) for n in found)
    kind = probe.kind(out)
    if kind is None:
        probe.scales = (1.0, 1.0)
        return None
    return kind, found


def dropout_places(probe, kind: str, dropouts: tuple, passes: dict, markers: dict):
    """(attention's, MLP's, their sum's, an inline MLP's inner) dropout when the layer's dropouts between its blocks have a place the fused
    forward can apply them at (``_residual_dropout``), else None; not on a block that adds the residual itself."""
    if not dropouts or probe.scales != (1.0, 1.0):  # (where a scaled block's dropout acts is not looked for)
        return None
    found = _residual_dropout.places(probe, kind, [*dropouts[0], *dropouts[1]], markers)
    if found is None or any(d is not None and passes.get(r) for d, r in zip(found, ("attention", "mlp"))):
        return None
    return found
