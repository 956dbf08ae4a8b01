"""Probe of an encoder-decoder's forward that makes its decoder's inputs from the labels where none are given
(T5Gemma 2's, Florence-2's, UDOP's): the fused loss calls the forward without labels, so it must pass those inputs
itself, and nothing else the forward does with the labels may be missed.

The forward runs on the stub copy of ``_lm_head_probe`` three times: with labels, without, and without labels but
with the decoder inputs the fused loss would pass (``use_cache=False`` too where the labelled call turned the cache
off). Every call the stand-ins receive must then match the labelled run's, argument by argument: a decoder attention
mask made from the labels (Pix2Struct's), or labels handed on to the decoder, show up as a difference.
"""
from __future__ import annotations

import inspect
from collections.abc import Mapping

import torch
from torch import nn

from torchfuser.modules.lm_head import CaptureHead, shift_right
from torchfuser.patterns import _probe
from torchfuser.patterns._lm_head_probe import _B, _OrNone, _run, forward_inputs, head_of, length


def _same(a, b) -> bool:
    if isinstance(a, torch.Tensor) or isinstance(b, torch.Tensor):
        return (isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor) and a.shape == b.shape
                and a.dtype == b.dtype and torch.equal(a.cpu(), b.cpu()))
    if isinstance(a, _OrNone) and isinstance(b, _OrNone):
        return _same(a.__dict__["_out"], b.__dict__["_out"])
    if isinstance(a, Mapping) and isinstance(b, Mapping):
        return a.keys() == b.keys() and all(_same(a[k], b[k]) for k in a)
    if isinstance(a, (tuple, list)) and isinstance(b, (tuple, list)):
        return type(a) is type(b) and len(a) == len(b) and all(_same(x, y) for x, y in zip(a, b))
    if a is b:
        return True
    try:
        return type(a) is type(b) and bool(a == b)
    except Exception:
        return False


def _calls(model: nn.Module, head: str, **kwargs) -> list[dict]:
    seen: list[dict] = []
    _run(model, head, lambda real: CaptureHead(real=real), seen=seen, **kwargs)
    return seen


def _differences(want: list[dict], got: list[dict]) -> list[str]:
    if len(want) != len(got):
        return [f"{len(want)} calls of its encoder / decoder against {len(got)}"]
    out = []
    for a, b in zip(want, got):
        out += [k for k in sorted(a.keys() | b.keys()) if not (k in a and k in b and _same(a[k], b[k]))]
    return list(dict.fromkeys(out))


def _made(calls: list[dict], others: list[dict], labels: torch.Tensor) -> torch.Tensor | None:
    """The labels-shaped integer tensor passed in the labelled run where the unlabelled run passed another (or none):
    the decoder's inputs the forward made from the labels."""
    for i, call in enumerate(calls):
        other = others[i] if i < len(others) else {}
        for k, v in call.items():
            if (isinstance(v, torch.Tensor) and v.shape == labels.shape and not v.is_floating_point()
                    and not _same(v, other.get(k))):
                return v
    return None


def _shift_of(made: torch.Tensor, labels: torch.Tensor) -> tuple[int, int] | None:
    """(start, pad) where ``made`` is the labels shifted right, ``start`` first and -100 replaced by ``pad``."""
    made = made.cpu()
    pads = made[:, 1:][labels[:, :-1] == -100]
    if pads.numel() == 0:
        return None
    start, pad = int(made[0, 0]), int(pads[0])
    return (start, pad) if torch.equal(shift_right(labels, start, pad), made) else None


def _cache_off(model: nn.Module, with_labels: list[dict], without: list[dict]) -> bool:
    return "use_cache" in inspect.signature(type(model).forward).parameters and any(
        c.get("use_cache") is False for c in with_labels) and not any(c.get("use_cache") is False for c in without)


def turns_cache_off(model: nn.Module, head: str, extra: int = 0) -> bool:
    """Whether the forward passes ``use_cache=False`` on with labels and not without (GIT's, Kosmos-2's): the fused
    loss, which calls it without labels, passes it too (a cache built in a training step costs memory)."""
    inputs = forward_inputs(model)
    if inputs is None:
        return False
    labels = torch.randint(0, head_of(model, head).out_features, (_B, length(inputs)), generator=_probe.generator(17))
    return _cache_off(model, _calls(model, head, extra=extra, labels=labels, inputs=inputs),
                      _calls(model, head, extra=extra, inputs=inputs))


def decoder_inputs_from_labels(model: nn.Module, head: str) -> dict | bool | str | None:
    """How the forward makes its decoder's inputs from the labels: False where it does not; a dict of the spec's fields
    (``decoder_inputs_from_labels`` where ``model.prepare_decoder_input_ids_from_labels`` makes them, else
    ``decoder_shift`` = (start, pad) read off the probe; ``cache_off`` where it turns the cache off with labels) where
    the fused forward, passing those, makes every call of the stand-ins the labelled forward makes; a reason where it
    does otherwise; None where the forward does not run on the stub."""
    inputs = forward_inputs(model)
    if inputs is None:
        return None
    labels = torch.randint(0, head_of(model, head).out_features, (_B, length(inputs)), generator=_probe.generator(17))
    labels[0, 3] = labels[1, 0] = -100
    with_labels = _calls(model, head, labels=labels.clone(), inputs=inputs)
    if not with_labels:
        return None
    without = _calls(model, head, inputs=inputs)
    if not _differences(with_labels, without):
        return False
    made = _made(with_labels, without, labels)
    if made is None:
        return ("its forward does something with the labels besides the loss that the fused loss (which calls it "
                f"without labels) would not: the arguments {', '.join(_differences(with_labels, without))} of its "
                "encoder / decoder differ with and without labels, and none is the labels made into decoder inputs")
    found = {}
    prepare = getattr(model, "prepare_decoder_input_ids_from_labels", None)
    try:
        mine = prepare(labels=labels.clone()) if callable(prepare) else None
    except Exception:
        mine = None
    if isinstance(mine, torch.Tensor) and mine.shape == made.shape and torch.equal(mine.cpu(), made.cpu()):
        found["decoder_inputs_from_labels"] = True
    elif (shift := _shift_of(made, labels)) is not None:
        found["decoder_shift"], mine = shift, shift_right(labels, *shift)
    else:
        return ("its forward makes its decoder's inputs from the labels, neither as its "
                "prepare_decoder_input_ids_from_labels does nor as the labels shifted right (a start token first, "
                "-100 made a pad token)")
    extra = {}
    if _cache_off(model, with_labels, without):
        found["cache_off"], extra["use_cache"] = True, False
    fused = _calls(model, head, decoder_input_ids=mine, inputs=inputs, **extra)
    if differ := _differences(with_labels, fused):
        return ("its forward does more with the labels than make its decoder's inputs from them: given those inputs "
                f"and no labels (as the fused loss calls it), its encoder / decoder get other {', '.join(differ)}")
    return found
