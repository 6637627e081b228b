// The linear configurations the dispatcher (linear.cu) chooses from, one per TU.
// Plain C++ (no CUTLASS): the dispatcher includes only this.
#pragma once

#include <cstddef>
#include <cstdint>
#include <cuda_runtime.h>

namespace qwen3_kernels::linear_detail {

// How the CUTLASS stream-K scheduler cuts the work (the hand-written split-K kernel ignores it).
enum class Decomposition { kHeuristic, kDataParallel, kSplitK, kStreamK };

struct Problem {
  void* out;              // [m, n]
  const void* x;          // [m, k]
  const void* w;          // [n, k]
  int64_t m, n, k;
  void* workspace;        // workspace_bytes, from <config>_workspace(problem); may be null if 0
  size_t workspace_bytes;
  int device;             // current device
  int sm_count;           // its SM count (cached by the dispatcher)
  Decomposition decomposition;
  int splits;             // for kSplitK: split-K factor
  cudaStream_t stream;
};

// CUTLASS sm90 configurations (linear_<config>_<dtype>.cu). Each returns cudaErrorNotSupported
// when CUTLASS's can_implement refuses the problem.
#define QWEN3_LINEAR_DECLARE(NAME)            \
  size_t NAME##_workspace(const Problem& p);    \
  cudaError_t NAME(const Problem& p);

QWEN3_LINEAR_DECLARE(sm90_tile_128x128_bf16)   // mid-size prefill
QWEN3_LINEAR_DECLARE(sm90_tile_128x128_fp16)
QWEN3_LINEAR_DECLARE(sm90_tile_128x256_bf16)   // large prefill
QWEN3_LINEAR_DECLARE(sm90_tile_128x256_fp16)
QWEN3_LINEAR_DECLARE(sm90_swap_64x16_bf16)     // batch-invariant (the table in linear.cu)
QWEN3_LINEAR_DECLARE(sm90_swap_64x16_fp16)
QWEN3_LINEAR_DECLARE(sm90_swap_64x32_bf16)
QWEN3_LINEAR_DECLARE(sm90_swap_64x32_fp16)
QWEN3_LINEAR_DECLARE(sm90_swap_64x64_bf16)
QWEN3_LINEAR_DECLARE(sm90_swap_64x64_fp16)
QWEN3_LINEAR_DECLARE(sm90_swap_64x128_bf16)
QWEN3_LINEAR_DECLARE(sm90_swap_64x128_fp16)
QWEN3_LINEAR_DECLARE(sm90_swap_128x64_bf16)
QWEN3_LINEAR_DECLARE(sm90_swap_128x64_fp16)
QWEN3_LINEAR_DECLARE(sm90_swap_128x128_bf16)
QWEN3_LINEAR_DECLARE(sm90_swap_128x128_fp16)
QWEN3_LINEAR_DECLARE(sm90_swap_128x96_bf16)
QWEN3_LINEAR_DECLARE(sm90_swap_128x96_fp16)
QWEN3_LINEAR_DECLARE(sm90_swap_128x192_bf16)
QWEN3_LINEAR_DECLARE(sm90_swap_128x192_fp16)

#undef QWEN3_LINEAR_DECLARE

// Hand-written weight-streaming split-K kernel (linear_splitk.cu), m <= 8, no workspace: the K
// splits of one row block form a thread-block cluster and reduce through distributed shared
// memory. bf16 == true for bfloat16, else float16. num_splits in [1, 8].
constexpr int kSplitKMaxM = 8;
cudaError_t splitk_gemm(const Problem& p, bool bf16, int num_splits);

// Hand-written weight-streaming GEMV on the CUDA cores (linear_gemv.cu), m == 1, no workspace,
// no split-K: each warp owns 2 or 4 weight rows over the whole K. Builds for sm_80 too.
cudaError_t gemv_gemm(const Problem& p, bool bf16);
// The same GEMV with silu_and_mul fused into its end: p.n = 2 I weight rows (gate | up), p.out is
// [1, I] = silu(gate) * up (linear_silu_and_mul).
cudaError_t gemv_silu_and_mul(const Problem& p, bool bf16);

}  // namespace qwen3_kernels::linear_detail
