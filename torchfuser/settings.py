"""What ``optimize`` was asked for, kept on the model: a later call changes only what it passes.

``optimize(model)`` again (``TorchFuserCallback()`` does that to a model the user already optimized)
must not undo the first call's choices. So each optimize argument defaults to ``Unset(default)``: a
call that does not pass it keeps the value the earlier call left (``Settings``, in the model's
``__dict__``, gone with ``restore``); a first call takes ``default``. ``strict`` and ``verbose`` are
about one call and are not kept.
"""
from __future__ import annotations

import dataclasses
import pickle
from typing import Callable

from torch import nn

from torchfuser import backends
from torchfuser.cuda_graphs.buckets import GraphOptions

KEY = "_torchfuser_settings"


class Unset:
    """The default of an optimize argument: not passed. Its repr is the documented default's, so the
    signature reads ``backend='auto'``; the value used is the earlier call's, or that default."""

    __slots__ = ("default",)

    def __init__(self, default):
        self.default = default

    def __repr__(self) -> str:
        return repr(self.default)


class RefuseNew:
    """Stands in for a ``filter_fn`` that could not be saved with a model saved whole (a lambda, a local
    function): what was fused stays fused, what the filter refused stays refused, and a block no call
    has fused yet is refused too, until a call passes ``filter_fn`` again (``None`` for none)."""

    def __call__(self, module: nn.Module, fqn: str) -> bool:
        return False

    def __repr__(self) -> str:
        return "<filter_fn lost when the model was saved: new blocks are refused>"


@dataclasses.dataclass(frozen=True)
class Settings:
    backend: str = "auto"
    patterns: tuple[str, ...] | None = None  # None: every registered pattern, as registered at each call
    exclude: tuple[str, ...] = ()
    filter_fn: Callable | None = None
    cuda_graphs: bool | str | GraphOptions = "auto"  # "auto": where safe and measured faster (cuda_graphs/auto.py)
    autotune: bool = False
    fp8: str | None = None
    fp8_lm_head: bool = False
    fp8_weights: str = "per_call"
    keep_logits: bool = False
    checkpointing: bool | str = False

    def __getstate__(self) -> dict:
        """A model saved whole keeps its settings; a filter that cannot be pickled becomes ``RefuseNew``."""
        state = dict(self.__dict__)
        if state["filter_fn"] is not None:
            try:
                pickle.dumps(state["filter_fn"])
            except Exception:  # a lambda or local function: pickled by name, which it has none of
                state["filter_fn"] = RefuseNew()
        return state

    def __copy__(self) -> "Settings":
        return self

    def __deepcopy__(self, memo) -> "Settings":
        return self  # immutable; a deep copy of the model keeps the very filter_fn


def explicit_graphs(value) -> bool:
    """Whether ``cuda_graphs`` asks for graphs outright (True or GraphOptions), not ``"auto"`` nor off."""
    return value is True or isinstance(value, GraphOptions)


def of(model: nn.Module) -> Settings | None:
    """The settings the earlier calls left on ``model``, or None (not optimized, or restored since)."""
    return model.__dict__.get(KEY)


def keep(model: nn.Module, settings: Settings) -> None:
    model.__dict__[KEY] = settings


def forget(model: nn.Module) -> None:
    model.__dict__.pop(KEY, None)


def _names(value, what: str):
    if value is None:
        return None
    if isinstance(value, str):
        raise TypeError(f"{what} must be a list or tuple of pattern names, got the string {value!r}")
    return tuple(value)


def merge(before: Settings | None, **passed) -> Settings:
    """The settings of this call: each argument passed (not ``Unset``) replaces the kept one, each other
    one stays as the earlier call left it (``before``; the defaults on a first call). Checked here, with
    errors that say which values were kept, before anything changes."""
    given = {k: v for k, v in passed.items() if not isinstance(v, Unset)}
    base = before if before is not None else Settings()
    if "fp8" in given and given["fp8"] is None:
        # FP8 off: the options that refine it go back to their defaults unless passed with it.
        given.setdefault("fp8_lm_head", False)
        given.setdefault("fp8_weights", "per_call")
    if "backend" in given:
        given["backend"] = backends.check_name(given["backend"])
    if "patterns" in given:
        given["patterns"] = _names(given["patterns"], "patterns")
    if "exclude" in given:
        given["exclude"] = _names(given["exclude"], "exclude") or ()
    if "cuda_graphs" in given and not (isinstance(given["cuda_graphs"], (bool, GraphOptions))
                                       or given["cuda_graphs"] == "auto"):
        raise TypeError(f"cuda_graphs must be True, False or a torchfuser.GraphOptions (or \"auto\", the default), got "
                        f"{given['cuda_graphs']!r}")
    if "autotune" in given and not isinstance(given["autotune"], bool):
        raise TypeError(f"autotune must be True or False, got {type(given['autotune']).__name__}")
    if "keep_logits" in given and not isinstance(given["keep_logits"], bool):
        raise TypeError(f"keep_logits must be True or False, got {type(given['keep_logits']).__name__}")
    if "fp8_lm_head" in given and not isinstance(given["fp8_lm_head"], bool):
        raise TypeError(f"fp8_lm_head must be True or False, got {type(given['fp8_lm_head']).__name__}")
    if "checkpointing" in given:
        from torchfuser.modules import offload

        offload.check(given["checkpointing"])
    if given.get("cuda_graphs") is True and isinstance(base.cuda_graphs, GraphOptions):
        given["cuda_graphs"] = base.cuda_graphs  # on, as it is: with the options set earlier
    fn = given.get("filter_fn")
    if fn is not None and not callable(fn):
        raise TypeError(f"filter_fn must be a callable (module, fqn) -> bool, got {type(fn).__name__}")
    settings = dataclasses.replace(base, **given)
    kept = "" if before is None else " (kept from the earlier optimize call on this model)"
    if settings.fp8_lm_head and settings.fp8 == "blockwise":
        which = kept if "fp8_lm_head" not in given else ""
        raise ValueError(f"fp8_lm_head=True{which} runs the LM head's GEMMs rowwise or tensorwise, not blockwise: "
                         "pass fp8='rowwise' or 'tensorwise' with it, or fp8_lm_head=False")
    if settings.checkpointing and explicit_graphs(settings.cuda_graphs):  # "auto" just stays eager
        which = kept if not {"checkpointing", "cuda_graphs"} <= given.keys() else ""
        raise ValueError(f"checkpointing={settings.checkpointing!r} and cuda_graphs{which} do not go together: a captured "
                         "layer cannot copy its input to the host and recompute in the backward. Pass one of them "
                         "(checkpointing=False or cuda_graphs=False)")
    if settings.fp8_lm_head and settings.fp8 is None:
        raise ValueError("fp8_lm_head=True runs the LM head's GEMMs with the projections' FP8 recipe: pass "
                         "fp8='rowwise' or fp8='tensorwise' too")
    return settings
