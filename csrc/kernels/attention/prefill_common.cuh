// Shared by the paged_attention_prefill kernels (prefill.cu: mma.sync, sm_80+; prefill_sm90_ws.cu:
// wgmma, sm_90a): the kernel parameters and the head_dim (PTX wrappers: qwen3_kernels/mma.cuh).
#pragma once

#include "qwen3_kernels/common.cuh"
#include "qwen3_kernels/mma.cuh"

namespace qwen3_kernels {
namespace prefill {

constexpr int kHeadDim = 128;

struct PrefillParams {
  void* out;                    // [Tq, Hq, D]
  const void* q;                // [Tq, Hq, D]
  const void* k_cache;          // [num_blocks, block_size, Hkv, D]
  const void* v_cache;          // [num_blocks, block_size, Hkv, D]
  const int32_t* cu_seqlens_q;  // [B + 1]
  const int32_t* seq_lens_k;    // [B]
  const int32_t* block_tables;  // [B, max_blocks]
  int num_q_heads;
  int num_kv_heads;
  int group;                    // num_q_heads / num_kv_heads
  int block_size_log2;          // block_size is a power of two (16..256)
  int max_blocks;
  float scale_log2;             // softmax scale * log2(e): scores go straight into exp2
};

// Online softmax: scales a warpgroup's 64 x 128 output accumulator (a thread's wgmma fragment
// o[64]: rows g and g + 8 of its warp, two columns each of 16 n8 tiles) by its rows' alpha.
__device__ __forceinline__ void rescale_rows(float (&o)[64], const float (&alpha)[2]) {
#pragma unroll
  for (int j = 0; j < kHeadDim / 8; ++j) {
    o[4 * j + 0] *= alpha[0];
    o[4 * j + 1] *= alpha[0];
    o[4 * j + 2] *= alpha[1];
    o[4 * j + 3] *= alpha[1];
  }
}

// ---- PTX wrappers -----------------------------------------------------------------------------

__device__ __forceinline__ float fast_exp2(float x) {
  float y;
  asm("ex2.approx.ftz.f32 %0, %1;\n" : "=f"(y) : "f"(x));
  return y;
}

// Host side of the warp-specialised wgmma kernel (prefill_sm90_ws.cu). sm90_available() is true
// when the current device runs its sm_90a code (an H100/H200 with this binary built for sm_90a);
// launch_sm90_ws() returns cudaErrorNotSupported otherwise. persistent: one CTA per SM walking
// the work tiles, else one CTA per work tile.
bool sm90_available();
cudaError_t launch_sm90_ws(const PrefillParams& p, int batch, int max_seqlen_q, DType dtype,
                           bool persistent, cudaStream_t stream);

}  // namespace prefill
}  // namespace qwen3_kernels
