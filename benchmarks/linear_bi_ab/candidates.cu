// Batch-invariant tiles linear.cu does not have, for main.cu: data-parallel like every
// batch-invariant tile, so each gives the production tiles' bits (main.cu checks it).
//   swap 64x96: 96 tokens a tile with one consumer warp group (128x96 is linear.cu's)
//   swap 64x192: 192 tokens a tile, one consumer warp group (128x192 is linear.cu's)
//   swap 64x256 / 128x256: 256 tokens a tile (M = 193..256 in one tile)
#include "linear_sm90.cuh"

namespace qwen3_kernels::linear_detail {

template <int kM, int kN, bool kCoop, int kK = 64>
using Cand = Sm90Gemm<cutlass::bfloat16_t, cute::Shape<cute::Int<kM>, cute::Int<kN>, cute::Int<kK>>,
                      cute::Shape<cute::_1, cute::_1, cute::_1>, true, kCoop>;

#define CANDK(NAME, M, N, COOP, K)                                                   \
  size_t cand_##NAME##_workspace(const Problem& p) {                                 \
    return Cand<M, N, COOP, K>::workspace_size(p);                                   \
  }                                                                                  \
  cudaError_t cand_##NAME(const Problem& p) { return Cand<M, N, COOP, K>::run(p); }
#define CAND(M, N, COOP) CANDK(swap_##M##x##N, M, N, COOP, 64)

#ifndef CAND_PART
#define CAND_PART 0
#endif
#if CAND_PART == 0 || CAND_PART == 1
CAND(64, 96, false)
CAND(64, 192, false)
#endif
#if CAND_PART == 0 || CAND_PART == 2
CAND(64, 256, false)
CAND(128, 256, true)
#endif
// Few tokens (main.cu's "small" run, M = 1..64): a narrower token side, swap 64x16 with K steps
// of 128 (linear.cu's takes 256), swap 64x32 / 64x64 with steps of 256 (linear.cu's take 128 / 64),
// and a 128-row cooperative tile that can split K (the split-K ones give other bits: usable only
// with the same split at every M of the shape).
#if CAND_PART == 0 || CAND_PART == 3
CANDK(swap_64x8, 64, 8, false, 128)
CANDK(swap_64x16_k128, 64, 16, false, 128)
#endif
#if CAND_PART == 0 || CAND_PART == 4
CANDK(swap_128x16, 128, 16, true, 128)
#endif
#if CAND_PART == 0 || CAND_PART == 5
CANDK(swap_64x32_k256, 64, 32, false, 256)
CANDK(swap_64x64_k256, 64, 64, false, 256)
#endif

}  // namespace qwen3_kernels::linear_detail
