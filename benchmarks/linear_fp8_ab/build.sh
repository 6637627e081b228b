#!/usr/bin/env bash
# Builds build/ab: every configuration of linear_fp8_sm90.cu's block-scaled FP8 GEMM and the
# weight-streaming passes of linear_fp8_gemv.cu timed on the same inputs (main.cu includes the
# GEMM's file, so it reaches each configuration directly; quantize_fp8.cu makes its xq). Needs nvcc
# and the nvidia-cutlass package (CUTLASS_DIR to override); no torch, no GPU. Several minutes: the
# CUTLASS instantiations.
#   bash benchmarks/linear_fp8_ab/build.sh && benchmarks/linear_fp8_ab/build/ab [rounds] [large]
# (`large`: 8B and 32B projections at M = 2048..8192, Coop128 against its scheduler variants)
set -euo pipefail
here="$(cd "$(dirname "$0")" && pwd)"
root="$(cd "$here/../.." && pwd)"
py="${PYTHON:-python3}"
cutlass="${CUTLASS_DIR:-$("$py" -c 'import cutlass_library, os; print(os.path.join(os.path.dirname(cutlass_library.__file__), "source"))')}"
mkdir -p "$here/build"
nvcc -std=c++17 -O3 --expt-relaxed-constexpr --expt-extended-lambda -DNDEBUG --use_fast_math \
  -gencode=arch=compute_90a,code=sm_90a -I"$root/csrc/include" -I"$root/csrc/kernels/gemm" -I"$root/benchmarks" \
  -I"$cutlass/include" -I"$cutlass/tools/util/include" "$here/main.cu" \
  "$root/csrc/kernels/gemm/linear_fp8_gemv.cu" "$root/csrc/kernels/gemm/quantize_fp8.cu" -o "$here/build/ab"
echo "built $here/build/ab"
