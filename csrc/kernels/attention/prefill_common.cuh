// Shared by the paged_attention_prefill kernels (prefill.cu: mma.sync, sm_80+; prefill_sm90.cu:
// wgmma, sm_90a): the kernel parameters, the head_dim, and the small PTX wrappers both use.
#pragma once

#include "qwen3_kernels/common.cuh"

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

// ---- PTX wrappers -----------------------------------------------------------------------------

__device__ __forceinline__ uint32_t smem_addr(const void* p) {
  return static_cast<uint32_t>(__cvta_generic_to_shared(p));
}

// 16-byte global -> shared copy; when !valid the destination is zero-filled and nothing is read,
// so rows past the end of a sequence are finite zeros (P = 0 times garbage V could be NaN).
__device__ __forceinline__ void cp_async_16(uint32_t dst, const void* src, bool valid) {
  const int src_bytes = valid ? 16 : 0;
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(dst), "l"(src),
               "r"(src_bytes));
}

__device__ __forceinline__ void cp_async_commit() {
  asm volatile("cp.async.commit_group;\n" ::: "memory");
}

template <int N>
__device__ __forceinline__ void cp_async_wait() {
  asm volatile("cp.async.wait_group %0;\n" ::"n"(N) : "memory");
}

// Two floats -> two 16-bit values in one register (lo in the low half, as the MMA expects).
template <typename T>
__device__ __forceinline__ uint32_t pack2(float lo, float hi);

template <>
__device__ __forceinline__ uint32_t pack2<__nv_bfloat16>(float lo, float hi) {
  __nv_bfloat162 v = __floats2bfloat162_rn(lo, hi);
  return *reinterpret_cast<uint32_t*>(&v);
}

template <>
__device__ __forceinline__ uint32_t pack2<__half>(float lo, float hi) {
  __half2 v = __floats2half2_rn(lo, hi);
  return *reinterpret_cast<uint32_t*>(&v);
}

__device__ __forceinline__ float fast_exp2(float x) {
  float y;
  asm("ex2.approx.ftz.f32 %0, %1;\n" : "=f"(y) : "f"(x));
  return y;
}

// Host side: the wgmma kernel (prefill_sm90.cu). available() is true when the current device runs
// its sm_90a code (an H100/H200 with this binary built for sm_90a); launch() returns
// cudaErrorNotSupported otherwise.
bool sm90_available();
cudaError_t launch_sm90(const PrefillParams& p, int batch, int max_seqlen_q, DType dtype,
                        cudaStream_t stream);

}  // namespace prefill
}  // namespace qwen3_kernels
