// linear configuration "tile_128x32", fp16: the batch-invariant mode's projection at up to 128 tokens:
// 128 tokens x 32 weight rows per tile (each consumer warp group runs 64x32 wgmmas), so a decode
// step's weight is streamed by N / 32 CTAs instead of the N / 128 of tile_128x128, with the same
// per-output sums (each tile's whole K in one CTA, in order: data-parallel only).
// The template and what it shows: linear_sm90.cuh; when it is chosen: linear.cu.
#include "linear_sm90.cuh"

namespace qwen3_kernels::linear_detail {

using Sm90_tile_128x32_fp16 = Sm90Gemm<cutlass::half_t,  // x, w, out
                            cute::Shape<cute::_128, cute::_32, cute::_64>,  // tile (M', N', K)
                            cute::Shape<cute::_1, cute::_1, cute::_1>,  // cluster
                            false>;  // swapped: out^T = w @ x^T

size_t sm90_tile_128x32_fp16_workspace(const Problem& p) { return Sm90_tile_128x32_fp16::workspace_size(p); }
cudaError_t sm90_tile_128x32_fp16(const Problem& p) { return Sm90_tile_128x32_fp16::run(p); }

}  // namespace qwen3_kernels::linear_detail
