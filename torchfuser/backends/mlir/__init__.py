"""The MLIR backend (CPU): torch-mlir → linalg → TorchFuser's passes → LLVM JIT. Kernels arrive per op."""
