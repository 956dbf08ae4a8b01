"""TorchFuser's MLIR pass pipeline, one named stage per step, from upstream MLIR passes only.

Each entry is a textual pass pipeline run on the whole module; ``pipeline.py`` runs them in
order and can print the IR after any of them.
"""
from __future__ import annotations

# Producer/consumer fusion on the row bodies: elementwise producers fuse into their
# consumers, including into reductions (x² into Σx²), and unit dims fold away.
FUSE = (
    "builtin.module(func.func(linalg-fuse-elementwise-ops, linalg-fold-unit-extent-dims,"
    " linalg-fuse-elementwise-ops), canonicalize, cse)"
)

# After the wrapper is appended: the bodies are inlined into the chunk loops.
INLINE = "builtin.module(inline, symbol-dce, canonicalize, cse)"

# Destination passing: outputs are the caller's buffers (eliminate-empty-tensors lets the last
# op of each row output write straight into them); chunk temporaries have static shapes, so
# they are hoisted out of the chunk loop and freed once at the end (no allocation per chunk).
BUFFERIZE = (
    "builtin.module(eliminate-empty-tensors, empty-tensor-to-alloc-tensor,"
    " one-shot-bufferize{bufferize-function-boundaries=1 function-boundary-type-conversion=identity-layout-map},"
    " canonicalize, cse, func.func(buffer-hoisting, buffer-loop-hoisting),"
    " ownership-based-buffer-deallocation, canonicalize, buffer-deallocation-simplification,"
    " bufferization-lower-deallocations, cse, canonicalize)"
)

# Loops, tiling, vectorisation: linalg → affine loop nests; fuse the nests of one chunk
# (reduction and consumer share the row loop, so a chunk row is read from L1); vectorise the
# innermost dimension (reductions get vector accumulators).
LOOPS_AFFINE = (
    "builtin.module(func.func(convert-linalg-to-affine-loops, affine-loop-fusion{{mode=producer}}, affine-scalrep,"
    " canonicalize, affine-super-vectorize{{virtual-vector-size={vector} vectorize-reductions=1}},"
    " canonicalize, lower-affine), canonicalize, cse, loop-invariant-code-motion)"
)

# What runs: linalg → scf loops per chunk (the chunk loop is the tiling: R rows of every
# tensor stay in L2); loop-invariant code (per-row statistics) is hoisted out of the inner
# loops; the innermost loops are vectorised by LLVM's loop vectoriser once the fastmath stage
# has made sums reassociable. LOOPS_AFFINE (affine fusion + super-vectoriser) was measured
# slower here: the super-vectoriser gives up on strided (row-stride ≠ width) memrefs.
# (memref.copy between strided views would call a runtime library: made a linalg.copy first.)
LOOPS = (
    "builtin.module(func.func(refback-munge-memref-copy, convert-linalg-to-loops), canonicalize, cse, loop-invariant-code-motion{{}})"
)

# LLVM: transcendental functions expanded to arithmetic so that they vectorise; bf16 math and arith
# ops computed in f32 and rounded back (what LLVM's promotion does on x86, which has no bf16 arithmetic),
# and the f32 → bf16 rounding itself expanded to integer arithmetic (to nearest even, NaN kept quiet, as
# torch rounds): on a CPU without AVX512-BF16, LLVM lowers that rounding to a call of compiler-rt's
# __truncsfbf2, which neither libgcc 12 nor the process provides (the JIT then finds no @kernel). Then
# the standard conversions.
LLVM = (
    "builtin.module(func.func(math-expand-ops, math-extend-to-supported-types{target-type=f32},"
    " arith-emulate-unsupported-floats{source-types=bf16 target-type=f32}, arith-expand{include-bf16=true},"
    " convert-vector-to-scf, convert-linalg-to-loops), convert-scf-to-cf,"
    " expand-strided-metadata, lower-affine, finalize-memref-to-llvm, convert-math-to-llvm, convert-math-to-libm,"
    " convert-vector-to-llvm, convert-arith-to-llvm, convert-func-to-llvm, convert-cf-to-llvm,"
    " reconcile-unrealized-casts)"
)


def stages(vector: int = 16) -> list[tuple[str, str]]:
    """The stages that run after the ``wrapper`` stage."""
    return [("inline", INLINE), ("bufferize", BUFFERIZE), ("loops", LOOPS.format(vector=vector)), ("llvm", LLVM)]
