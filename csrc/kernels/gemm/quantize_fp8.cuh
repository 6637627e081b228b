// The per-token per-128-group e4m3 quantization of 16-bit activations (reference.quantize_fp8),
// as device functions: quantize_fp8.cu runs it over [T, K], and the FP8 GEMV
// (linear_fp8_gemv.cu) runs it on its one token inside every CTA, so both give the same values.
//
// A group of 128 is 16 lanes x 8 elements (one 16-byte load each); half a warp reduces its amax
// with 4 shuffles. Everything is exact against the fp32 reference: the amax is a max over bit
// patterns, the scale and the quotients are correctly rounded divisions (__fdiv_rn: setup.py
// builds with --use_fast_math, which would make `/` approximate), and the e4m3 rounding is the
// hardware's round-to-nearest-even with saturation (cuda_fp8.h: one cvt on sm_89+, a software
// rounding of the same result before).
#pragma once

#include <cuda_fp8.h>

#include <cstdint>

#include "linear_fp8.h"
#include "qwen3_kernels/common.cuh"
#include "qwen3_kernels/e4m3.cuh"

namespace qwen3_kernels::fp8 {

constexpr int kGroupLanes = kGroup / 8;  // lanes of one group: 8 16-bit elements a lane

// max |v| over eight 16-bit floats (bf16 or fp16), as the 16-bit pattern of that float. With the
// sign cleared the patterns order as the magnitudes do, and every NaN sorts above Inf, so a NaN
// wins as in torch's amax (fmaxf would drop it).
__device__ __forceinline__ uint32_t abs_max_bits8(const uint4& v) {
  constexpr uint32_t kMagnitude = 0x7fff7fffu;
  const uint32_t m = __vmaxu2(__vmaxu2(v.x & kMagnitude, v.y & kMagnitude),
                              __vmaxu2(v.z & kMagnitude, v.w & kMagnitude));
  return max(m & 0xffffu, m >> 16);
}

// The max over the kGroupLanes lanes of a group (aligned lanes 0..15 or 16..31 of a warp); every
// lane of the warp must call it.
__device__ __forceinline__ uint32_t group_max_bits(uint32_t bits) {
#pragma unroll
  for (int o = kGroupLanes / 2; o > 0; o >>= 1)
    bits = max(bits, __shfl_xor_sync(0xffffffffu, bits, o));
  return bits;
}

template <typename T>
__device__ __forceinline__ float bits_to_float(uint32_t bits);
template <>
__device__ __forceinline__ float bits_to_float<__nv_bfloat16>(uint32_t bits) {
  return __uint_as_float(bits << 16);
}
template <>
__device__ __forceinline__ float bits_to_float<__half>(uint32_t bits) {
  return __half2float(__ushort_as_half(static_cast<unsigned short>(bits)));
}

// scale = max(amax, 1e-10) / 448. The comparison keeps a NaN amax NaN (torch's clamp_min does).
__device__ __forceinline__ float group_scale(float amax) {
  return __fdiv_rn(amax < kScaleFloor ? kScaleFloor : amax, kMax);
}

// Eight 16-bit values -> eight e4m3 bytes (element 0 in the low byte of .x): x / scale rounded to
// the nearest e4m3, saturated to +-448 (NaN stays NaN).
template <typename T>
__device__ __forceinline__ uint2 quantize8(const uint4& v, float scale) {
  float f[8];
  to_float8<T>(v, f);
  uint32_t q[2] = {0u, 0u};
#pragma unroll
  for (int i = 0; i < 4; ++i) {
    const uint32_t pair = e4m3x2_quantize(f[2 * i], f[2 * i + 1], scale);
    q[i / 2] |= pair << (16 * (i % 2));
  }
  return make_uint2(q[0], q[1]);
}

}  // namespace qwen3_kernels::fp8
