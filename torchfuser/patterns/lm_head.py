"""LM head + loss on causal language models.

A candidate is a Hugging Face causal LM (``*ForCausalLM``, or any class the auto mapping lists for
causal LM, e.g. ``GPT2LMHeadModel``) or image-text-to-text model (its head on the outer
``*ForConditionalGeneration``; vocabulary and softcap read from the text config where the outer
config has none) whose forward takes ``labels``. It is fused when its output
embedding is a plain ``nn.Linear`` child as wide as the vocabulary and its forward's treatment of
the logits and labels is one the fused loss reproduces, all learned by running the model's own
forward on a shallow copy whose decoder is a stub and whose head returns known values
(``_lm_head_probe``): the logit transform (a positive scale and/or Gemma-2's final softcapping,
not read from a parameter), and the loss (cross-entropy of shifted or unshifted labels, and which
of num_items_in_batch / ignore_index / shift_labels it honours). Where the forward cannot run
that way, it is fused only if it calls transformers' loss_function and its config names no logit
transform. Forms of image-text models probed too (docs/vlm.md): decoder inputs the forward shifts from the labels
itself (``_lm_head_probe_decoder``), a loss over the positions after a fixed number of leading ones (GIT's image
positions: ``_lm_head_probe_offset``), the head of an inner causal LM whose logits the model computes its loss from
(``_lm_head_probe_place``: where the head sits, and which decoder the probes stand in for); a forward that requires
pixel values (BLIP-2's) is run on pixel values and image tokens built from its config (``_lm_head_probe_inputs``). The model cannot be
replaced in its parent (it is usually the root), so ``apply`` installs a per-instance forward and its undo removes
it; the class is never touched.
"""
from __future__ import annotations

import dataclasses
import inspect
import math

import torch
from torch import nn

from torchfuser.modules.base import follow_replicas, hooked, unfollow_replicas
from torchfuser.modules.lm_head import PROBE_LOGITS, FusedLMHeadLoss, LMHeadLossSpec
from torchfuser.patterns import _lm_head_probe as probe, _lm_head_probe_decoder as decoder_probe, _probe
from torchfuser.patterns import _lm_head_probe_offset as offset_probe, _lm_head_probe_place as place
from torchfuser.patterns.base import Applied, Pattern, Skip

try:
    from transformers.loss.loss_utils import LOSS_MAPPING, ForCausalLMLoss, ForMaskedLMLoss
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES
except ImportError:  # pragma: no cover - transformers is a dependency
    ForCausalLMLoss, ForMaskedLMLoss, MODEL_FOR_CAUSAL_LM_MAPPING_NAMES, LOSS_MAPPING = None, None, {}, {}
try:  # image-text-to-text models (LLaVA, Qwen-VL, Gemma 3...): the head sits on the outer model
    from transformers.models.auto.modeling_auto import MODEL_FOR_IMAGE_TEXT_TO_TEXT_MAPPING_NAMES
except ImportError:  # pragma: no cover - older transformers
    MODEL_FOR_IMAGE_TEXT_TO_TEXT_MAPPING_NAMES = {}

# Config fields of logit transforms (Cohere's logit_scale, Granite's logits_scaling, muP-style
# output multipliers, ...): where the forward cannot be probed on a stub decoder, present and set → skip.
_UNKNOWN_LOGIT_TRANSFORMS = (
    "logit_scale", "logits_scaling", "logit_scaling", "logits_scale", "output_logits_scale",
    "output_multiplier", "lm_head_multiplier", "logit_multiplier", "mup_width_multiplier",
)


def _causal_lm_names() -> set[str]:
    names = set()
    for mapping in (MODEL_FOR_CAUSAL_LM_MAPPING_NAMES, MODEL_FOR_IMAGE_TEXT_TO_TEXT_MAPPING_NAMES):
        for value in mapping.values():
            names.update(value if isinstance(value, (tuple, list)) else (value,))
    return names


def _text_field(cfg, name: str):
    """A config field, or where the config leaves it unset its text config's (a multimodal model's
    vocabulary and final softcapping live in ``config.text_config``)."""
    value = getattr(cfg, name, None)
    get_text = getattr(cfg, "get_text_config", None)
    if value is None and callable(get_text):
        try:
            value = getattr(get_text(), name, None)
        except (TypeError, ValueError):
            value = None
    return value


_CAUSAL_LM = _causal_lm_names()


def _is_lm(cls: str) -> bool:
    """A language model with a head of its own, by its class's name: a causal LM of the auto mappings (GPT-2's
    ``GPT2LMHeadModel``), any ``*ForCausalLM``, or a ``*LMHeadModel`` (BLIP's text decoder, which its outer model
    hands the labels); the probes decide whether its loss is one the fused loss reproduces."""
    return cls.endswith(("ForCausalLM", "LMHeadModel")) or cls in _CAUSAL_LM


def _with_measured_scale(spec: LMHeadLossSpec, logits: torch.Tensor, cfg=None):
    """``spec`` with the logit scale the forward applies (Cohere multiplies by logit_scale, Granite
    divides by logits_scaling, HyperCLOVAX multiplies by it), or a Skip for any other transform."""
    probe = torch.tensor(PROBE_LOGITS, dtype=torch.float64)
    if spec.softcap is not None:
        if torch.allclose(logits, spec.transform(probe), rtol=1e-6):
            return spec
        # A scale before the softcap, c·tanh(s·z/c) (MuSE Spark's output_multiplier): s measured through atanh where
        # tanh is far from flat, then the whole transform checked on every probe value.
        u = logits / spec.softcap
        if (u.abs() < 0.95).all():
            ratio = spec.softcap * torch.atanh(u) / probe
            scaled = dataclasses.replace(spec, logit_scale=float(ratio[0]))
            if ratio[0] > 0 and torch.allclose(logits, scaled.transform(probe), rtol=1e-6):
                return scaled
        return Skip("the forward's logits are not the softcap of the head's output, scaled by a positive factor or not")
    ratio = logits / probe
    if not (torch.allclose(ratio, ratio[0].expand_as(ratio), rtol=1e-6) and ratio[0] > 0):
        capped = _config_softcap(spec, logits, probe, cfg)
        return capped if capped is not None else Skip(
            f"the forward transforms the logits (head output {PROBE_LOGITS} → "
            f"{tuple(round(v, 4) for v in logits.tolist())}), not as a positive scale or a softcap by a value of its "
            "config that the fused loss reproduces")
    return dataclasses.replace(spec, logit_scale=float(ratio[0]))


def _config_softcap(spec: LMHeadLossSpec, logits: torch.Tensor, probe: torch.Tensor, cfg):
    """``spec`` with the softcap c·tanh(z/c) the forward applies where its config holds c under a name of its own
    (RecurrentGemma's logits_soft_cap, xLSTM's output_logit_soft_cap): c solved from the largest probe value (c·tanh(z/c)
    grows with c), taken only where a float field of the (text) config equals it, then checked on every value."""
    if cfg is None:
        return None
    i = int(probe.abs().argmax())
    z, y = float(probe[i]), float(logits[i])
    if not (0 < y < z):
        return None
    lo, hi = y, 1e7
    for _ in range(200):
        mid = (lo + hi) / 2
        lo, hi = (mid, hi) if mid * math.tanh(z / mid) < y else (lo, mid)
    text = cfg.get_text_config() if hasattr(cfg, "get_text_config") else cfg
    fields = {**vars(cfg), **(vars(text) if text is not None else {})}
    found = [v for v in fields.values() if isinstance(v, float) and abs(v - lo) <= 1e-6 * lo]
    if not found:
        return None
    capped = dataclasses.replace(spec, softcap=found[0])
    return capped if torch.allclose(logits, capped.transform(probe), rtol=1e-6) else None


def _not_plain_linear(head: nn.Linear) -> str:
    """Why calling ``head`` may not be ``h @ W.T + b`` with W, b its only parameters ('' if it is):
    Dory's head is an nn.Linear subclass that multiplies by a learnable logit_scale."""
    extra = sorted(n for n, _ in head.named_parameters() if n not in ("weight", "bias"))
    if extra:
        return f"has parameters besides weight and bias ({', '.join(extra)}), which the fused loss would leave out"
    if "forward" in head.__dict__ or (type(head).forward is not nn.Linear.forward and not _computes_linear(head)):
        return ("has a forward of its own (a subclass's that is not h·Wᵀ + b on a probe, or one set on the instance as "
                "accelerate's hooks do), which the fused loss would not run")
    if hooked(head):
        return "has forward or backward hooks, which the fused loss would not run"
    return ""


def _computes_linear(head: nn.Linear) -> bool:
    """Whether a Linear subclass's own forward computes h·Wᵀ + b from its weight and bias, and nothing else (IDEFICS'
    decoupled Linear without additional features): run on a shallow copy with small random float64 ones."""
    gen = _probe.generator(13)
    w = _probe.randn(5, 6, gen=gen)
    b = None if head.bias is None else _probe.randn(5, gen=gen)
    copy = _probe.shallow_copy(head)
    copy._parameters = {"weight": nn.Parameter(w, requires_grad=False),
                        "bias": None if b is None else nn.Parameter(b, requires_grad=False)}
    x = _probe.randn(2, 3, 6, gen=gen)
    try:
        with torch.no_grad(), _probe.saved_rng():
            y = type(head).forward(copy, x)
    except Exception:
        return False
    return isinstance(y, torch.Tensor) and _probe.close(y, nn.functional.linear(x, w, b))


def _unprobed(module: nn.Module, spec: LMHeadLossSpec):
    """Where the forward does not run on a stub decoder (ProphetNet reshapes the decoder's second
    output): fused only if it computes its loss with transformers' loss_function and its config
    names no logit transform."""
    cfg = getattr(module, "config", None)
    for attr in _UNKNOWN_LOGIT_TRANSFORMS:
        value = _text_field(cfg, attr)
        if value is not None:
            return Skip(f"config.{attr}={value}: a logit scaling the fused loss does not reproduce")
    try:
        source = inspect.getsource(type(module).forward)
    except (OSError, TypeError):
        source = ""
    if "self.loss_function(" not in source:
        return Skip("its forward could not be run with a stand-in decoder to learn how it forms its loss, and it "
                    "does not compute it with transformers' loss_function (ForCausalLMLoss)")
    return spec


@dataclasses.dataclass
class _Uninstall:
    """Undo of the per-instance forward (an object, not a closure: a model saved whole keeps it)."""

    model: nn.Module
    fused: FusedLMHeadLoss

    def __call__(self) -> None:
        unfollow_replicas(self.model)
        if self.model.__dict__.get("forward") is self.fused:
            if self.fused.previous is None:
                del self.model.__dict__["forward"]
            else:
                self.model.__dict__["forward"] = self.fused.previous


def trl_head(forward) -> bool:
    """Whether ``forward`` (a model's instance forward) is TRL's fused LM head (``trl.trainer.utils.
    add_fused_lm_head``, put on the model by TRL's trainers): the calls that pass ``fused_lm_head=True``
    run the decoder and compute per-token log-probabilities and the loss in TRL's own kernels, never
    the model's forward. Told by its code, not its name, which ``functools.wraps`` sets to the model's; found under
    wrappers that keep ``__wrapped__`` (accelerate's mixed-precision wrapper puts two over it when a trainer prepares
    the model)."""
    for _ in range(_WRAPPERS):
        fn = getattr(forward, "__func__", forward)
        if isinstance(fn, FusedLMHeadLoss):
            return False
        module = getattr(fn, "__globals__", {}).get("__name__", "")
        if module.split(".")[0] == "trl" and getattr(getattr(fn, "__code__", None), "co_name", "") == "_fused_forward":
            return True
        forward = getattr(fn, "__wrapped__", None)
        if forward is None:
            return False
    return False


_WRAPPERS = 8  # how deep trl_head looks through wrappers


class LMHeadLossPattern(Pattern):
    name = "lm_head_loss"
    description = ("causal-LM loss via linear_cross_entropy, full logits never materialised (training with labels); "
                   "a tied input embedding's gradient added into the head's in place")
    fused = FusedLMHeadLoss

    def match(self, module):
        if not _is_lm(type(module).__name__):
            return None
        if isinstance(module.__dict__.get("forward"), FusedLMHeadLoss):
            return None  # already fused: optimize is idempotent
        if trl_head(module.__dict__.get("forward")):
            return Skip("TRL's fused LM head (trl add_fused_lm_head) is on the model: it computes the head and loss of "
                        "the trainer's calls (fused_lm_head=True) without calling the model's forward, so a fused loss "
                        "installed over it would never run")
        try:
            params = inspect.signature(module.forward).parameters
        except (TypeError, ValueError):
            return None
        if "labels" not in params:
            return None
        get_head = getattr(module, "get_output_embeddings", None)
        head = get_head() if callable(get_head) else None
        if head is None and (inner := place.inner_head(module, _is_lm)) is not None:
            if isinstance(inner, str):
                return Skip(inner)
            head = inner
        if not isinstance(head, nn.Linear):
            kind = type(head)  # PEFT's LoRA layer is also called Linear: say whose it is
            return Skip(f"output embeddings are {kind.__module__}.{kind.__qualname__}, not a plain torch.nn.Linear "
                        "(an adapter or wrapper on the head: its own forward runs, unfused)")
        why = _not_plain_linear(head)
        if why:
            return Skip(f"output embeddings {type(head).__name__} {why}; only a plain nn.Linear head is fused")
        name = next((n for n, m in module._modules.items() if m is head), None)
        nested = name is None
        if nested and isinstance(name := place.nested_head(module, head, _is_lm), Skip):
            return name
        cfg = getattr(module, "config", None)
        vocab = _text_field(cfg, "vocab_size")
        # A head of another width than the config's vocabulary (Inkling 2's unpadded_vocab_size): its loss must be
        # the probe's over the head's whole width (no logits cut or padded), and only a probe can show that.
        narrow = (f"head has {head.out_features} outputs but the (text) config's vocab_size is {vocab}"
                  if head.out_features != vocab else None)
        if ForCausalLMLoss is None or getattr(module, "_loss_function", ForCausalLMLoss) is not ForCausalLMLoss:
            return Skip("a custom loss_function is set; only transformers' ForCausalLMLoss is reproduced")
        loss_type = getattr(module, "loss_type", None) or getattr(cfg, "loss_type", None)
        # "ForConditionalGeneration" (image-text-to-text models) maps to ForCausalLMLoss too; ForMaskedLMLoss
        # (T5Gemma 2's) is the same cross-entropy of labels unshifted, fused only where the probes show that.
        masked = loss_type is not None and LOSS_MAPPING.get(loss_type) is ForMaskedLMLoss
        if loss_type not in (None, "ForCausalLM") and LOSS_MAPPING.get(loss_type) is not ForCausalLMLoss and not masked:
            return Skip(f"loss_type {loss_type!r}; only ForCausalLM (and ForMaskedLM where probed) is reproduced")
        z_loss = getattr(module, "z_loss_coefficient", None) or getattr(cfg, "z_loss_coefficient", None)
        if isinstance(z_loss, (int, float)) and z_loss > 0:  # Bamba adds coef·mean(logsumexp²) with labels
            return Skip(f"a z-loss on the logits (z_loss_coefficient={z_loss}) that the fused loss does not add")
        softcap = _text_field(cfg, "final_logit_softcapping")
        if softcap is not None and not (isinstance(softcap, (int, float)) and softcap > 0):
            return Skip(f"final_logit_softcapping={softcap!r} is not a positive number")
        spec = LMHeadLossSpec(head=name, softcap=None if softcap is None else float(softcap))
        logits = probe.probe_logits(module, name)
        inner = place.inner_causal_lm(module, name, _is_lm) if nested else None
        if logits is None and inner is not None:
            cls = type(module.get_submodule(inner)).__name__
            return Skip(f"output embeddings at {name!r}, inside {inner!r} ({cls}), a causal LM of its own, fused there "
                        "where it is given the labels; this model's forward did not run on a stand-in for that model's "
                        "decoder (given token ids, and pixel values and image tokens where it requires pixel values: "
                        "it needs other inputs), so whether it computes the loss from its logits, and how, could not "
                        "be learned")
        if logits is None and (nested or masked):
            return Skip((f"output embeddings at {name!r} (not a child of the model)" if nested else
                         f"loss_type {loss_type!r}") + ", and its forward does not run on a stand-in decoder to show "
                        "what it does with the head's output")
        if logits is None and probe.runs_at_vocabulary_width(module, name):
            return Skip("its forward runs only on logits as wide as the vocabulary: it reads or writes them by "
                        "vocabulary position (Chameleon sets its image tokens' logits to the lowest value before the "
                        "loss), which the fused loss, never forming the logits, does not reproduce")
        if logits is None:  # the forward would not run on a stub decoder: judge by the config and the code
            return Skip(narrow + ", and its forward does not run on a stand-in decoder to show its loss uses them "
                        "all") if narrow else _unprobed(module, spec)
        spec = _with_measured_scale(spec, logits, cfg)
        if isinstance(spec, Skip):
            return spec
        changed = probe.probe_logits(module, name, perturb=True)  # the model's other parameters changed
        if changed is None:
            return Skip("its forward did not run again with the model's other parameters changed, so whether its "
                        "logit scaling is read from a parameter (which would need a gradient) could not be told")
        if not torch.allclose(changed, logits, rtol=1e-6):
            return Skip("the forward changes the logits by a value read from a parameter or buffer of the model "
                        "(a learnable logit scale, say); the fused loss would hold that value fixed and give it no gradient")
        if "decoder_input_ids" in params:  # an encoder-decoder's forward may make its decoder's inputs from the labels
            made = decoder_probe.decoder_inputs_from_labels(module, name)
            if made is None or isinstance(made, str):
                return Skip(made or "an encoder-decoder's forward that did not run on a stand-in decoder with labels, so "
                            "whether it makes its decoder's inputs from them could not be told")
            spec = dataclasses.replace(spec, **(made or {}))
        form = probe.probe_loss(module, name, spec)
        leading = offset_probe.leading_positions(module, name) if form is None else None
        if leading:  # scored from a fixed position on (GIT: after its image's positions): checked at that geometry
            form, spec = probe.probe_loss(module, name, spec, extra=leading), dataclasses.replace(spec, leading=leading)
        if form is None:
            return Skip("its forward ran on a stand-in decoder for the logits but not with labels, so how it forms "
                        "its loss could not be learned" + (f" ({narrow})" if narrow else ""))
        if isinstance(form, str):
            smoothing = getattr(module, "label_smoothing", None)  # (BLIP's text decoder reads it at each call)
            if isinstance(smoothing, float) and smoothing > 0:
                form += f"; it smooths its labels (label_smoothing={smoothing}), which the fused kernels do not"
            return Skip(form + (f" ({narrow})" if narrow else ""))
        spec = dataclasses.replace(spec, shift=form[0], loss_kwargs=form[1], refused_kwargs=form[2])
        if not spec.cache_off and "use_cache" in params and decoder_probe.turns_cache_off(module, name, spec.leading):
            spec = dataclasses.replace(spec, cache_off=True)
        return spec

    def parameters_used(self, module):
        get_head = getattr(module, "get_output_embeddings", None)
        head = get_head() if callable(get_head) else None
        if head is None:  # an inner causal LM's head (Nemotron-H Omni's)
            head = place.inner_head(module, _is_lm)
        return head.named_parameters() if isinstance(head, nn.Module) else ()

    def apply(self, root, qualname, module, spec, backend):
        """Install the fused forward on this instance only (the root cannot be swapped)."""
        fused = self.build(module, spec, backend)
        module.__dict__["forward"] = fused
        follow_replicas(module, fused.install_on_replica)
        return Applied(type(fused).__name__, _Uninstall(module, fused))
