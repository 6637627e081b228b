// linear configuration "tile_128x256", bf16: large prefill: 128 tokens x 256 weight rows per tile (each consumer
// warp group runs 64x256 wgmmas); a 2x1 cluster multicasts each weight tile to two token tiles.
// The template and what it shows: linear_sm90.cuh; when it is chosen: the table in linear.cu.
#include "linear_sm90.cuh"

namespace qwen3_kernels::linear_detail {

using Sm90_tile_128x256_bf16 = Sm90Gemm<cutlass::bfloat16_t,  // x, w, out
                            cute::Shape<cute::_128, cute::_256, cute::_64>,  // tile (M', N', K)
                            cute::Shape<cute::_2, cute::_1, cute::_1>,  // cluster
                            false>;  // swapped: out^T = w @ x^T

size_t sm90_tile_128x256_bf16_workspace(const Problem& p) { return Sm90_tile_128x256_bf16::workspace_size(p); }
cudaError_t sm90_tile_128x256_bf16(const Problem& p) { return Sm90_tile_128x256_bf16::run(p); }

}  // namespace qwen3_kernels::linear_detail
