"""Shared by the tests: the CUDA skip marker and the error measure."""
import pytest
import torch

import qwen3_kernels

HAS_CUDA = torch.cuda.is_available() and qwen3_kernels.has_cuda_kernels()

# Tests that need a GPU with the built extension use `@requires_cuda`; they skip cleanly elsewhere.
requires_cuda = pytest.mark.skipif(not HAS_CUDA, reason="needs a CUDA GPU and the built extension")


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    """||a - b|| / ||b|| in fp64 (b the reference)."""
    a64, b64 = a.double(), b.double()
    return ((a64 - b64).norm() / b64.norm().clamp_min(1e-30)).item()
