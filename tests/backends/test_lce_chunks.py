"""How the Triton linear + cross-entropy splits its tokens into chunks (no kernel runs: the rule alone)."""
from __future__ import annotations

import pytest

from torchfuser.backends.triton import linear_cross_entropy as L


@pytest.mark.parametrize("n,v,h,most", [(8192, 256000, 2048, 6), (1536, 262208, 2560, 1), (8192, 128256, 2048, 6)])
def test_chunks_of_a_trained_head_amortise_its_gradient(n, v, h, most):
    """Each bf16 chunk after the first reads and writes all of dW again: Gemma-2B's head (256k × 2048, 8192
    tokens) once ran 32 chunks of 256 tokens, 32 ms a step of dW additions on an H100; a chunk's logits now
    get at least dW's bytes (Gemma-2B: 6 chunks; Gemma-3-4B's 262k × 2560 head over 1536 tokens: one;
    llama1b's 128k × 2048: 6, as before). A frozen head (no dW) keeps the small chunks."""
    dw = v * h * 2
    grads = n * h * 2 + dw
    rows = L.chunk_rows(n, v, 2, grads, h, dw_bytes=dw)
    assert len(L.chunks(n, rows)) <= most
    assert rows * v * 2 <= max(L.EXTRA_BYTES, dw)  # the floor is dW's bytes, not more
    frozen = L.chunk_rows(n, v, 2, n * h * 2, h)
    assert frozen * v * 2 <= L.EXTRA_BYTES
