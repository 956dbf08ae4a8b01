"""Where ``optimize`` was called inside a model: ``torchfuser.report`` sees through wrappers.

Users optimize a model and then wrap it (``peft.get_peft_model``, DDP / FSDP's ``.module``,
``torch.compile``'s ``._orig_mod``), or wrap it first and optimize the wrapper; either way the
report is the one kept on the module that ``optimize`` was given. That module is found by its
state, not by the wrappers' types, so any wrapper that holds the model as a submodule works.
"""
from __future__ import annotations

from torch import nn

from torchfuser import walker

LAST_REPORT = "_torchfuser_last_report"  # kept by optimize when nothing was fused (no walker state)


def _has_report(module: nn.Module) -> bool:
    return walker.state(module) is not None or LAST_REPORT in module.__dict__


def optimized(model: nn.Module) -> tuple[str, nn.Module | None]:
    """(qualified name, module) of the outermost module of ``model`` that ``optimize`` was called on
    (``("", model)`` for the model itself), or ("", None) when there is none."""
    for name, module in model.named_modules():  # preorder: the model first, then wrappers' insides
        if _has_report(module):
            return name, module
    return "", None
