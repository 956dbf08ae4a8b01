"""LM head + loss on causal language models.

A candidate is a Hugging Face causal LM (``*ForCausalLM``, or any class the auto mapping lists for
causal LM, e.g. ``GPT2LMHeadModel``) whose forward takes ``labels``. It is fused when its output
embedding is a direct ``nn.Linear`` child as wide as the vocabulary, its loss function is HF's
``ForCausalLMLoss``, and its config asks for no logit transform other than Gemma-2's final
softcapping. The model cannot be replaced in its parent (it is usually the root), so ``apply``
installs a per-instance forward and its undo removes it; the class is never touched.
"""
from __future__ import annotations

import inspect

from torch import nn

from torchfuser.modules.base import follow_replicas, unfollow_replicas
from torchfuser.modules.lm_head import FusedLMHeadLoss, LMHeadLossSpec
from torchfuser.patterns.base import Applied, Pattern, Skip

try:
    from transformers.loss.loss_utils import ForCausalLMLoss
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES
except ImportError:  # pragma: no cover - transformers is a dependency
    ForCausalLMLoss, MODEL_FOR_CAUSAL_LM_MAPPING_NAMES = None, {}

# Config fields of logit transforms this pattern does not reproduce (Cohere's logit_scale,
# Granite's logits_scaling, muP-style output multipliers, ...). Present and set → skip.
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


class LMHeadLossPattern(Pattern):
    name = "lm_head_loss"
    description = "causal-LM loss via linear_cross_entropy, full logits never materialised (training with labels)"
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
        for attr in _UNKNOWN_LOGIT_TRANSFORMS:
            value = getattr(cfg, attr, None)
            if value is not None:
                return Skip(f"config.{attr}={value}: a logit scaling the fused loss does not reproduce")
        softcap = getattr(cfg, "final_logit_softcapping", None)
        if softcap is not None and not (isinstance(softcap, (int, float)) and softcap > 0):
            return Skip(f"final_logit_softcapping={softcap!r} is not a positive number")
        return LMHeadLossSpec(head=name, softcap=None if softcap is None else float(softcap))

    def parameters_used(self, module):
        get_head = getattr(module, "get_output_embeddings", None)
        head = get_head() if callable(get_head) else None
        return head.named_parameters() if isinstance(head, nn.Module) else ()

    def apply(self, root, qualname, module, spec, backend):
        """Install the fused forward on this instance only (the root cannot be swapped)."""
        fused = self.build(module, spec, backend)
        module.__dict__["forward"] = fused
        follow_replicas(module, fused.install_on_replica)

        def undo() -> None:
            unfollow_replicas(module)
            if module.__dict__.get("forward") is fused:
                if fused.previous is None:
                    del module.__dict__["forward"]
                else:
                    module.__dict__["forward"] = fused.previous

        return Applied(type(fused).__name__, undo)
