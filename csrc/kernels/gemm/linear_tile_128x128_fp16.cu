// linear configuration "tile_128x128", fp16: mid-size prefill: 128 tokens x 128 weight rows per tile;
// a 2x1 cluster multicasts each weight tile to two token tiles.
// The template and what it shows: linear_sm90.cuh; when it is chosen: the table in linear.cu.
#include "linear_sm90.cuh"

namespace qwen3_kernels::linear_detail {

using Sm90_tile_128x128_fp16 = Sm90Gemm<cutlass::half_t,  // x, w, out
                            cute::Shape<cute::_128, cute::_128, cute::_64>,  // tile (M', N', K)
                            cute::Shape<cute::_2, cute::_1, cute::_1>,  // cluster
                            false>;  // swapped: out^T = w @ x^T

size_t sm90_tile_128x128_fp16_workspace(const Problem& p) { return Sm90_tile_128x128_fp16::workspace_size(p); }
cudaError_t sm90_tile_128x128_fp16(const Problem& p) { return Sm90_tile_128x128_fp16::run(p); }

}  // namespace qwen3_kernels::linear_detail
