// silu(gate) * up on eight 16-bit values at once: the math of silu_and_mul's vector path
// (activation.cu), shared with silu_and_mul_fp8 (gemm/quantize_fp8.cu) so that both round the
// same values.
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include "qwen3_kernels/common.cuh"

namespace qwen3_kernels {

// Two halves <-> two floats in one conversion instruction each way.
template <typename T>
struct Pair;
template <>
struct Pair<__half> {
  using type = __half2;
  static __device__ __forceinline__ float2 to(type v) { return __half22float2(v); }
  static __device__ __forceinline__ type from(float2 f) { return __float22half2_rn(f); }
};
template <>
struct Pair<__nv_bfloat16> {
  using type = __nv_bfloat162;
  static __device__ __forceinline__ float2 to(type v) { return __bfloat1622float2(v); }
  static __device__ __forceinline__ type from(float2 f) { return __float22bfloat162_rn(f); }
};

// silu(g) * u in fp32; __fdividef: the divisor is >= 1 (or inf, giving the right limit 0).
__device__ __forceinline__ float silu_mul(float g, float u) {
  return __fdividef(g, 1.0f + __expf(-g)) * u;
}

template <typename T>
__device__ __forceinline__ Vec8<T> silu_mul8(const Vec8<T>& gate, const Vec8<T>& up) {
  using P = Pair<T>;
  const auto* g2 = reinterpret_cast<const typename P::type*>(gate.v);
  const auto* u2 = reinterpret_cast<const typename P::type*>(up.v);
  Vec8<T> r;
  auto* r2 = reinterpret_cast<typename P::type*>(r.v);
#pragma unroll
  for (int i = 0; i < 4; ++i) {
    const float2 g = P::to(g2[i]), u = P::to(u2[i]);
    r2[i] = P::from(make_float2(silu_mul(g.x, u.x), silu_mul(g.y, u.y)));
  }
  return r;
}

}  // namespace qwen3_kernels
