"""Fused MoE blocks and transformers' experts implementation (``config._experts_implementation``,
``model.set_experts_implementation(...)``): transformers 5 dispatches a sparse MoE block's experts to
an implementation the config names ("eager", "grouped_mm", "batched_mm", ...). A block TorchFuser fused
runs its own router top-k and grouped expert kernels instead, so that setting does not reach it; the
report says so on every model with fused MoE blocks, and says it again, louder, where the setting was
changed after ``optimize`` (a call that had no effect on them). ``optimize(model, exclude=['moe'])``
(which restores the fused blocks and fuses the rest afresh) or ``restore(model)`` gives transformers'
experts back.
"""
from __future__ import annotations

from torch import nn

from torchfuser.report import FusionReport

KEY = "_torchfuser_experts_implementation"  # {fused MoE block: the experts implementation at optimize}
HEAD = "moe experts: "
CHANGED = f"{HEAD}set_experts_implementation("  # the note made anew at each report


def _implementations(model: nn.Module, result: FusionReport) -> dict[str, object]:
    """{fused MoE block: its experts' config._experts_implementation now (None where there is none)}."""
    found = {}
    for e in result.fused:
        if e.pattern != "moe":
            continue
        block = model.get_submodule(e.name)
        experts = getattr(getattr(block, "spec", None), "experts", None)
        config = getattr(block._modules.get(experts), "config", None) if experts else None
        found[e.name] = getattr(config, "_experts_implementation", None)
    return found


def note(model: nn.Module, result: FusionReport) -> None:
    """At optimize: the note on the fused MoE blocks, and the implementation each found."""
    result.notes = [n for n in result.notes if not n.startswith(HEAD)]
    found = _implementations(model, result)
    forget(model)
    if not found:
        return
    model.__dict__[KEY] = found
    impls = sorted({repr(v) for v in found.values() if v is not None})
    now = f" (config._experts_implementation is {', '.join(impls)})" if impls else ""
    result.notes.append(
        f"{HEAD}the {len(found)} fused MoE blocks run TorchFuser's grouped expert kernels, not transformers' "
        f"experts implementation{now}: model.set_experts_implementation(...) does not change them; "
        "optimize(model, exclude=['moe']) or restore(model) runs transformers' experts again")


def changed(model: nn.Module, result: FusionReport) -> list[str]:
    """At report: a note where ``set_experts_implementation`` was called since optimize (no effect on them)."""
    was = model.__dict__.get(KEY)
    if not was:
        return []
    now = _implementations(model, result)
    moved = {n: v for n, v in now.items() if n in was and v != was[n]}
    if not moved:
        return []
    impls = ", ".join(sorted({repr(v) for v in moved.values()}))
    return [f"{CHANGED}{impls}) was called after optimize and has no effect on the {len(moved)} fused MoE blocks: "
            "they still run TorchFuser's kernels (optimize(model, exclude=['moe']) or restore(model) runs "
            "transformers' experts)"]


def forget(model: nn.Module) -> None:
    model.__dict__.pop(KEY, None)
