// e4m3 (float8_e4m3fn) conversions shared by the FP8 GEMM path (gemm/quantize_fp8.cuh) and the
// FP8 KV cache (qk_norm_rope.cu writes it, attention/decode.cu and prefill.cu read it).
// cuda_fp8.h: one cvt instruction on sm_89+, a software rounding of the same result before.
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_fp8.h>

#include <cstdint>

namespace qwen3_kernels::fp8 {

// Two floats -> two e4m3 bytes (a in the low byte): x / scale rounded to the nearest e4m3,
// saturated to +-448, NaN stays NaN. __fdiv_rn: setup.py builds with --use_fast_math, which would
// make `/` approximate, and the references divide exactly.
__device__ __forceinline__ uint32_t e4m3x2_quantize(float a, float b, float scale) {
  const float2 p = make_float2(__fdiv_rn(a, scale), __fdiv_rn(b, scale));
  return __nv_cvt_float2_to_fp8x2(p, __NV_SATFINITE, __NV_E4M3);
}

// Two floats -> two e4m3 bytes as e4m3x2_quantize, scaled by a multiply (the KV cache's rule,
// reference.quantize_kv: x * (1 / scale) with the reciprocal rounded to fp32 once, on the host).
__device__ __forceinline__ uint32_t e4m3x2_scaled(float a, float b, float inv_scale) {
  return __nv_cvt_float2_to_fp8x2(make_float2(a * inv_scale, b * inv_scale), __NV_SATFINITE,
                                  __NV_E4M3);
}

// Four e4m3 bytes -> two f16x2 words (bytes 0, 1 in lo; 2, 3 in hi; the lower byte in the lower
// half). Exact: every e4m3 value, subnormals included, is an fp16 value.
__device__ __forceinline__ void e4m3x4_to_half2x2(uint32_t w, uint32_t& lo, uint32_t& hi) {
  const __half2_raw a = __nv_cvt_fp8x2_to_halfraw2(
      static_cast<__nv_fp8x2_storage_t>(w & 0xffffu), __NV_E4M3);
  const __half2_raw b = __nv_cvt_fp8x2_to_halfraw2(
      static_cast<__nv_fp8x2_storage_t>(w >> 16), __NV_E4M3);
  lo = static_cast<uint32_t>(a.x) | (static_cast<uint32_t>(a.y) << 16);
  hi = static_cast<uint32_t>(b.x) | (static_cast<uint32_t>(b.y) << 16);
}

// Sixteen e4m3 bytes (one 16-byte chunk of a cache row) -> sixteen fp16 (two 16-byte chunks:
// elements 0..7 in lo, 8..15 in hi).
__device__ __forceinline__ void e4m3x16_to_half(const uint4& in, uint4& lo, uint4& hi) {
  e4m3x4_to_half2x2(in.x, lo.x, lo.y);
  e4m3x4_to_half2x2(in.y, lo.z, lo.w);
  e4m3x4_to_half2x2(in.z, hi.x, hi.y);
  e4m3x4_to_half2x2(in.w, hi.z, hi.w);
}

// A pair of 16-bit floats of type T (an mma fragment register) as an f16x2 pair: the identity for
// fp16; for bf16 exact inside fp16's normal range (q of a Qwen3 head after its RMSNorm and rope).
template <typename T>
__device__ __forceinline__ uint32_t to_half2(uint32_t w);
template <>
__device__ __forceinline__ uint32_t to_half2<__half>(uint32_t w) {
  return w;
}
template <>
__device__ __forceinline__ uint32_t to_half2<__nv_bfloat16>(uint32_t w) {
  const __half2 h = __floats2half2_rn(__uint_as_float(w << 16), __uint_as_float(w & 0xffff0000u));
  return *reinterpret_cast<const uint32_t*>(&h);
}

}  // namespace qwen3_kernels::fp8
