"""The inputs the lm_head_loss probes call a model's forward with: token ids alone, or, for a forward that takes
pixel values as a required argument (BLIP-2, InstructBLIP, InstructBLIP-Video: it does not run on text alone),
pixel values of its vision config's image size and image tokens placed as its processor places them.

Built from the forward's signature and the config only: the pixel values are one image (or one frame of a video) a
row, ``num_channels`` × ``image_size``², tried 4-D then 5-D; the image's tokens (its config's image or video token id)
are as many a row as the model's own ``get_image_features`` / ``get_video_features`` makes features of the text
width, in one run after the first token, as its processor puts them; a required ``*_input_ids`` beside them (the
instruction InstructBLIP hands its Q-Former) is a few pad tokens. The vision tower runs on those (under no_grad, the
model in eval mode for the while: no running statistics updated, no dropout drawn; the values it makes never reach
the probes' stand-in decoder); a forward that needs any other argument is not probed.
"""
from __future__ import annotations

import contextlib
import inspect

import torch
from torch import nn

from torchfuser.patterns import _probe

_TOKENS = ("image_token_id", "image_token_index", "video_token_id", "video_token_index")
_GETTERS = ("get_image_features", "get_video_features")
_IDS = 4  # the length of a required *_input_ids beside the text's (InstructBLIP's Q-Former instruction)


@contextlib.contextmanager
def eval_mode(model: nn.Module, on: bool = True):
    """The model in eval mode while its vision tower runs for a probe (no batch norm's running statistics updated, no
    dropout drawn), every module's own training flag put back after."""
    flags = [(m, m.training) for m in model.modules()] if on else []
    try:
        for m, _ in flags:
            m.training = False
        yield
    finally:
        for m, flag in flags:
            m.training = flag


def _required(model: nn.Module) -> list[str]:
    params = list(inspect.signature(type(model).forward).parameters.values())[1:]
    return [p.name for p in params if p.default is p.empty and p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY)
            and p.name != "input_ids"]


def _field(cfg, names):
    for sub in (cfg, getattr(cfg, "text_config", None)):
        for name in names:
            value = getattr(sub, name, None)
            if isinstance(value, int) and not isinstance(value, bool):
                return value
    return None


def _size(vision) -> tuple[int, int] | None:
    size = getattr(vision, "image_size", None)
    if isinstance(size, int):
        return size, size
    if isinstance(size, (tuple, list)) and len(size) == 2 and all(isinstance(s, int) for s in size):
        return tuple(size)
    return None


def _rows_of_features(out, width: int) -> int | None:
    """How many rows of the text width the features a getter returns hold (its pooled output where it has one:
    BLIP-2's projected query outputs; else its first tensor)."""
    if getattr(out, "pooler_output", None) is not None:
        out = out.pooler_output
    elif not isinstance(out, (torch.Tensor, tuple, list)) and hasattr(out, "to_tuple"):
        out = out.to_tuple()[0]
    tensors = [out] if isinstance(out, torch.Tensor) else [t for t in out if isinstance(t, torch.Tensor)]
    total = sum(t.numel() for t in tensors)
    return total // width if tensors and total and total % width == 0 else None


def _image_inputs(model: nn.Module, rows: int, required: list[str], getter: bool = True) -> tuple[dict, int] | None:
    """(the pixel values and other required inputs, image tokens a row), or None where they cannot be built; without
    ``getter``, one image a row (4-D) of the vision config's or the encoder's config's size, no tokens."""
    cfg = getattr(model, "config", None)
    vision = getattr(cfg, "vision_config", None) or getattr(cfg, "encoder", None)
    text = cfg.get_text_config() if hasattr(cfg, "get_text_config") else None
    width = getattr(text, "hidden_size", None)
    size = _size(vision)
    if size is None or not isinstance(width, int) or "pixel_values" not in required:
        return None
    names = [n for n in required if n != "pixel_values"]
    if not all(n.endswith("_input_ids") for n in names):
        return None  # an argument of a kind not built here
    param = next((p for p in model.parameters() if p.is_floating_point()), None)
    if param is None or param.device.type == "meta":
        return None  # (no values to run the vision tower on)
    others = {name: torch.zeros(rows, _IDS, dtype=torch.long, device=param.device) for name in names}
    channels = getattr(vision, "num_channels", None)
    channels = channels if isinstance(channels, int) else 3
    if not getter:
        return {"pixel_values": _probe.randn(rows, channels, *size, gen=_probe.generator(23)).to(param.device, param.dtype)}, 0
    getter = next((getattr(model, g) for g in _GETTERS if callable(getattr(model, g, None))), None)
    if getter is None:
        return None
    takes = inspect.signature(getter).parameters
    gen = _probe.generator(23)
    for shape in ((rows, channels, *size), (rows, 1, channels, *size)):
        pixels = _probe.randn(*shape, gen=gen).to(param.device, param.dtype)
        try:
            with torch.no_grad(), _probe.saved_rng(), eval_mode(model):
                out = getter(pixel_values=pixels, **{k: v for k, v in others.items() if k in takes})
        except Exception:
            continue
        n = _rows_of_features(out, width)
        if n and n % rows == 0:
            return {"pixel_values": pixels, **others}, n // rows
    return None


def forward_inputs(model: nn.Module, rows: int, text: int) -> dict | None:
    """The keyword arguments of a probe call: ``input_ids`` (``rows`` × ``text`` zeros) where the forward needs no
    other argument; where it needs pixel values, those (see the module's docstring) with the image's tokens after the
    first of ``text`` + their number positions; None where it needs anything else or they cannot be built."""
    required = _required(model)
    params = inspect.signature(type(model).forward).parameters
    if "input_ids" not in params and "pixel_values" in params and not required:
        # an encoder-decoder over images alone (VisionEncoderDecoder): its decoder's length is the labels'
        built = _image_inputs(model, rows, ["pixel_values"], getter=False)
        return None if built is None else built[0]
    if not required:
        return {"input_ids": torch.zeros(rows, text, dtype=torch.long)}
    token = _field(getattr(model, "config", None), _TOKENS)
    built = _image_inputs(model, rows, required) if token is not None else None
    if built is None:
        return None
    others, n = built
    ids = torch.zeros(rows, text + n, dtype=torch.long)
    ids[:, 1:1 + n] = token
    return {"input_ids": ids, **others}
