"""The walker: offer every module of a model to the patterns, swap what matches, remember how
to undo it, and record every candidate in the model's FusionReport."""
from __future__ import annotations

import dataclasses
import logging
import warnings
from dataclasses import dataclass, field

import torch
from torch import nn

from torchfuser import backends
from torchfuser.backends import policy
from torchfuser.modules.adapters import quantized_base
from torchfuser.modules.base import FusedModule
from torchfuser.patterns import Applied, Pattern, Skip, _probe
from torchfuser.report import Entry, FusionReport

log = logging.getLogger("torchfuser")
_STATE = "_torchfuser_state"
EXCLUDED = "excluded by filter_fn"  # a user's choice, not a failure: strict=True lets it pass
# Patterns whose fused block calls the kernels of these children (the names its spec holds in these fields):
# with a child left plain by filter_fn, every call would fall back to the original forward.
_NEEDS_FUSED = {"residual_norm": ("norm_in", "norm_mid")}


@dataclass
class _State:
    report: FusionReport
    undo: list[Applied] = field(default_factory=list)
    backend: str = "auto"  # what every fused module of the model asks for (a class default: older pickles)


def state(model: nn.Module) -> _State | None:
    return model.__dict__.get(_STATE)


def _device(module: nn.Module) -> torch.device:
    t = next(module.parameters(), None)
    if t is None:
        t = next(module.buffers(), None)
    return t.device if t is not None else torch.device("cpu")


def _backend_label(backend: str, device: torch.device) -> str:
    if device.type == "meta":
        return f"{backend} (decided when run)" if backend == "auto" else backend
    chosen = backends.resolve(backend, device)
    if backend == "auto" and (why := backends.auto_fallback_reason(device)):
        return f"{chosen} ({why})"
    return chosen


def _fused_label(fused: nn.Module, label: str) -> str:
    """The report's backend column for ``fused``: the backend, with the reference backend named where the
    block's ops have no kernels in the one chosen (``kernels_in``), and what the block computes (``describe``)."""
    kernels_in = getattr(type(fused), "kernels_in", None)
    chosen = label.split(" ", 1)[0]
    if kernels_in is not None and chosen not in kernels_in and chosen in backends.BACKENDS:
        label = f"reference (no {type(fused).__name__} kernels in {chosen} yet)"
    describe = getattr(type(fused), "describe", None)
    return describe(fused, label) if callable(describe) else label


def _not_plain(params) -> str | None:
    """Why fused kernels cannot take these parameters, or None when they are plain tensors."""
    for name, p in params:
        if quantized_base.frozen_bytes(p):  # a bitsandbytes base: its layer runs it, or the LoRA node dequantises it
            continue
        if type(p) is not nn.Parameter or type(p.data) is not torch.Tensor:
            kind = type(p).__name__
            if kind == "DTensor":
                return (f"parameter {name!r} is a DTensor (FSDP2 fully_shard or tensor parallel): "
                        "optimize the model before sharding it")
            return f"parameter {name!r} is a {kind}, not a plain tensor; fused kernels read plain tensors"
    return None


_ORDER = ("filter_fn takes (module, fqn): the module first, its qualified name second, the order of torchao's "
          "quantize_(model, config, filter_fn=lambda module, fqn: ...); it took (qualified_name, module) before "
          "(CHANGELOG.md). A filter written in that order needs its arguments swapped, e.g. "
          "lambda module, fqn: not fqn.startswith('model.layers.0.')")


def _ask(filter_fn, module: nn.Module, name: str) -> bool:
    """``filter_fn(module, name)``; a TypeError or AttributeError from it is what a filter written in the old
    order (qualified_name, module) raises on a module where it expects a string: the error says so."""
    try:
        return bool(filter_fn(module, name))
    except (TypeError, AttributeError) as err:
        raise TypeError(f"filter_fn(<{type(module).__name__}>, {name!r}) raised {type(err).__name__}: {err}. "
                        f"{_ORDER}") from err


def _old_order(filter_fn, asked) -> bool:
    """Whether a filter that refused every candidate would accept one with its arguments the other way round
    (qualified_name, module): then it was written in the old order (``isinstance(module, ...)`` on a string)."""
    for name, module in asked:
        try:
            if filter_fn(name, module):
                return True
        except Exception:  # written for (module, fqn) after all: a string is not what it reads
            continue
    return False


def find(model: nn.Module, patterns: list[Pattern], filter_fn=None, leave=frozenset(), keep=None):
    """[(qualname, module, pattern, spec or Skip)] for every candidate block, in module order.
    A candidate ``filter_fn(module, qualname)`` refuses is a Skip: listed, not swapped. Modules whose
    id is in ``leave`` are not offered (autotune's kept originals: their entries say so already).
    A filter in the old order (qualified_name, module) is told apart where it raises on a module or
    refuses every candidate but would accept one the other way round: a TypeError says so. The latter is
    judged on a model with nothing fused yet (a new filter always fuses afresh): on a later call with the
    filter kept, the candidates left are those it refused, and ``not isinstance(module, ...)`` would pass.
    ``keep`` (``backends.policy.held``): None, or the only patterns fused; other matches are left to PyTorch.
    """
    found, asked, refused, fresh = [], [], 0, state(model) is None
    with _probe.one_thread():
        for name, module in model.named_modules():
            if isinstance(module, FusedModule) or id(module) in leave:
                continue
            for pattern in patterns:
                try:
                    result = pattern.match(module)
                except Exception as err:  # an unforeseen module must not stop the model's optimization
                    log.warning("torchfuser: %s pattern failed on %s: %r", pattern.name, name or "(model)", err)
                    result = Skip(f"could not be examined ({type(err).__name__}: {err})")
                if result is not None:
                    if filter_fn is not None:
                        asked.append((name, module))
                        if not _ask(filter_fn, module, name):
                            refused += 1
                            found.append((name, module, pattern, Skip(EXCLUDED)))
                            break
                    why = _not_plain(pattern.parameters_used(module))
                    if why is None and keep is not None and pattern.name not in keep and not isinstance(result, Skip):
                        why = policy.REASON
                    result = Skip(why) if why else result
                    found.append((name, module, pattern, result))
                    break
    if filter_fn is None:
        return found
    if fresh and asked and refused == len(asked) and _old_order(filter_fn, asked):
        raise TypeError(f"filter_fn refused all {len(asked)} candidate blocks, and would accept some with its arguments "
                        f"the other way round. {_ORDER}")
    return _children_excluded(found)


def _children_excluded(found):
    excluded = {n for n, *_, r in found if r == Skip(EXCLUDED)}
    out = []
    for name, module, pattern, result in found:
        needs = dict.fromkeys(getattr(result, f, None) for f in _NEEDS_FUSED.get(pattern.name, ()))
        kids = [k for k in needs if isinstance(k, str) and f"{name}.{k}".lstrip(".") in excluded]
        if kids and not isinstance(result, Skip):
            result = Skip(f"{EXCLUDED}, through its {' and '.join(kids)} (its fused form runs their kernels)")
        out.append((name, module, pattern, result))
    return out


def fuse(model: nn.Module, patterns: list[Pattern], backend: str, strict: bool, filter_fn=None,
         leave=frozenset(), keep=None) -> FusionReport:
    # Probes seed, draw and run dropouts: whatever a pattern does, the user's generators come out as they went in.
    with _probe.saved_rng():
        return _fuse(model, patterns, backend, strict, filter_fn, leave, keep)


def _chosen_skip(reason: str) -> bool:
    """A skip that is a choice, not a failure (strict=True lets it pass): filter_fn's, or the default's."""
    return reason.startswith(EXCLUDED) or reason.startswith(policy.LEFT_TO_PYTORCH)


def _fuse(model: nn.Module, patterns: list[Pattern], backend: str, strict: bool, filter_fn, leave,
          keep=None) -> FusionReport:
    st = state(model)
    if st is None:
        st = _State(FusionReport(type(model).__name__), backend=backend)
    found = find(model, patterns, filter_fn, leave, keep)
    skipped = [(n, r.reason) for n, _, _, r in found if isinstance(r, Skip) and not _chosen_skip(r.reason)]
    if strict and skipped:
        listing = "\n".join(f"  {n or '(model)'}: {why}" for n, why in skipped)
        raise ValueError(f"strict=True and {len(skipped)} candidate block(s) would be skipped:\n{listing}")
    if any("is a DTensor" in why for _, why in skipped):
        warnings.warn("torchfuser.optimize: blocks with sharded (DTensor) parameters are left as they are; "
                      "call optimize(model) before fully_shard / parallelize_module (see the report)", stacklevel=3)
    device = _device(model)
    # Fail now, not at the first forward; a meta model runs nothing until it is materialised elsewhere.
    if backend != "auto" and device.type != "meta" and (st.undo or any(not isinstance(r, Skip) for *_, r in found)):
        backends.resolve(backend, device)
    entries = _swap(model, found, backend)
    if st.undo and st.backend != backend:
        _set_backend(model, st, backend)
    for name, *_ in found:  # report in module order
        st.report.add(entries[name][0])
    if any(r == Skip(policy.REASON) for *_, r in found) and (why := policy.note(device.type)) not in st.report.notes:
        st.report.notes.append(why)
    st.undo += [applied for _, applied in entries.values() if applied is not None]
    if st.undo:
        model.__dict__[_STATE] = st
    return st.report


def _swap(model: nn.Module, found, backend: str) -> dict:
    """{name: (Entry, Applied or None)}; all or nothing: a swap that raises undoes the ones before it."""
    entries, done = {}, []
    try:
        # Deepest first: a block swapped later adopts its already-fused children.
        for name, module, pattern, result in sorted(found, key=lambda f: -len(f[0].split("."))):
            original = type(module).__name__
            if isinstance(result, Skip):
                entries[name] = Entry(name, pattern.name, original, reason=result.reason), None
                log.info("skipped %s (%s): %s", name or "(model)", original, result.reason)
                continue
            applied = pattern.apply(model, name, module, result, backend)
            done.append(applied)
            label = _fused_label(model.get_submodule(name), _backend_label(backend, _device(module)))
            entries[name] = Entry(name, pattern.name, original, fused=applied.fused_type, backend=label), applied
    except BaseException:
        for applied in reversed(done):
            applied.undo()
        raise
    return entries


def _set_backend(model: nn.Module, st: _State, backend: str) -> None:
    """Blocks fused by an earlier call ask for ``backend`` from now on, and the report says so."""
    # The fused modules, and what the undos hold (the LM head's fused forward is no module).
    fused = [m for m in model.modules() if isinstance(m, FusedModule)] + [getattr(a.undo, "fused", None) for a in st.undo]
    for f in fused:
        if hasattr(f, "backend") and hasattr(f, "spec"):
            f.backend = None if backend == "auto" else backend
    for e in st.report.fused:
        if e.backend is not None:
            block = model.get_submodule(e.name)
            st.report.add(dataclasses.replace(e, backend=_fused_label(block, _backend_label(backend, _device(block)))))
    st.backend = backend


def restore(model: nn.Module) -> nn.Module:
    st = model.__dict__.pop(_STATE, None)
    if st is not None:
        for applied in reversed(st.undo):
            applied.undo()
    return model
