#!/usr/bin/env bash
# Builds build/ab from main.cu and the variants of linear_fp8_gemv.cu given as name:file (see
# main.cu's header and ../ab_variants.sh). Needs nvcc only (no torch, no GPU, no CUTLASS).
#   git show main:csrc/kernels/gemm/linear_fp8_gemv.cu > /tmp/main.cu
#   bash benchmarks/linear_fp8_gemv_ab/build.sh main:/tmp/main.cu \
#     tree:csrc/kernels/gemm/linear_fp8_gemv.cu
#   benchmarks/linear_fp8_gemv_ab/build/ab [rounds]  # on the GPU: carry its build/ folder
here="$(cd "$(dirname "$0")" && pwd)"
exec bash "$here/../ab_variants.sh" "$here" "$@"
