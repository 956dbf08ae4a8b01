"""Where the head of a model sits when it is not a plain child of it: in a wrapper of the model's own (fused at its
path), inside the decoder the probes stand in for, inside a causal LM of its own, or inside another model the forward
hands the labels (BLIP's text decoder): the last three stay unfused here, each with its reason."""
from __future__ import annotations

import inspect

from torch import nn

from torchfuser.patterns import _lm_head_probe as probe
from torchfuser.patterns.base import Skip


def nested_head(model: nn.Module, head: nn.Linear, is_lm):
    """The path of a head that is not a child of the model but sits in a wrapper of its own (T5Gemma 2's
    ``lm_head.out_proj``, BERT's ``cls.predictions.decoder`` after its transform: what runs before the head is
    captured with its input, what runs after it the probes see; a head of an inner causal LM, Llama 4's, whose decoder
    the probes stand in for: the model's loss from its logits is probed), else a Skip: a head inside the decoder the
    probes stand in for, or inside a causal LM of its own the probes cannot stand in for."""
    path = next((n for n, m in model.named_modules() if m is head), None)
    if path is None:
        return Skip("output embeddings are not a module of the model")
    parts = path.split(".")
    for i in range(1, len(parts)):  # first: VisionEncoderDecoder's decoder, whose head this is, is a causal LM
        if is_lm(type(model.get_submodule(".".join(parts[:i]))).__name__) and any(
                k.startswith(".".join(parts[:i]) + ".") for k in probe._stubbed(model, path) or {}):
            return path  # an inner causal LM whose decoder the probes stand in for: they show what the model does
    stubbed = probe._stubbed(model) or {}
    if parts[0] == getattr(model, "base_model_prefix", None) or parts[0] in stubbed:
        decoder = model.get_submodule(parts[0])
        own = "labels" in _params(decoder)
        return Skip(f"output embeddings at {path!r}, inside the decoder ({parts[0]!r}, {type(decoder).__name__}) whose "
                    "output the loss is computed from: not a head on the decoder's output"
                    + ("; that decoder's forward takes labels and computes a loss of its own" if own else ""))
    for i in range(1, len(parts)):
        inner = model.get_submodule(".".join(parts[:i]))
        cls = type(inner).__name__
        if is_lm(cls) or isinstance(inner, nn.ModuleList):
            return Skip(f"output embeddings at {path!r}, inside {'.'.join(parts[:i])!r} ({cls}), a model of its own: "
                        "its head and loss are fused on that model, where it is given the labels")
    return path


def inner_head(model: nn.Module, is_lm) -> nn.Linear | str | None:
    """For a model without output embeddings of its own, where a model inside it holds the head: the head where that
    model is a causal LM (probed as a head inside one), else why it is not fused (BLIP's text decoder, which its
    forward hands the labels, computes the head and loss itself); None where no model inside holds one."""
    for path, inner in model.named_modules():
        get = getattr(inner, "get_output_embeddings", None)
        if inner is model or not callable(get):
            continue
        try:
            head = get()
        except Exception:
            continue
        if not isinstance(head, nn.Linear):
            continue
        where = next((n for n, m in inner.named_modules() if m is head), "?")
        cls = type(inner).__name__
        said = f"output embeddings None on the model; its head sits at {path}.{where}, inside {path!r} ({cls})"
        if is_lm(cls):
            return head  # (Nemotron-H Omni's): probed as a head inside an inner causal LM
        smoothing = getattr(inner, "label_smoothing", None)
        return (f"{said}, whose own forward computes the head and loss (not a causal-LM class the pattern takes" +
                (f"; with label smoothing {smoothing}, which linear_cross_entropy does not compute" if
                 isinstance(smoothing, (int, float)) and smoothing > 0 else "") + ")")
    return None


def _params(module: nn.Module):
    try:
        return inspect.signature(module.forward).parameters
    except (TypeError, ValueError):
        return {}


def inner_causal_lm(model: nn.Module, path: str, is_lm) -> str | None:
    """The path of the causal LM of its own that holds the head at ``path`` inside the model, or None."""
    parts = path.split(".")
    for i in range(len(parts) - 1, 0, -1):
        cls = type(model.get_submodule(".".join(parts[:i]))).__name__
        if is_lm(cls):
            return ".".join(parts[:i])
    return None
