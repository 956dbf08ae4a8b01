"""The public entry points: optimize, restore, report."""
from __future__ import annotations

import sys

from torch import nn

from torchfuser import backends, cuda_graphs as _cuda_graphs, patterns as _patterns, unwrap, walker
from torchfuser.modules import fallbacks, fp8 as _fp8, fp8_step as _fp8_step, packed as _packed
from torchfuser.modules.base import loaded_fsdp
from torchfuser.modules.lm_head import FusedLMHeadLoss
from torchfuser.report import FusionReport

__all__ = ["optimize", "restore", "report"]


_COMPILE_NOTE = (
    "torch.compile with Inductor: fused attention whose mask is exactly causal and built from constants runs "
    "SDPA's causal kernels, with grouped k/v heads unrepeated (a process-wide pre-grad pass in "
    "torch._inductor.config.pre_grad_custom_pass, active while a fused model lives: restore() of the last one "
    "takes it out, torchfuser.compiler.inductor_pass.uninstall() at once)"
)


def _check_model(model) -> None:
    if not isinstance(model, nn.Module):
        raise TypeError(f"torchfuser expects a torch.nn.Module, got {type(model).__name__}")


def _check_not_flattened(model: nn.Module) -> None:
    fsdp = loaded_fsdp()
    if fsdp is not None and any(isinstance(m, fsdp.FullyShardedDataParallel) for m in model.modules()):
        raise ValueError(
            "the model is already wrapped in FullyShardedDataParallel, whose flattened parameter shards "
            "fused modules cannot read: call torchfuser.optimize(model) before wrapping it (the fused "
            "modules hold the original parameters, so FSDP flattens and shards them as usual)")


def optimize(
    model: nn.Module,
    *,
    backend: str = "auto",
    patterns=None,
    exclude=(),
    filter_fn=None,
    strict: bool = False,
    verbose: bool = False,
    cuda_graphs: "bool | _cuda_graphs.GraphOptions" = False,
    autotune: bool = False,
    fp8: str | None = None,
    fp8_lm_head: bool = False,
    fp8_weights: str = "per_call",
) -> nn.Module:
    """Swap the standard blocks of ``model`` for fused modules, in place; returns ``model``.

    Parameters and ``state_dict`` keys stay exactly as they were. Calling it again changes
    nothing already fused but its backend, when another is given. ``torchfuser.report(model)``
    says what was fused and what was skipped, and why; ``torchfuser.restore(model)`` undoes it.
    Nothing outside ``model`` changes (every random generator comes out as it went in), and a
    swap that fails leaves the model as it was.

    backend: ``"auto"`` (per device: triton on CUDA, mlir on CPU, reference elsewhere),
        ``"reference"``, ``"triton"`` or ``"mlir"``.
    patterns / exclude: pattern names to use / to leave out (see ``torchfuser.PATTERNS``).
    filter_fn: ``filter_fn(qualified_name, module) -> bool`` is asked about every candidate block
        (the name as in ``model.named_modules()``; ``""`` for the model itself, the LM head + loss
        candidate); a block it refuses stays as it is and is reported skipped, "excluded by filter_fn".
    strict: raise, before changing anything, if any candidate block would be skipped (but for
        those ``filter_fn`` excludes).
    verbose: print the report.
    cuda_graphs: also capture each stack of fused layers (the decoder layers) into CUDA graphs at
        the first training step and replay them after: far fewer host launches, for models whose
        step is bound by the host. Costs memory (activations and gradients stay allocated) and
        pads each call's sequence length up to a length bucket with graphs of its own (bounded in
        number and memory: pass ``torchfuser.GraphOptions(...)`` instead of True to set the bounds);
        see ``torchfuser.cuda_graphs`` and the report's notes.
    autotune: at each fused block's first training call, time it against its original on that
        call's inputs and keep the faster, per block kind and shape (``torchfuser.autotune``).
    fp8: ``"rowwise"``, ``"tensorwise"`` or ``"blockwise"``: the fused attention and MLP blocks'
        projections run FP8 (e4m3) GEMMs forward and backward, with current scaling per row, per tensor,
        or per 128-element block along each GEMM's inner dimension (128 × 128 blocks for weights;
        Hopper only, sides in multiples of 128; experimental); the LM head stays bf16 unless
        ``fp8_lm_head=True``. Needs bf16 (autocast or bf16 weights) and a GPU of compute capability
        ≥ 8.9 (or the CPU, for tests); ``None`` (the default, and on a second call) turns it off. See
        ``torchfuser.modules.fp8``.
    fp8_lm_head: with ``fp8``, the fused LM head + loss (``lm_head_loss``) runs its three products (the
        logits, dh, dW) as FP8 GEMMs too, with the same recipe: lossy where the vocabulary is large
        (docs/usage.md#fp8); a call not in bf16, or whose tokens, hidden size or vocabulary are not
        multiples of 16, runs bf16 and is counted in the report. On the CPU it runs on the reference
        backend (MLIR has no FP8 GEMMs). Needs ``fp8`` (else ValueError); ``False`` (the default, and
        on a second call without it) keeps the head bf16.
    fp8_weights: when the trainable weights' FP8 copies are made: ``"per_call"`` (the default: at every
        call, always right) or ``"per_step"``: kept until any ``torch.optim`` optimizer steps, so once per
        optimizer step rather than per micro-batch or recomputed checkpoint, at 2 bytes a weight held
        between calls. It assumes the weights change only through optimizer steps, ``load_state_dict``
        or in-place ops on the parameters, never by writes to ``param.data``. See
        ``torchfuser.modules.fp8_step``.
    """
    _check_model(model)
    _check_not_flattened(model)
    if not isinstance(cuda_graphs, (bool, _cuda_graphs.GraphOptions)):
        raise TypeError(f"cuda_graphs must be True, False or a torchfuser.GraphOptions, got {type(cuda_graphs).__name__}")
    backend = backends.check_name(backend)
    if not isinstance(fp8_lm_head, bool):
        raise TypeError(f"fp8_lm_head must be True or False, got {type(fp8_lm_head).__name__}")
    if fp8_lm_head and fp8 == "blockwise":
        raise ValueError("fp8_lm_head=True runs the LM head's GEMMs rowwise or tensorwise, not blockwise: pass "
                         "fp8='rowwise' or 'tensorwise' with it, or leave fp8_lm_head off")
    if fp8_lm_head and fp8 is None:
        raise ValueError("fp8_lm_head=True runs the LM head's GEMMs with the projections' FP8 recipe: pass "
                         "fp8='rowwise' or fp8='tensorwise' too")
    fp8 = _fp8.check(fp8, next((p.device for p in model.parameters()), None))
    per_step = _fp8.check_weights(fp8_weights, fp8)
    chosen = _patterns.select(patterns, exclude)
    if filter_fn is not None and not callable(filter_fn):
        raise TypeError(f"filter_fn must be a callable (qualified_name, module) -> bool, got {type(filter_fn).__name__}")
    root = model
    path, inner = unwrap.optimized(model)
    if inner is not None and path:  # optimized, then wrapped (PEFT, DDP): go on in the model optimize was given
        model = inner
    st = walker.state(model)
    rebackend = st is not None and st.backend != backend
    result = walker.fuse(model, chosen, backend, strict, filter_fn)
    if not walker.state(model):
        model.__dict__["_torchfuser_last_report"] = result
    if any(e.pattern == "attention" for e in result.fused):
        from torchfuser.compiler import inductor_pass  # imports Inductor's config: only when needed

        inductor_pass.hold(model)
        if _COMPILE_NOTE not in result.notes:
            result.notes.append(_COMPILE_NOTE)
    if rebackend and _cuda_graphs.describe(model) is not None:
        kept = _cuda_graphs.options(model)
        _cuda_graphs.remove(model)  # the captured graphs replay the old backend's kernels: capture anew
        cuda_graphs = cuda_graphs if isinstance(cuda_graphs, _cuda_graphs.GraphOptions) else kept
    _set_fp8(model, fp8, result, per_step, fp8_lm_head, backend)
    if cuda_graphs:
        chosen_graphs = cuda_graphs if isinstance(cuda_graphs, _cuda_graphs.GraphOptions) else None
        result.notes += [n for n in _cuda_graphs.install(model, chosen_graphs) if n not in result.notes]
    if autotune:
        from torchfuser import autotune as _autotune

        _autotune.apply(model)
    if verbose:
        from rich.console import Console

        Console().print(result)
    return root


_FP8_HEAD = "fp8: "
_FP8_KINDS = ("attention", "gated_mlp", "mlp")


def _set_fp8(model: nn.Module, recipe: str | None, result: FusionReport, per_step: bool, lm_head: bool,
             backend: str) -> None:
    """FP8 GEMMs on (or off) in the fused attention and MLP blocks and, with ``lm_head``, the fused LM head
    + loss (``FusedLMHeadLoss.fp8``, gone with ``restore``), said in one note of the report; with
    ``per_step`` the weights' copies kept per optimizer step (the step hook held for ``model``)."""
    count, gated, layers, heads = 0, 0, 0, []
    for entry in result.fused:
        module = model.get_submodule(entry.name) if entry.name else model
        # its norms are producers where they are on (modules.residual_norm._maxima)
        layers += entry.pattern == "residual_norm" and _fp8._NORM_PRODUCERS
        if entry.pattern == "lm_head_loss":
            fused = module.__dict__.get("forward")
            if isinstance(fused, FusedLMHeadLoss):
                fused.fp8 = recipe if lm_head else None
                heads.append(module)
            continue
        if entry.pattern not in _FP8_KINDS:
            continue
        if recipe is None:
            module.__dict__.pop("_fp8", None)
        else:
            module.__dict__["_fp8"] = recipe
            count += 1
            # [gate | up] in gate-first order: the MLP's activation is a producer (modules.fp8.producer_maxima)
            gated += entry.pattern == "gated_mlp" and (module.spec.gate_up is None or module.spec.gate_first)
        if per_step:
            module.__dict__["_fp8_per_step"] = True
        else:
            module.__dict__.pop("_fp8_per_step", None)
        module.__dict__.pop("_fp8_weights", None)
    if per_step:
        _fp8_step.hold(model)
    else:
        _fp8_step.release(model)
    result.notes = [n for n in result.notes if not n.startswith(_FP8_HEAD)]
    if recipe is None:
        return
    if not lm_head:
        head = "the LM head stays bf16 (fp8_lm_head=False)"
    elif not heads:
        head = "fp8_lm_head=True, but no LM head + loss was fused (see lm_head_loss in the report)"
    else:
        head = "the LM head + loss runs FP8 GEMMs too (logits, dh, dW; fp8_lm_head=True)"
        param = next(heads[0].parameters(), None)
        if param is not None and param.device.type == "cpu" and backends.resolve(backend, "cpu") == "mlir":
            head += ", on the CPU through the reference backend (MLIR has no FP8 GEMMs)"
    result.notes.append(f"{_FP8_HEAD}{recipe} e4m3 GEMMs (forward and backward) in the projections of {count} fused "
                        f"attention and MLP blocks, where they run in bf16 and are plain nn.Linear; {head}"
                        + ("; trainable weights quantised once per optimizer step (fp8_weights='per_step')" if per_step else "")
                        + (_producers_note(gated, layers) if recipe == "rowwise" else ""))


def _producers_note(gated: int, layers: int) -> str:
    """The fp8 note's clause on the kernels that take their outputs' maxima for the GEMMs (rowwise)."""
    parts = [f"in {gated} gated MLPs the activation's kernels, for the down and gate/up GEMMs"] if gated else []
    if layers:
        parts.append(f"in {layers} decoder layers the norms', for the q/k/v and gate/up GEMMs' inputs and the output "
                     "projection's gradient")
    if not parts:
        return ""
    return ("; " + "; ".join(parts) + ": they take the maxima of the operands they write, where those GEMMs are trainable "
            "plain nn.Linear (no separate amax pass; eager and CUDA graphs)")


def restore(model: nn.Module) -> nn.Module:
    """Put every original module back (the same objects); harmless on an unoptimized model."""
    _check_model(model)
    _, inner = unwrap.optimized(model)  # the model optimize was given, inside a wrapper (PEFT, DDP, compile)
    model = inner if inner is not None else model
    model.__dict__.pop("_torchfuser_last_report", None)
    _cuda_graphs.remove(model)
    _fp8_step.release(model)
    walker.restore(model)
    inductor_pass = sys.modules.get("torchfuser.compiler.inductor_pass")  # not imported: nothing held
    if inductor_pass is not None:
        inductor_pass.release(model)
    return model


_LORA_HEAD = "adapters: "


def _lora_notes(model: nn.Module, result: FusionReport) -> list[str]:
    """Which fused blocks carry active LoRA adapters now (they run inside the fused path)."""
    grouped: dict[tuple[str, str], int] = {}
    for entry in result.fused:
        try:
            module = model.get_submodule(entry.name)
        except AttributeError:  # replaced since (a wrapper's own module)
            continue
        if summary := getattr(module, "lora_summary", None):
            key = (fallbacks.layer_glob(entry.name), summary)
            grouped[key] = grouped.get(key, 0) + 1
    return [f"{_LORA_HEAD}{name}" + (f" ({n} modules)" if n > 1 else "") + f": fused with {summary}"
            for (name, summary), n in grouped.items()]


def report(model: nn.Module) -> FusionReport:
    """The FusionReport of the last ``optimize`` call(s) on ``model``, or on the model inside a wrapper
    (PEFT, DDP / FSDP, torch.compile), with the calls that fell back to an original forward since."""
    _check_model(model)
    path, target = unwrap.optimized(model)
    if target is None:
        return FusionReport(type(model).__name__, notes=[
            "torchfuser.optimize was not called on this model, nor on any module inside it"])
    st = walker.state(target)
    result = st.report if st is not None else target.__dict__[unwrap.LAST_REPORT]
    result.notes = _cuda_graphs.refresh_notes(target, result.notes)  # replays, captures, eager calls
    result.fallbacks = fallbacks.counts(target)
    result.notes = [n for n in result.notes if not n.startswith((fallbacks.HEAD, _LORA_HEAD, _packed.HEAD))]
    result.notes += fallbacks.notes(target) + _lora_notes(target, result) + _packed.notes(target)
    if path:
        return result.with_note(f"optimize was called on {path!r} ({type(target).__name__}) inside this "
                                f"{type(model).__name__}: module names are relative to it")
    return result
