"""The Triton backend (CUDA/ROCm; the CPU under TRITON_INTERPRET=1). Kernels arrive per op."""
