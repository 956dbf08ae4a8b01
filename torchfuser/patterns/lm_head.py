"""LM head + loss on causal language models.

A candidate is a Hugging Face causal LM (``*ForCausalLM``, or any class the auto mapping lists for
causal LM, e.g. ``GPT2LMHeadModel``) whose forward takes ``labels``. It is fused when its output
embedding is a direct ``nn.Linear`` child as wide as the vocabulary, its loss function is HF's
``ForCausalLMLoss``, and what its forward does to the logits is a positive scale and/or Gemma-2's
final softcapping: measured by running the model's own forward on a shallow copy whose decoder is
a stub and whose head returns probe values (where that cannot run, a config naming a logit
transform means skip). The model cannot be replaced in its parent (it is usually the root), so
``apply`` installs a per-instance forward and its undo removes it; the class is never touched.
"""
from __future__ import annotations

import dataclasses
import inspect

import torch
from torch import nn

from torchfuser.modules.base import follow_replicas, unfollow_replicas
from torchfuser.modules.lm_head import PROBE_LOGITS, CaptureHead, FusedLMHeadLoss, LMHeadLossSpec
from torchfuser.patterns import _probe
from torchfuser.patterns.base import Applied, Pattern, Skip

try:
    from transformers.loss.loss_utils import ForCausalLMLoss
    from transformers.modeling_outputs import BaseModelOutputWithPast
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES
except ImportError:  # pragma: no cover - transformers is a dependency
    ForCausalLMLoss, BaseModelOutputWithPast, MODEL_FOR_CAUSAL_LM_MAPPING_NAMES = None, None, {}

# Config fields of logit transforms (Cohere's logit_scale, Granite's logits_scaling, muP-style
# output multipliers, ...): where the forward cannot be probed on a stub decoder, present and set → skip.
_UNKNOWN_LOGIT_TRANSFORMS = (
    "logit_scale", "logits_scaling", "logit_scaling", "logits_scale", "output_logits_scale",
    "output_multiplier", "lm_head_multiplier", "logit_multiplier", "mup_width_multiplier",
)


def _causal_lm_names() -> set[str]:
    names = set()
    for value in MODEL_FOR_CAUSAL_LM_MAPPING_NAMES.values():
        names.update(value if isinstance(value, (tuple, list)) else (value,))
    return names


_CAUSAL_LM = _causal_lm_names()


class _StubDecoder(nn.Module):
    """Stands in for the decoder while the model's own forward is probed: fixed final hidden states
    and, for whatever else the forward reads of its decoder (Falcon-H1's lm_head_multiplier), the
    real decoder's attributes."""

    def __init__(self, hidden: torch.Tensor, real: nn.Module):
        super().__init__()
        self.hidden = hidden
        self.__dict__["_real"] = real  # not a submodule

    def forward(self, *args, **kwargs):
        out = BaseModelOutputWithPast(last_hidden_state=self.hidden)
        # Fields other decoders add (a mixture of experts' router_logits): absent, as None.
        return _OrNone(out)

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


def _probe_logits(model: nn.Module, head: str, width: int) -> torch.Tensor | None:
    """What the model's forward makes of the head's output when the head returns PROBE_LOGITS, on
    a shallow copy whose decoder is a stub (nothing of the model runs but its top level); None
    where the forward does not run that way."""
    prefix = getattr(model, "base_model_prefix", None)
    if not isinstance(prefix, str) or not isinstance(model._modules.get(prefix), nn.Module):
        return None
    probe = _probe.shallow_copy(model)
    probe._modules[prefix] = _StubDecoder(_probe.randn(1, 2, width, gen=_probe.generator(7)), model._modules[prefix])
    probe._modules[head] = CaptureHead()
    try:
        with torch.no_grad():
            out = type(model).forward(probe, input_ids=torch.zeros(1, 2, dtype=torch.long))
            logits = out[0] if isinstance(out, tuple) else getattr(out, "logits", None)
            if not (isinstance(logits, torch.Tensor) and logits.shape[-1] == len(PROBE_LOGITS)):
                return None
            # Back to the CPU: some forwards move logits to the head's device (the meta device under inspect).
            return logits.detach().reshape(-1, len(PROBE_LOGITS))[0].double().cpu()
    except Exception:
        return None


def _with_measured_scale(spec: LMHeadLossSpec, logits: torch.Tensor):
    """``spec`` with the logit scale the forward applies (Cohere multiplies by logit_scale, Granite
    divides by logits_scaling, HyperCLOVAX multiplies by it), or a Skip for any other transform."""
    probe = torch.tensor(PROBE_LOGITS, dtype=torch.float64)
    if spec.softcap is not None:
        # A scale as well as the softcap would not be told apart at these values: softcap alone.
        return spec if torch.allclose(logits, spec.transform(probe), rtol=1e-6) else Skip(
            "the forward's logits are not the softcap of the head's output")
    ratio = logits / probe
    if not (torch.allclose(ratio, ratio[0].expand_as(ratio), rtol=1e-6) and ratio[0] > 0):
        return Skip(f"the forward transforms the logits (head output {PROBE_LOGITS} → "
                    f"{tuple(round(v, 4) for v in logits.tolist())}), not as a positive scale the fused loss reproduces")
    return dataclasses.replace(spec, logit_scale=float(ratio[0]))


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


class LMHeadLossPattern(Pattern):
    name = "lm_head_loss"
    description = ("causal-LM loss via linear_cross_entropy, full logits never materialised (training with labels); "
                   "a tied input embedding's gradient added into the head's in place")
    fused = FusedLMHeadLoss

    def match(self, module):
        cls = type(module).__name__
        if not (cls.endswith("ForCausalLM") or cls in _CAUSAL_LM):
            return None
        if isinstance(module.__dict__.get("forward"), FusedLMHeadLoss):
            return None  # already fused: optimize is idempotent
        try:
            params = inspect.signature(module.forward).parameters
        except (TypeError, ValueError):
            return None
        if "labels" not in params:
            return None
        get_head = getattr(module, "get_output_embeddings", None)
        head = get_head() if callable(get_head) else None
        if not isinstance(head, nn.Linear):
            return Skip(f"output embeddings are {type(head).__name__}, not an nn.Linear")
        name = next((n for n, m in module._modules.items() if m is head), None)
        if name is None:
            return Skip("output embeddings are not a direct child of the model")
        cfg = getattr(module, "config", None)
        vocab = getattr(cfg, "vocab_size", None)
        if head.out_features != vocab:
            return Skip(f"head has {head.out_features} outputs but config.vocab_size is {vocab}")
        if ForCausalLMLoss is None or getattr(module, "_loss_function", ForCausalLMLoss) is not ForCausalLMLoss:
            return Skip("a custom loss_function is set; only transformers' ForCausalLMLoss is reproduced")
        loss_type = getattr(module, "loss_type", None) or getattr(cfg, "loss_type", None)
        if loss_type not in (None, "ForCausalLM"):
            return Skip(f"loss_type {loss_type!r}; only ForCausalLM is reproduced")
        z_loss = getattr(module, "z_loss_coefficient", None) or getattr(cfg, "z_loss_coefficient", None)
        if isinstance(z_loss, (int, float)) and z_loss > 0:  # Bamba adds coef·mean(logsumexp²) with labels
            return Skip(f"a z-loss on the logits (z_loss_coefficient={z_loss}) that the fused loss does not add")
        softcap = getattr(cfg, "final_logit_softcapping", None)
        if softcap is not None and not (isinstance(softcap, (int, float)) and softcap > 0):
            return Skip(f"final_logit_softcapping={softcap!r} is not a positive number")
        spec = LMHeadLossSpec(head=name, softcap=None if softcap is None else float(softcap))
        logits = _probe_logits(module, name, head.in_features)
        if logits is None:  # the forward would not run on a stub decoder: judge by the config
            for attr in _UNKNOWN_LOGIT_TRANSFORMS:
                value = getattr(cfg, attr, None)
                if value is not None:
                    return Skip(f"config.{attr}={value}: a logit scaling the fused loss does not reproduce")
            return spec
        return _with_measured_scale(spec, logits)

    def parameters_used(self, module):
        get_head = getattr(module, "get_output_embeddings", None)
        head = get_head() if callable(get_head) else None
        return head.named_parameters() if isinstance(head, nn.Module) else ()

    def apply(self, root, qualname, module, spec, backend):
        """Install the fused forward on this instance only (the root cannot be swapped)."""
        fused = self.build(module, spec, backend)
        module.__dict__["forward"] = fused
        follow_replicas(module, fused.install_on_replica)
        return Applied(type(fused).__name__, _Uninstall(module, fused))
