// linear configuration "swap_128x192", fp16: a batch-invariant tile, operands
// swapped: 128 weight rows x 192 tokens per tile (two consumer warp groups).
// Data-parallel only (each tile's whole K in one CTA, in order), like every batch-invariant tile.
// The template and what it shows: linear_sm90.cuh; when it is chosen: linear.cu.
#include "linear_sm90.cuh"

namespace qwen3_kernels::linear_detail {

using Sm90_swap_128x192_fp16 = Sm90Gemm<cutlass::half_t,  // x, w, out
                            cute::Shape<cute::_128, cute::_192, cute::_64>,  // tile (M', N', K)
                            cute::Shape<cute::_1, cute::_1, cute::_1>,  // cluster
                            true,  // swapped: out^T = w @ x^T
                            true>;  // cooperative: two consumer warp groups

size_t sm90_swap_128x192_fp16_workspace(const Problem& p) { return Sm90_swap_128x192_fp16::workspace_size(p); }
cudaError_t sm90_swap_128x192_fp16(const Problem& p) { return Sm90_swap_128x192_fp16::run(p); }

}  // namespace qwen3_kernels::linear_detail
