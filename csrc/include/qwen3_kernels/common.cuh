// Device helpers shared by the kernels: dtype traits and 16-byte vector access.
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <cstdint>

#include "qwen3_kernels/launchers.h"

namespace qwen3_kernels {

template <typename T>
struct TypeTraits;

template <>
struct TypeTraits<__half> {
  static __device__ __forceinline__ float to_float(__half v) { return __half2float(v); }
  static __device__ __forceinline__ __half from_float(float v) { return __float2half_rn(v); }
};

template <>
struct TypeTraits<__nv_bfloat16> {
  static __device__ __forceinline__ float to_float(__nv_bfloat16 v) { return __bfloat162float(v); }
  static __device__ __forceinline__ __nv_bfloat16 from_float(float v) { return __float2bfloat16_rn(v); }
};

template <typename T>
__device__ __forceinline__ float to_float(T v) { return TypeTraits<T>::to_float(v); }

template <typename T>
__device__ __forceinline__ T from_float(float v) { return TypeTraits<T>::from_float(v); }

// Eight 16-bit values: one 16-byte load or store.
template <typename T>
struct alignas(16) Vec8 {
  T v[8];
};

template <typename T>
__device__ __forceinline__ Vec8<T> load_vec8(const T* p) {
  Vec8<T> r;
  *reinterpret_cast<uint4*>(&r) = *reinterpret_cast<const uint4*>(p);
  return r;
}

template <typename T>
__device__ __forceinline__ void store_vec8(T* p, const Vec8<T>& r) {
  *reinterpret_cast<uint4*>(p) = *reinterpret_cast<const uint4*>(&r);
}

// Whether a pointer may be accessed 16 bytes at a time (the kernels' vector paths).
inline bool aligned16(const void* p) { return reinterpret_cast<uintptr_t>(p) % 16 == 0; }

// 16 bytes of a weight streamed once (the GEMV, split-K): read once, never again, so keep it out
// of L1. kL2Lines also asks L2 for whole 256-byte lines (.L2::256B); without it L2 fetches the
// 32-byte sectors asked for. The hint costs the GEMV's pattern (a warp's 512 bytes of each of its
// rows per load) bandwidth: a read probe (H200; branch experiment/one-off-probes) read Qwen3-8B's
// gate_up weight with the GEMV's loads and arithmetic in 52.3 us with it, 49.7 us without.
template <bool kL2Lines = true>
__device__ __forceinline__ uint4 load_stream(const void* p) {
  uint4 r;
  if constexpr (kL2Lines) {
    asm volatile("ld.global.nc.L1::no_allocate.L2::256B.v4.u32 {%0, %1, %2, %3}, [%4];"
                 : "=r"(r.x), "=r"(r.y), "=r"(r.z), "=r"(r.w)
                 : "l"(p));
  } else {
    asm volatile("ld.global.nc.L1::no_allocate.v4.u32 {%0, %1, %2, %3}, [%4];"
                 : "=r"(r.x), "=r"(r.y), "=r"(r.z), "=r"(r.w)
                 : "l"(p));
  }
  return r;
}

// Eight 16-bit values (one 16-byte load, element 0 in the low half of .x) to fp32, from registers:
// load the 16 bytes first (one LDS.128 / LDG.128), then convert. (Reading the elements through a
// T* cast of the word made nvcc issue eight 2-byte shared loads instead.)
template <typename T>
__device__ __forceinline__ void to_float8(const uint4& v, float (&f)[8]);

template <>
__device__ __forceinline__ void to_float8<__nv_bfloat16>(const uint4& v, float (&f)[8]) {
  // bf16 is the top half of an fp32: a shift or a mask, no conversion instruction.
  const uint32_t words[4] = {v.x, v.y, v.z, v.w};
#pragma unroll
  for (int i = 0; i < 4; ++i) {
    f[2 * i] = __uint_as_float(words[i] << 16);
    f[2 * i + 1] = __uint_as_float(words[i] & 0xffff0000u);
  }
}

template <>
__device__ __forceinline__ void to_float8<__half>(const uint4& v, float (&f)[8]) {
  const uint32_t words[4] = {v.x, v.y, v.z, v.w};
#pragma unroll
  for (int i = 0; i < 4; ++i) {
    const float2 p = __half22float2(*reinterpret_cast<const __half2*>(&words[i]));
    f[2 * i] = p.x;
    f[2 * i + 1] = p.y;
  }
}

__device__ __forceinline__ float warp_sum(float v) {
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
  return v;
}

// Max over the warp; every lane gets the result (fmaxf: a NaN lane loses to any number).
__device__ __forceinline__ float warp_max(float v) {
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) v = fmaxf(v, __shfl_xor_sync(0xffffffffu, v, o));
  return v;
}

// Sum over the block (blockDim.x a multiple of 32); every thread gets the result. Safe to call
// again right after: the trailing barrier keeps a later call from overwriting the partials before
// every warp has read them.
__device__ __forceinline__ float block_sum(float v) {
  __shared__ float partial[32];
  v = warp_sum(v);
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  if (lane == 0) partial[warp] = v;
  __syncthreads();
  const int nwarps = blockDim.x / 32;
  v = lane < nwarps ? partial[lane] : 0.0f;
  v = warp_sum(v);
  __syncthreads();
  return v;
}

// Host side: call a kernel template with T = __half or __nv_bfloat16.
#define QWEN3_DISPATCH_HALF(dtype, T, ...)                  \
  [&]() -> cudaError_t {                                   \
    if ((dtype) == ::qwen3_kernels::DType::kFloat16) {     \
      using T = __half;                                    \
      return __VA_ARGS__();                                \
    } else {                                               \
      using T = __nv_bfloat16;                             \
      return __VA_ARGS__();                                \
    }                                                      \
  }()

}  // namespace qwen3_kernels
