"""Model layers. Each calls the qwen3_kernels ops, so the same layer runs on CPU (reference) and CUDA."""
