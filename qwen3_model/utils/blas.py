"""Which BLAS library torch's matmuls use while the model runs."""

from __future__ import annotations

import contextlib

import torch


@contextlib.contextmanager
def prefer_cublaslt(use_cuda: bool):
    """torch's matmuls through cuBLASLt while the model runs (the projections that
    qwen3_kernels.linear hands to at::mm, and the LM head), restored after.

    Measured (H200, Qwen3-8B workload of benchmarks/bench_engine.py, alternating in one call, two
    machines): 10,011 / 10,000 tok/s against 9,920 / 9,952 with cuBLAS, and 9,760 / 9,731 against
    9,675 / 9,655: every decode step ~1% faster (at 128 sequences o and down run nvjet 64x64
    without cuBLAS's split-K reduce after down; o at 256 tokens 16.8 against 18.4 us), prefill
    steps equal. Only while the model runs, so a program that embeds the engine keeps its own
    choice for its own matmuls. torch warns once per process that the setting is experimental.
    """
    if not use_cuda:
        yield
        return
    old = torch.backends.cuda.preferred_blas_library()
    torch.backends.cuda.preferred_blas_library("cublaslt")
    try:
        yield
    finally:
        torch.backends.cuda.preferred_blas_library(old)
