"""Probes of a causal LM's own forward for the lm_head_loss pattern: what it does to the head's
output (a scale, a softcap) and how it forms its loss from the logits and labels.

Each runs the model's class forward on a shallow copy whose decoder is a stub returning fixed
hidden states and whose head returns fixed values, so nothing of the model runs but its top
level. Every random value comes from a local ``torch.Generator``; the model is never changed.
"""
from __future__ import annotations

import inspect

import torch
from torch import nn

from torchfuser.modules.lm_head import PROBE_LOGITS, CaptureHead, FusedLMHeadLoss, LMHeadLossSpec
from torchfuser.patterns import _lm_head_probe_inputs as _inputs, _probe

try:
    from transformers.modeling_outputs import BaseModelOutputWithPast
except ImportError:  # pragma: no cover - transformers is a dependency
    BaseModelOutputWithPast = None

_B, _S = 2, 5  # the probe batch: 2 rows of 5 tokens (and an image's tokens where the forward needs pixels)


def forward_inputs(model: nn.Module) -> dict | None:
    """The keyword arguments of every probe call (``_lm_head_probe_inputs``): ``input_ids``, and pixel values where
    the forward takes them as a required argument; None where they cannot be built."""
    return _inputs.forward_inputs(model, _B, _S)


def length(inputs: dict) -> int:
    """The probe's sequence length: the labels' and the stand-in decoder's (before any ``extra`` positions)."""
    ids = inputs.get("input_ids")
    return _S if ids is None else ids.shape[1]  # (no ids: an encoder-decoder over images, decoder as long as labels)


class _StubDecoder(nn.Module):
    """Stands in for the decoder: returns fixed final hidden states. Whatever else the forward
    reads of it comes from the real decoder (Falcon-H1's lm_head_multiplier), except submodules,
    which are stubs too (BART-style ``self.model.decoder(...)``; an embedding a ``_StubEmbedding``), and, when ``perturb`` is set,
    parameters and buffers, which come back changed (to tell a scale read off them)."""

    def __init__(self, hidden: torch.Tensor, real: nn.Module, perturb: bool = False, seen: list | None = None):
        super().__init__()
        self.hidden = hidden
        self.__dict__["_real"] = real  # not a submodule
        self.__dict__["_perturb"] = perturb
        self.__dict__["_seen"] = seen  # where the keyword arguments of each call go, if anywhere

    def forward(self, *args, **kwargs):
        if self.__dict__["_seen"] is not None:  # positional ones too (BERT's LM hands its encoder input_ids so)
            self.__dict__["_seen"].append({**{f"(argument {i})": a for i, a in enumerate(args)}, **kwargs})
        # Fields other decoders add (a mixture of experts' router_logits): absent, as None.
        return _OrNone(BaseModelOutputWithPast(last_hidden_state=self.hidden))

    def __getattr__(self, name):
        try:
            return super().__getattr__(name)
        except AttributeError:
            value = getattr(self.__dict__["_real"], name)
        return self._stand_in(value)

    def __getitem__(self, key):  # a ModuleList's layer (GIT reads its image positions off its first layer)
        return self._stand_in(self.__dict__["_real"][key])

    def _stand_in(self, value):
        if isinstance(value, nn.Embedding):  # the input embedding an outer model embeds its tokens with (BLIP-2's)
            return _StubEmbedding(value)
        if isinstance(value, nn.Module):
            return _StubDecoder(self.hidden, value, self.__dict__["_perturb"], self.__dict__["_seen"])
        if self.__dict__["_perturb"] and isinstance(value, torch.Tensor) and value.is_floating_point():
            return _changed(value)
        return value


class _StubEmbedding(nn.Module):
    """Stands in for an input embedding inside the stubbed decoder: zeros of its width for the token ids, where they
    are (an outer model puts its image features among them with ``masked_scatter``: BLIP-2), in its weight's dtype;
    the stand-in decoder reads none of them."""

    def __init__(self, real: nn.Embedding):
        super().__init__()
        self.__dict__["_real"] = real

    def forward(self, ids, *args, **kwargs):
        real = self.__dict__["_real"]
        return torch.zeros(*ids.shape, real.embedding_dim, dtype=real.weight.dtype, device=ids.device)

    def __getattr__(self, name):
        try:
            return super().__getattr__(name)
        except AttributeError:
            return getattr(self.__dict__["_real"], name)


class _OrNone:
    """A decoder output whose missing fields read as None."""

    def __init__(self, out):
        self.__dict__["_out"] = out

    def __getattr__(self, name):
        return getattr(self.__dict__["_out"], name, None)

    def __getitem__(self, key):
        return self.__dict__["_out"][key]


class _FixedLogits(CaptureHead):
    """A head returning given logits (B×S×V) whatever its input (only its shape is checked)."""

    def __init__(self, logits: torch.Tensor, real: nn.Module):
        super().__init__(real=real)
        self.logits = logits

    def forward(self, hidden):
        if tuple(hidden.shape[:-1]) != tuple(self.logits.shape[:-1]):
            raise ValueError("the head's input is not the decoder's (batch, sequence) hidden states")
        return self.logits.to(hidden.dtype)


def _changed(t: torch.Tensor) -> torch.Tensor:
    return t.detach() * 2 + 1


def _perturbed(module: nn.Module, children=None, keep=()) -> nn.Module:
    """A shallow copy whose floating parameters and buffers, and those of ``children`` (default:
    all), are changed; ``keep`` (the head and the stubbed decoder, replaced anyway) are not copied."""
    copy = _probe.shallow_copy(module)
    for table in (copy._parameters, copy._buffers):
        for name, t in table.items():
            if t is not None and t.is_floating_point():
                table[name] = nn.Parameter(_changed(t), requires_grad=False) if isinstance(t, nn.Parameter) else _changed(t)
    children = module._modules if children is None else children
    for name, child in children.items():
        if child is not None and not any(child is k for k in keep):
            copy._modules[name] = _perturbed(child, keep=keep)
    return copy


def head_of(model: nn.Module, head: str) -> nn.Module:
    """The head at its path in ``model`` (a child's name, or a dotted path into a wrapper)."""
    return model.get_submodule(head)


def _put(probe: nn.Module, path: str, new: nn.Module) -> None:
    """``new`` at ``path`` in ``probe``, each module on the way a shallow copy (the model's own stay as they are)."""
    *parents, leaf = path.split(".")
    for name in parents:
        probe._modules[name] = probe = _probe.shallow_copy(probe._modules[name])
        if isinstance(probe.__dict__.get("forward"), FusedLMHeadLoss):
            # an inner causal LM's fused loss is bound to the model's own inner model: the class forward runs here
            del probe.__dict__["forward"]
    probe._modules[leaf] = new


def _stubbed(model: nn.Module, head: str | None = None) -> dict[str, nn.Module] | None:
    """The modules the probes stand in for, by path: the decoder at ``base_model_prefix``; for a head inside a model of
    its own (an inner causal LM whose logits the model computes its loss from: Llama 4's, BLIP-2's) that model's
    decoder; or where the model holds none there (an encoder-decoder of its own, UDOP's) its encoder and decoder
    (``get_encoder`` / ``get_decoder``) where both are children of it; None where neither."""
    full = head.split(".") if head else []
    parts = full[:-1]
    for i in range(len(parts), 0, -1):  # the deepest model on the head's path with a decoder of its own
        inner = model.get_submodule(".".join(parts[:i]))
        prefix = getattr(inner, "base_model_prefix", None)
        if not isinstance(prefix, str):  # not a model of its own (BERT's prediction head: a wrapper of the model's)
            continue
        decoder = inner._modules.get(prefix) if isinstance(prefix, str) and prefix else None
        others = [n for n, m in inner._modules.items() if m is not None and n != full[i]]
        if decoder is None and len(others) == 1:  # (Llama 4's prefix names no child): its one child beside the head's
            prefix = others[0]
            decoder = inner._modules[prefix]
        if isinstance(decoder, nn.Module) and full[i] != prefix:
            return {".".join(parts[:i] + [prefix]): decoder}
    prefix = getattr(model, "base_model_prefix", None)
    decoder = model._modules.get(prefix) if isinstance(prefix, str) and prefix else None
    if isinstance(decoder, nn.Module):
        return {prefix: decoder}
    found = {}
    for getter in ("get_encoder", "get_decoder"):
        try:
            part = getattr(model, getter)()
        except Exception:
            return None
        name = next((n for n, m in model._modules.items() if m is part and m is not None), None)
        if name is None:
            return None
        found[name] = part
    return found if len(found) == 2 else None


def _run(model: nn.Module, head: str, make_head, perturb: bool = False, seen: list | None = None, extra: int = 0,
         loss_function=None, inputs: dict | None = None, **kwargs):
    """The model's forward on a stub copy (decoder stubbed, ``make_head(real_head)`` as head, and
    with ``perturb`` every other parameter and buffer changed; the stub's calls' keyword arguments into
    ``seen``; the decoder's output ``extra`` positions longer than the input ids, as a vision tower's positions
    before the text make it; ``loss_function`` in place of the model's; ``inputs`` those of ``forward_inputs``, built
    where not given); None where it raises."""
    stubs = _stubbed(model, head)
    inputs = forward_inputs(model) if inputs is None else inputs
    if stubs is None or BaseModelOutputWithPast is None or inputs is None:
        return None
    probe = _probe.shallow_copy(model)
    real = head_of(model, head)
    if perturb:  # the decoder and the head are replaced below: copying them would cost their memory
        others = {n: m for n, m in model._modules.items() if n not in (*stubs, head) and m is not None}
        probe = _perturbed(probe, others, keep=(real, *stubs.values()))
    _put(probe, head, make_head(real))
    if loss_function is not None:
        probe.__dict__["_loss_function"] = loss_function  # what transformers' loss_function property returns
    widths = [real.in_features]
    if "." in head:  # the wrapper's own layers before the head (BERT's transform) run on the decoder's output, which
        # may be of the text config's hidden size where the head's input is not (RemBERT's output_embedding_size)
        text = model.config.get_text_config() if hasattr(model.config, "get_text_config") else model.config
        width = getattr(text, "hidden_size", None)
        widths += [width] if isinstance(width, int) and width != real.in_features else []
    for width in widths:
        hidden = _probe.randn(_B, length(inputs) + extra, width, gen=_probe.generator(7))
        if "." in head:
            hidden = hidden.to(real.weight.device, real.weight.dtype)
        for name, part in stubs.items():
            _put(probe, name, _StubDecoder(hidden, part, perturb, seen))
        try:  # each run draws the same (the decoder probe compares runs); a vision tower runs in eval mode
            with torch.no_grad(), _probe.saved_rng(), _inputs.eval_mode(model, "pixel_values" in inputs):
                _probe.seed_cpu(0)
                if torch.cuda.is_initialized():
                    torch.cuda.manual_seed_all(0)
                return type(model).forward(probe, **{k: v.clone() for k, v in inputs.items()}, **kwargs)
        except Exception:  # (what the stub decoder saw stays: a loss on the probe logits may fail after it ran)
            continue
    return None


def _logits_of(out, width: int) -> torch.Tensor | None:
    logits = out[0] if isinstance(out, tuple) else getattr(out, "logits", None)
    if not (isinstance(logits, torch.Tensor) and logits.shape[-1] == width):
        return None
    # Back to the CPU: some forwards move logits to the head's device (the meta device under inspect).
    return logits.detach().reshape(-1, width).double().cpu()


def probe_logits(model: nn.Module, head: str, perturb: bool = False) -> torch.Tensor | None:
    """What the forward makes of the head's output when the head returns PROBE_LOGITS (one row);
    None where the forward does not run that way."""
    out = _run(model, head, lambda real: CaptureHead(real=real), perturb)
    logits = None if out is None else _logits_of(out, len(PROBE_LOGITS))
    return None if logits is None else logits[0]


def runs_at_vocabulary_width(model: nn.Module, head: str) -> bool:
    """Whether the forward runs where the head returns fixed logits as wide as its vocabulary: asked where it does
    not run on the narrow probe logits (``probe_logits``), which is what the fused forward hands it too; one that runs
    only so reads or writes the logits by vocabulary position (Chameleon masks its image tokens' columns)."""
    inputs = forward_inputs(model)
    if inputs is None:
        return False
    vocab = head_of(model, head).out_features
    z = _probe.randn(_B, length(inputs), vocab, gen=_probe.generator(17))
    out = _run(model, head, lambda real: _FixedLogits(z, real), inputs=inputs)
    return out is not None and _logits_of(out, vocab) is not None


def _loss_of(out) -> torch.Tensor | None:
    loss = out[0] if isinstance(out, tuple) else getattr(out, "loss", None)
    return loss.detach().double().cpu() if isinstance(loss, torch.Tensor) and loss.numel() == 1 else None


def _accepts(model: nn.Module, name: str) -> bool:
    params = inspect.signature(type(model).forward).parameters
    return name in params or any(p.kind is p.VAR_KEYWORD for p in params.values())


def probe_loss(model: nn.Module, head: str, spec: LMHeadLossSpec,
               extra: int = 0) -> tuple[bool, tuple, tuple] | str | None:
    """How the forward forms its loss, learned from its loss on known logits and labels:
    ``(shift, honoured keywords, keywords it raises on)``; a reason (str) where it is no form the fused loss reproduces;
    None where the forward does not run on the stub. ``extra``: positions before the labels' (GIT's image positions),
    never scored (the labels are those of the last positions)."""
    inputs = forward_inputs(model)
    if inputs is None:
        return None
    gen, n = _probe.generator(11), length(inputs)
    vocab = head_of(model, head).out_features
    # fp32-exact values: a forward that casts the logits to fp32 loses nothing.
    z = _probe.randn(_B, n + extra, vocab, gen=gen).mul(2).float().double()
    labels = torch.randint(0, vocab, (_B, n), generator=gen)
    labels[0, 2] = labels[1, 3] = -100
    other = torch.randint(0, vocab, (_B, n), generator=gen)  # shift_labels: unrelated to labels

    # A mixture of experts' router loss is added by the fused forward itself (and the stub has no
    # router logits): off here, where the forward has the switch.
    if "output_router_logits" in inspect.signature(type(model).forward).parameters:
        fixed = {"output_router_logits": False}
    else:
        fixed = {}

    def loss(**kwargs):
        out = _run(model, head, lambda real: _FixedLogits(z, real), extra=extra, inputs=inputs, **fixed, **kwargs)
        return None if out is None else _loss_of(out)

    s = spec.transform(z).reshape(-1, vocab)

    def ce(target, reduction="mean", ignore_index=-100):
        target = nn.functional.pad(target, (extra, 0), value=ignore_index)  # the positions before the labels' unscored
        return nn.functional.cross_entropy(s, target.reshape(-1), ignore_index=ignore_index, reduction=reduction)

    def shifted(y, pad=-100):
        return nn.functional.pad(y, (0, 1), value=pad)[..., 1:]

    got = loss(labels=labels.clone())
    if got is None:
        return None
    forms = {True: shifted(labels), False: labels}
    shift = next((k for k, y in forms.items() if _probe.close(got, ce(y))), None)
    if shift is None:
        return (f"its loss is not a cross-entropy of shifted or unshifted labels that the fused loss reproduces "
                f"(on probe logits it gives {got.item():.6g}; shifted labels would give {ce(forms[True]).item():.6g}, "
                f"unshifted {ce(forms[False]).item():.6g})")
    plain = forms[shift]
    ignore3 = labels.clone()
    ignore3[labels == -100] = 3  # a class when not ignored: ignored or counted tells the two apart
    ignore3[0, 3] = ignore3[1, 1] = 3
    tries = {  # each of LOSS_KWARGS: : (its value, labels, the loss were it honoured, the loss were it not)
        "num_items_in_batch": (torch.tensor(7), labels, ce(plain, "sum") / 7, ce(plain)),
        "ignore_index": (3, ignore3, ce(shifted(ignore3, 3) if shift else ignore3, ignore_index=3),
                         ce(shifted(ignore3) if shift else ignore3)),
        "shift_labels": (other, labels, ce(other), ce(plain)),
    }
    honoured, refused = [], []
    for name, (value, y, yes, no) in tries.items():
        if not _accepts(model, name):
            continue
        got = loss(labels=y.clone(), **{name: value})
        if got is None:  # the forward raises with it given (Florence-2 passes shift_labels= itself): so does the fused
            refused.append(name)
        elif _probe.close(got, yes):
            honoured.append(name)
        elif not _probe.close(got, no):
            return f"its loss with {name}= given is neither the fused loss's with nor without it"
    return shift, tuple(honoured), tuple(refused)
