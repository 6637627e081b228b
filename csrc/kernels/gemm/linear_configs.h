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
  int splits;             // for kSplitK
  cudaStream_t stream;
};

// CUTLASS sm90 configurations (linear_<config>_<dtype>.cu). Each returns cudaErrorNotSupported
// when CUTLASS's can_implement refuses the problem.
#define QWEN3_LINEAR_DECLARE(NAME)            \
  size_t NAME##_workspace(const Problem& p);    \
  cudaError_t NAME(const Problem& p);

QWEN3_LINEAR_DECLARE(sm90_swap_128x64_bf16)    // decode: out^T = w @ x^T, tile 128 weight rows x 64 tokens
QWEN3_LINEAR_DECLARE(sm90_swap_128x64_fp16)
QWEN3_LINEAR_DECLARE(sm90_tile_128x128_bf16)   // mid-size prefill
QWEN3_LINEAR_DECLARE(sm90_tile_128x128_fp16)
QWEN3_LINEAR_DECLARE(sm90_tile_128x256_bf16)   // large prefill
QWEN3_LINEAR_DECLARE(sm90_tile_128x256_fp16)

#undef QWEN3_LINEAR_DECLARE

// Hand-written weight-streaming split-K kernel (linear_splitk.cu), m <= 64, no workspace:
// the K splits of one row block form a thread-block cluster and reduce through distributed
// shared memory. bf16 == true for bfloat16, else float16. num_splits in [1, 8].
constexpr int kSplitKMaxM = 64;
enum class SplitKVariant {
  kRound2,       // as measured on the H200 on 2026-11-29 (the table's "splitk")
  kPrefetch,     // + each warp prefetches its rows into L2 two steps ahead of its loads
  kPrefetchPdl,  // + programmatic dependent launch: the first steps' L2 prefetch overlaps the
                 //   previous kernel in the stream; x is read and out written only after it ends
};
cudaError_t splitk_gemm(const Problem& p, bool bf16, int num_splits, SplitKVariant variant);
// The split count used when none is given: the largest of 4, 2, 1 that keeps every CTA resident
// in one wave (measured: 4 splits beat 5 and 8; 32B's 160 row blocks x 4 needed a second wave).
int splitk_default_splits(int64_t m, int64_t n, int64_t k, int sm_count);

// Hand-written weight-streaming GEMV on the CUDA cores (linear_gemv.cu), m <= 8, no workspace,
// no split-K: each warp owns rows_per_warp (1, 2 or 4; 0 = gemv_default_rows_per_warp) weight
// rows over the whole K. Builds for sm_80 too. The choice table's pick at M = 1 (measured
// 2026-11-30); at M = 3 and 8 it lost to cuBLAS.
constexpr int kGemvMaxM = 8;
cudaError_t gemv_gemm(const Problem& p, bool bf16, int rows_per_warp);
int gemv_default_rows_per_warp(int64_t m, int64_t n);
// The same GEMV with silu_and_mul fused into its end: p.n = 2 I weight rows (gate | up), p.out is
// [m, I] = silu(gate) * up (linear_silu_and_mul). rows_per_warp 2 or 4 (0 = the default, >= 2).
cudaError_t gemv_silu_and_mul(const Problem& p, bool bf16, int rows_per_warp);

// Hand-written weight-streaming wgmma kernel (linear_stream.cu), m <= 128, no workspace: a CTA
// owns 256 weight rows and every token; the K splits of one row block form a cluster and reduce
// through distributed shared memory; TMA loads. sm_90a only. num_splits in [1, 8], or 0: the most
// splits whose clusters are all resident at once.
constexpr int kStreamMaxM = 128;
cudaError_t stream_gemm(const Problem& p, bool bf16, int num_splits);

}  // namespace qwen3_kernels::linear_detail
