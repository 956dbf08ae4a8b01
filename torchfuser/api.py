"""The public entry points: optimize, restore, report."""
from __future__ import annotations

import copy
import sys
import warnings

from torch import nn

from torchfuser import backends, cuda_graphs as _cuda_graphs, patterns as _patterns, settings as _settings, transaction
from torchfuser import experts as _experts, head_check, unwrap, walker
from torchfuser.backends import policy as _policy
from torchfuser.modules import decode as _decode, fallbacks, fp8 as _fp8, offload as _offload, packed as _packed
from torchfuser.modules.fp8 import step as _fp8_step
from torchfuser.modules.base import loaded_fsdp
from torchfuser.modules.lm_head import FusedLMHeadLoss
from torchfuser.ops._call import SMALL_NOTE as _SMALL_NOTE, small_calls_note as _small_calls_note
from torchfuser.report import FusionReport

__all__ = ["optimize", "restore", "report"]


_COMPILE_NOTE = (
    "torch.compile with Inductor: fused attention whose mask is exactly causal and built from constants runs "
    "SDPA's causal kernels, with grouped k/v heads unrepeated (a process-wide pre-grad pass in "
    "torch._inductor.config.pre_grad_custom_pass, active while a fused model lives: restore() of the last one "
    "takes it out, torchfuser.compiler.inductor_pass.uninstall() at once)"
)


def _compiled_with_inductor() -> bool:
    """Whether Inductor has run optimize's pre-grad pass on a graph with fused attention in this process:
    the note on that pass is said only then (the pass is process-wide, so it applies to every fused model)."""
    inductor_pass = sys.modules.get("torchfuser.compiler.inductor_pass")
    return inductor_pass is not None and bool(inductor_pass.RECENT)


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


_U = _settings.Unset  # an argument not passed: the earlier call's value, or the default shown


def optimize(
    model: nn.Module,
    *,
    backend: str = _U("auto"),
    patterns=_U(None),
    exclude=_U(()),
    filter_fn=_U(None),
    strict: bool = False,
    verbose: bool = False,
    cuda_graphs: "str | bool | _cuda_graphs.GraphOptions" = _U("auto"),
    autotune: bool = _U(False),
    fp8: str | None = _U(None),
    fp8_lm_head: bool = _U(False),
    fp8_weights: str = _U("per_call"),
    keep_logits: bool = _U(False),
    checkpointing: "bool | str" = _U(False),
) -> nn.Module:
    """Swap the standard blocks of ``model`` for fused modules, in place; returns ``model``.

    Parameters and ``state_dict`` keys stay exactly as they were. ``torchfuser.report(model)`` says
    what was fused and what was skipped, and why; ``torchfuser.restore(model)`` undoes it. Nothing
    outside ``model`` changes (every random generator comes out as it went in), and a call that fails
    anywhere leaves the model, and what it holds process-wide, as it was before the call.

    Calling it again on the same model (``TorchFuserCallback`` does, on a model already optimized) keeps
    every setting the call does not pass (the defaults below are those of a first call): a second
    ``optimize(model)`` changes nothing, and fuses only blocks that the kept ``patterns`` / ``exclude`` /
    ``filter_fn`` select and that are not fused yet (a module added since, say). A setting passed applies
    to every fused block: another backend, FP8 on, off or another recipe, CUDA graphs or autotune on or
    off, other graph options. ``patterns`` / ``exclude`` / ``filter_fn`` passed are the selection from then
    on: blocks they add are fused; where they leave out a block already fused, the model is restored and
    fused afresh with them. ``strict`` and ``verbose`` are about one call and not kept.

    backend: ``"auto"`` (per device: triton on CUDA, mlir on CPU, reference elsewhere),
        ``"reference"``, ``"triton"`` or ``"mlir"``. On a CPU without torch-mlir, ``"auto"`` fuses only the
        LM head + loss and leaves the blocks the reference kernels run no faster than PyTorch as they are, with
        the reason in the report (``backends/policy.py``); ``"reference"`` fuses them all.
    patterns / exclude: pattern names to use / to leave out (see ``torchfuser.PATTERNS``).
    filter_fn: ``filter_fn(module, fqn) -> bool``, in the order of torchao's ``quantize_``, is asked about
        every candidate block (``fqn`` its qualified name as in ``model.named_modules()``; ``""`` for the
        model itself, the LM head + loss candidate); a block it refuses stays as it is and is reported
        skipped, "excluded by filter_fn". A filter written in the old order ``(qualified_name, module)``
        is refused with a TypeError where it raises on a module, or refuses every block but would accept
        one with its arguments swapped.
        Kept with the model for later calls (``filter_fn=None`` passed drops it); a model saved whole
        keeps it if it pickles (a module-level function), else later calls fuse nothing new until one
        passes ``filter_fn`` again.
    strict: raise, before changing anything, if any candidate block would be skipped (but for
        those ``filter_fn`` excludes).
    verbose: print the report.
    cuda_graphs: ``"auto"`` (the default): on a CUDA device, each stack of fused layers runs a few
        training steps eagerly, then captured, each timed with CUDA events; it keeps its graphs only where
        the replayed steps are faster and their memory stays within a bound, and runs eagerly wherever
        a graph could surprise (hooks, output_hidden_states / output_attentions, inference calls between
        training steps, a second backward); see ``torchfuser.cuda_graphs.auto``. Off on other devices.
        ``True``: always capture each stack of fused layers (the decoder layers) into CUDA graphs at
        the first training step and replay them after: far fewer host launches, for models whose
        step is bound by the host. Costs memory (activations and gradients stay allocated) and
        pads each call's sequence length up to a length bucket with graphs of its own (bounded in
        number and memory: pass ``torchfuser.GraphOptions(...)`` instead of True to set the bounds);
        see ``torchfuser.cuda_graphs`` and the report's notes. A later call that fuses more blocks or
        changes the backend or the options captures anew; one that changes nothing keeps the graphs.
    autotune: at each fused block's first training call, time it against its original on that
        call's inputs and keep the faster, per block kind and shape (``torchfuser.autotune``).
    fp8: ``"rowwise"``, ``"tensorwise"`` or ``"blockwise"``: the fused attention and MLP blocks'
        projections run FP8 (e4m3) GEMMs forward and backward, with current scaling per row, per tensor,
        or per 128-element block along each GEMM's inner dimension (128 × 128 blocks for weights;
        Hopper only, sides in multiples of 128; experimental); the LM head stays bf16 unless
        ``fp8_lm_head=True``. Needs bf16 (autocast or bf16 weights) and a GPU of compute capability
        ≥ 8.9 (or the CPU, for tests); ``None`` (the default) is off, and ``fp8=None`` passed to a later
        call turns it off, with ``fp8_lm_head`` and ``fp8_weights`` back to their defaults unless passed
        too. See ``torchfuser.modules.fp8``.
    fp8_lm_head: with ``fp8``, the fused LM head + loss (``lm_head_loss``) runs its three products (the
        logits, dh, dW) as FP8 GEMMs too, with the same recipe: lossy where the vocabulary is large
        (docs/usage.md#fp8); a call not in bf16, or whose tokens, hidden size or vocabulary are not
        multiples of 16, runs bf16 and is counted in the report. On the CPU it runs on the reference
        backend (MLIR has no FP8 GEMMs). Needs ``fp8`` rowwise or tensorwise (else ValueError); ``False``
        (the default) keeps the head bf16.
    keep_logits: the fused LM head + loss (``lm_head_loss``) of a training call with labels returns the
        logits too: the model's own forward runs its head as the original does (same matmul in the
        autocast dtype, same scale / softcap, with their gradient) and the loss stays fused. Costs one
        more matmul and the logits' memory (still without the original's float32 copy and its gradient).
        ``False`` (the default): the logits are never built and the output's ``logits`` is None (a
        ``return_dict=False`` tuple leaves them out). Eval mode and calls without labels are unchanged.
    checkpointing: ``"offload"``: each fused decoder layer keeps only its input for the backward, on the host
        (pinned memory, copied on a side stream; on the CPU the input itself), and runs again in the backward
        (``torchfuser.modules.offload``); ``True``: the same with the input kept where it is; ``False`` (the
        default): off. Where Hugging Face's gradient checkpointing is enabled on a layer, it runs there instead
        (never both). Not with ``cuda_graphs`` (ValueError) nor under torch.compile (RuntimeError).
    fp8_weights: when the trainable weights' FP8 copies are made: ``"per_call"`` (the default: at every
        call, always right) or ``"per_step"``: kept until any ``torch.optim`` optimizer steps, so once per
        optimizer step rather than per micro-batch or recomputed checkpoint, at 2 bytes a weight held
        between calls. It assumes the weights change only through optimizer steps, ``load_state_dict``
        or in-place ops on the parameters, never by writes to ``param.data``. See
        ``torchfuser.modules.fp8.step``.
    """
    _check_model(model)
    _check_not_flattened(model)
    root = model
    path, inner = unwrap.optimized(model)
    if inner is not None and path:  # optimized, then wrapped (PEFT, DDP): go on in the model optimize was given
        model = inner
    before = _settings.of(model)
    st = walker.state(model)
    if before is None and st is not None:  # fused and saved whole by a version that kept no settings
        before = _settings.Settings(backend=st.backend)
    s = _settings.merge(before, backend=backend, patterns=patterns, exclude=exclude, filter_fn=filter_fn,
                        cuda_graphs=cuda_graphs, autotune=autotune, fp8=fp8, fp8_lm_head=fp8_lm_head,
                        fp8_weights=fp8_weights, keep_logits=keep_logits, checkpointing=checkpointing)
    device = next((p.device for p in model.parameters()), None)
    recipe = _fp8.check(s.fp8, device)
    _warn_idle(device, before, fp8=(fp8, s.fp8), cuda_graphs=(cuda_graphs, s.cuda_graphs))
    per_step = _fp8.check_weights(s.fp8_weights, recipe)
    chosen = _patterns.select(s.patterns, s.exclude)
    # Only a call that passes a selection can narrow it (a pattern unregistered since leaves its blocks fused).
    reselect = not all(isinstance(v, _U) for v in (patterns, exclude, filter_fn))
    with transaction.atomic(model):
        result, dropped = _apply(model, before, s, chosen, strict, per_step, reselect)
    for stack in dropped:  # graphs no longer replayed: their memory goes back (after the call, which can no longer fail)
        stack.sets.clear()
    if verbose:
        from rich.console import Console

        Console().print(result)
    return root


_IDLE_ON_CPU = {
    "fp8": "the FP8 rounding is emulated on the CPU (for tests): no FP8 GEMMs, no speed or memory saving; "
           "FP8 GEMMs run on CUDA GPUs of compute capability 8.9 or newer",
    "cuda_graphs": "CUDA graphs are captured only where the layers run on a CUDA device (here they run as "
                   "usual); a model moved to a GPU before its first training step gets them",
}


def _warn_idle(device, before, **given) -> None:
    """One UserWarning for each option that does nothing useful on the model's device (the CPU), when this
    call turns it on: a later call that keeps it (TorchFuserCallback's) says nothing again."""
    if device is None or device.type != "cpu":
        return
    for name, (passed, value) in given.items():
        off = value is None or value is False or value == "auto"  # "auto" does nothing on the CPU, as documented
        if isinstance(passed, _U) or off or (before is not None and getattr(before, name) == value):
            continue
        shown = "True" if value is True else repr(value) if isinstance(value, str) else type(value).__name__ + "(...)"
        warnings.warn(f"optimize({name}={shown}) on a model on the CPU: {_IDLE_ON_CPU[name]}", UserWarning,
                      stacklevel=3)


def _narrows(model: nn.Module, before: _settings.Settings, s: _settings.Settings, chosen) -> bool:
    """Whether the selection of this call leaves out blocks fused already: then the model is fused afresh."""
    st = walker.state(model)
    if st is None:
        return False
    names = {p.name for p in chosen}
    if any(e.pattern not in names for e in st.report.fused):
        return True
    # A new filter can only be asked about the blocks as they were, before fusing.
    return s.filter_fn is not None and s.filter_fn is not before.filter_fn


def _apply(model: nn.Module, before, s: _settings.Settings, chosen, strict: bool, per_step: bool, reselect: bool):
    """The body of ``optimize``, inside its transaction: (report, stacks of CUDA graphs no longer used)."""
    graphs = _cuda_graphs.detach(model)  # the layers' own forwards while blocks are swapped; back at the end
    afresh = reselect and before is not None and _narrows(model, before, s, chosen)
    if afresh:
        _undo(model)
    st = walker.state(model)
    swaps, rebackend = (len(st.undo), st.backend != s.backend) if st is not None else (0, False)
    # Blocks autotune gave back to their originals stay so while it is on (its decision); off, they are fused.
    leave = frozenset(id(a.undo.original) for a in st.undo if type(a.undo).__name__ == "_KeptOriginal") \
        if st is not None and s.autotune else frozenset()
    # auto on a CPU without torch-mlir: only the blocks the reference backend runs no slower (backends/policy.py)
    keep = _policy.held(s.backend, walker._device(model), fp8=s.fp8, checkpointing=s.checkpointing)
    result = walker.fuse(model, chosen, s.backend, strict, s.filter_fn, leave, keep)
    st = walker.state(model)
    changed = afresh or rebackend or (len(st.undo) if st is not None else 0) != swaps
    if not st:
        model.__dict__[unwrap.LAST_REPORT] = result
    if any(e.pattern == "attention" for e in result.fused):
        from torchfuser.compiler import inductor_pass  # imports Inductor's config: only when needed

        inductor_pass.hold(model)
    _set_fp8(model, s.fp8, result, per_step, s.fp8_lm_head, s.backend)
    _set_keep_logits(model, s.keep_logits)
    _offload.set_mode([model.get_submodule(e.name) for e in result.fused if e.pattern == "residual_norm"],
                      s.checkpointing)
    dropped = _set_graphs(model, result, s.cuda_graphs, graphs, changed, bool(s.checkpointing))
    _set_autotune(model, result, s.autotune, before is not None and before.autotune and not afresh, changed)
    _experts.note(model, result)
    _settings.keep(model, s)
    return result, dropped


def _set_keep_logits(model: nn.Module, keep: bool) -> None:
    """The fused LM heads + loss return the logits too, or not (``FusedLMHeadLoss.keep_logits``)."""
    st = walker.state(model)
    for fused in (head_check.fused_heads(model, st) if st is not None else {}).values():
        fused.keep_logits = keep


def _set_graphs(model: nn.Module, result: FusionReport, wanted, graphs, changed: bool, checkpointing: bool) -> list:
    """CUDA graphs as ``wanted``: the stacks detached at the start of the call put back where nothing they
    captured changed, else installed anew (or not at all); returns the stacks dropped."""
    stacks, kept = graphs if graphs is not None else ([], None)
    auto = wanted == "auto"
    was_auto = bool(stacks) and stacks[0].auto is not None
    same = kept is not None and auto == was_auto and (auto or wanted is True or wanted == kept)
    if wanted and stacks and same and not changed:
        _cuda_graphs.reattach(model, stacks)
        return []
    if not wanted:
        result.notes = [n for n in result.notes if not n.startswith(_cuda_graphs.HEAD)]
        return stacks
    chosen = wanted if isinstance(wanted, _cuda_graphs.GraphOptions) else None if auto or was_auto else kept
    notes = _cuda_graphs.install_auto(model, checkpointing) if auto else _cuda_graphs.install(model, chosen)
    result.notes = [n for n in result.notes if not n.startswith(_cuda_graphs.HEAD)] + notes
    return stacks


def _set_autotune(model: nn.Module, result: FusionReport, wanted: bool, was: bool, changed: bool) -> None:
    from torchfuser import autotune as _autotune

    if not wanted:
        _autotune.stop(model)
        result.notes = [n for n in result.notes if not n.startswith(_autotune.UNTIMED)]
    elif not was or changed:
        _autotune.apply(model)


_FP8_HEAD = "fp8: "
_FP8_KINDS = ("attention", "gated_mlp", "mlp")


def _set_fp8(model: nn.Module, recipe: str | None, result: FusionReport, per_step: bool, lm_head: bool,
             backend: str) -> None:
    """FP8 GEMMs on (or off) in the fused attention and MLP blocks and, with ``lm_head``, the fused LM head
    + loss (``FusedLMHeadLoss.fp8``, gone with ``restore``), said in one note of the report; with
    ``per_step`` the weights' copies kept per optimizer step (the step hook held for ``model``)."""
    count, gated, layers, heads = 0, 0, 0, []
    st = walker.state(model)
    installed = head_check.fused_heads(model, st) if st is not None else {}  # wrapped since, too (a trainer's)
    for entry in result.fused:
        module = model.get_submodule(entry.name) if entry.name else model
        # its norms are producers where they are on (modules._layer_blocks.maxima)
        layers += entry.pattern == "residual_norm" and _fp8._SWITCHES.fp8_norm_producers
        if entry.pattern == "lm_head_loss":
            fused = installed.get(entry.name)
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
    _undo(model)
    _settings.forget(model)
    model.__dict__.pop(unwrap.LAST_REPORT, None)
    return model


def _undo(model: nn.Module) -> None:
    """Every swap and hold of ``model`` undone (``restore``, or before fusing afresh)."""
    _cuda_graphs.remove(model)
    _fp8_step.release(model)
    walker.restore(model)
    _experts.forget(model)
    inductor_pass = sys.modules.get("torchfuser.compiler.inductor_pass")  # not imported: nothing held
    if inductor_pass is not None:
        inductor_pass.release(model)


_LORA_HEAD = "adapters: "
# Notes made anew at each report: the old ones go first.
_REFRESHED = (fallbacks.HEAD, _decode.HEAD, _LORA_HEAD, _packed.HEAD, head_check.HEAD, _experts.CHANGED, _offload.HEAD, _SMALL_NOTE)


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
    (PEFT, DDP / FSDP, torch.compile), with the calls that fell back to an original forward since, and
    the LM head + loss as it runs now (bypassed where a trainer's own head computes the loss)."""
    _check_model(model)
    path, target = unwrap.optimized(model)
    if target is None:
        return FusionReport(type(model).__name__, notes=[
            "torchfuser.optimize was not called on this model, nor on any module inside it"])
    st = walker.state(target)
    result = st.report if st is not None else target.__dict__[unwrap.LAST_REPORT]
    result.notes = _cuda_graphs.refresh_notes(target, result.notes)  # replays, captures, eager calls
    result.fallbacks = fallbacks.counts(target)
    result.decode_calls = _decode.counts(target)
    replaced, heads = head_check.check(target, st, result.entries) if st is not None else ({}, [])
    result.notes = [n for n in result.notes if not n.startswith(_REFRESHED) and n != _COMPILE_NOTE]
    if _compiled_with_inductor() and any(e.pattern == "attention" for e in result.fused):
        result.notes.append(_COMPILE_NOTE)
    result.notes += (fallbacks.notes(target) + _decode.notes(target) + _lora_notes(target, result) + _packed.notes(target) + heads
                     + _experts.changed(target, result)
                     + _offload.notes(target, result, getattr(_settings.of(target), "checkpointing", False))
                     + _small_calls_note({e.backend for e in result.fused}))
    if replaced:  # the report kept on the model stays as optimize made it; this one says what runs now
        result = copy.copy(result)
        result._entries = {name: replaced.get(name, e) for name, e in result._entries.items()}
    if path:
        return result.with_note(f"optimize was called on {path!r} ({type(target).__name__}) inside this "
                                f"{type(model).__name__}: module names are relative to it")
    return result
