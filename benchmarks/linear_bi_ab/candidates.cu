// Batch-invariant tiles linear.cu does not have (yet), for main.cu: data-parallel like every
// batch-invariant tile, so each gives the production tiles' bits (main.cu checks it).
//   swap 64x96 / 128x96: 96 tokens a tile (M = 176: two tiles, 192 rows against 256)
//   swap 64x192 / 128x192: 192 tokens a tile (M = 129..192: one tile a weight tile)
//   swap 64x256 / 128x256 (M = 193..256 in one tile)
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
CAND(128, 96, true)
CAND(64, 192, false)
#endif
#if CAND_PART == 0 || CAND_PART == 2
CAND(128, 192, true)
CAND(64, 256, false)
CAND(128, 256, true)
#endif

}  // namespace qwen3_kernels::linear_detail
