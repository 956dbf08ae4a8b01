"""The residual-norm forms of issue 38's sixth session on CUDA with the defaults (Triton kernels where they apply):
Gemma 4's output scale and third block (per-layer inputs), encoder-decoder decoder layers used as causal LMs
(BART post-norm, mBART and Whisper pre-norm), BERT's output sublayers. Two training steps fused vs unfused, every
gradient (GPU kernels: a tolerance, not bits). Skipped without CUDA; on the CPU the same forms are checked exactly
(tests/test_residual_output_scale.py, _third_block.py, _cross_layers.py, _output_sublayers.py)."""
from __future__ import annotations

import copy

import pytest
import torch

import torchfuser
from torchfuser.modules.residual_output import ResidualOutputForward

from numerics import assert_cuda_steps_like
from tiny_lm import fused_layers, lm_step as step, tiny_model

# model type, the blocks the residual-norm pattern must fuse (layers, or BERT's output sublayers)
_TYPES = [("gemma4_text", 2), ("gemma4_unified_text", 2), ("bart", 2), ("mbart", 2), ("whisper", 2), ("bert", 4)]


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("model_type, blocks", _TYPES, ids=[t[0] for t in _TYPES])
def test_on_cuda_with_the_defaults(model_type, blocks):
    ref = tiny_model(model_type).cuda()
    for m in ref.modules():
        if "layer_scalar" in m._buffers:
            m.layer_scalar.fill_(0.5)
    fused = copy.deepcopy(ref)
    torchfuser.optimize(fused)
    outputs = [m for m in fused.modules() if isinstance(m.__dict__.get("forward"), ResidualOutputForward)]
    assert len(fused_layers(fused)) + len(outputs) == blocks, str(torchfuser.report(fused))
    assert_cuda_steps_like(ref, fused, step)
