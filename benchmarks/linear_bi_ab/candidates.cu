// Batch-invariant tiles linear.cu does not have, for main.cu: data-parallel like every
// batch-invariant tile, so each gives the production tiles' bits (main.cu checks it).
//   swap 64x96: 96 tokens a tile with one consumer warp group (128x96 is linear.cu's)
//   swap 64x192: 192 tokens a tile, one consumer warp group (128x192 is linear.cu's)
//   swap 64x256 / 128x256: 256 tokens a tile (M = 193..256 in one tile)
#include "linear_sm90.cuh"

namespace qwen3_kernels::linear_detail {

template <int kM, int kN, bool kCoop>
using Cand = Sm90Gemm<cutlass::bfloat16_t, cute::Shape<cute::Int<kM>, cute::Int<kN>, cute::_64>,
                      cute::Shape<cute::_1, cute::_1, cute::_1>, true, kCoop>;

#define CAND(M, N, COOP)                                                             \
  size_t cand_swap_##M##x##N##_workspace(const Problem& p) {                         \
    return Cand<M, N, COOP>::workspace_size(p);                                      \
  }                                                                                  \
  cudaError_t cand_swap_##M##x##N(const Problem& p) { return Cand<M, N, COOP>::run(p); }

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

}  // namespace qwen3_kernels::linear_detail
