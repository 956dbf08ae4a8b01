"""The residual-norm forms of issue 38's third CPU session on CUDA with the defaults (Triton kernels where they
apply): a first norm that is an identity (ModernBERT-decoder), an attention given its input as v, k and q (CTRL),
sandwich norms (Gemma-3, GLM-4), one-tensor mixers (Qwen3-Next), a flattened tuple MLP viewed back (Llama 4).
Two training steps fused vs unfused, every gradient (GPU kernels: a tolerance, not bits). Skipped without CUDA;
on the CPU the same forms are checked exactly (tests/test_residual_first_norm_forms.py, _sandwich_norms.py,
_mixer_layers.py, _block_outputs.py)."""
from __future__ import annotations

import copy

import pytest
import torch

import torchfuser

from numerics import assert_cuda_steps_like
from tiny_lm import fused_layers, lm_step as step, tiny_model

_TYPES = ["modernbert-decoder", "ctrl", "gemma3_text", "glm4", "qwen3_next", "llama4_text"]


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("model_type", _TYPES)
def test_on_cuda_with_the_defaults(model_type):
    ref = tiny_model(model_type).cuda()
    fused = copy.deepcopy(ref)
    torchfuser.optimize(fused)
    assert len(fused_layers(fused)) == 2, str(torchfuser.report(fused))
    assert_cuda_steps_like(ref, fused, step)
