"""The hi/lo split kernel's H200 code rounds as the torch spelling does (backends/triton/hilo_split.py): the
scale's product rounded (``mul.rn``) before the subtraction (``sub.rn``), never contracted into an ``fma``
(which would skip that rounding), no flush of subnormals (``.ftz``), round-to-nearest-even casts. Compiled
for sm_90 on any machine (the launches recorded on meta tensors, as test_triton_targets.py does)."""
from __future__ import annotations

import re

import pytest

pytest.importorskip("triton")

from test_triton_targets import _launches  # noqa: E402
from torchfuser.backends.triton import _crosscompile as cc, targets  # noqa: E402


def test_split_ptx_keeps_torch_rounding():
    launches = [l for l in _launches("sm_90") if l.op == "hilo_split"]
    assert {l.kwargs["SCALED"] for l in launches} == {True, False}
    for launch in launches:
        ptx = cc.compile_launch(launch, targets.TARGETS["sm_90"].gpu_target()).asm["ptx"]
        assert not re.search(r"\bfma\.", ptx) and ".ftz" not in ptx
        assert re.search(r"sub\.rn\.f32", ptx) and re.search(r"cvt\.rn\.bf16", ptx)
        assert bool(re.search(r"mul\.rn\.f32", ptx)) == launch.kwargs["SCALED"]
