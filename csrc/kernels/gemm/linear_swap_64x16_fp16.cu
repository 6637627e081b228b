// linear configuration "swap_64x16", fp16: a batch-invariant tile, operands
// swapped: 64 weight rows x 16 tokens per tile (one consumer warp group):
// a decode step's weight is streamed by N / 64 CTAs.
// Data-parallel only (each tile's whole K in one CTA, in order), like every batch-invariant tile.
// K steps of 256: the same bits as 128 (the k16 wgmma chain is in order either way) and fewer
// pipeline waits per byte: benchmarks/linear_bi_ab "small", M = 1..16, Qwen3-8B o 13.6 against
// 14.5 us and down 35.1 against 36.9 (faster than the default mode's GEMV, 35.9), the rest equal
// (H100).
// The template and what it shows: linear_sm90.cuh; when it is chosen: linear.cu.
#include "linear_sm90.cuh"

namespace qwen3_kernels::linear_detail {

using Sm90_swap_64x16_fp16 = Sm90Gemm<cutlass::half_t,  // x, w, out
                            cute::Shape<cute::_64, cute::_16, cute::_256>,  // tile (M', N', K)
                            cute::Shape<cute::_1, cute::_1, cute::_1>,  // cluster
                            true,  // swapped: out^T = w @ x^T
                            false>;  // one consumer warp group, one tile per CTA

size_t sm90_swap_64x16_fp16_workspace(const Problem& p) { return Sm90_swap_64x16_fp16::workspace_size(p); }
cudaError_t sm90_swap_64x16_fp16(const Problem& p) { return Sm90_swap_64x16_fp16::run(p); }

}  // namespace qwen3_kernels::linear_detail
