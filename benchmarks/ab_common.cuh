// Shared by the torch-free A / B harnesses (prefill_ab/, decode_ab/, linear_fp8_ab/): the CUDA
// error check and hashed fills (the same inputs in every variant and every run).
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp8.h>
#include <cuda_runtime.h>

#include <cstdint>
#include <cstdio>
#include <cstdlib>

#define CK(x)                                                                       \
  do {                                                                              \
    cudaError_t e = (x);                                                            \
    if (e != cudaSuccess) {                                                         \
      printf("CUDA error %s at %s:%d\n", cudaGetErrorString(e), __FILE__, __LINE__); \
      exit(1);                                                                      \
    }                                                                               \
  } while (0)

// A hash of (i, seed) as a float in [-1, 1).
__device__ inline float hash_uniform(size_t i, uint32_t seed) {
  uint32_t h = static_cast<uint32_t>(i) * 2654435761u ^ seed;
  h ^= h >> 15; h *= 2246822519u; h ^= h >> 13; h *= 3266489917u; h ^= h >> 16;
  return ((h & 0xffff) / 65536.f - 0.5f) * 2.f;
}
// x[i] = amp * hash_uniform(i, seed), rounded to bf16.
__global__ void fill_bf16(__nv_bfloat16* x, size_t n, uint32_t seed, float amp) {
  for (size_t i = blockIdx.x * (size_t)blockDim.x + threadIdx.x; i < n;
       i += (size_t)gridDim.x * blockDim.x)
    x[i] = __float2bfloat16(amp * hash_uniform(i, seed));
}
// The same rounded to e4m3 (saturated: never NaN).
__global__ void fill_e4m3(uint8_t* x, size_t n, uint32_t seed, float amp) {
  for (size_t i = blockIdx.x * (size_t)blockDim.x + threadIdx.x; i < n;
       i += (size_t)gridDim.x * blockDim.x)
    x[i] = __nv_cvt_float_to_fp8(amp * hash_uniform(i, seed), __NV_SATFINITE, __NV_E4M3);
}
// x[i] = base * (1 + spread * hash_uniform(i, seed)), in fp32 (scales).
__global__ void fill_f32(float* x, size_t n, uint32_t seed, float base, float spread) {
  for (size_t i = blockIdx.x * (size_t)blockDim.x + threadIdx.x; i < n;
       i += (size_t)gridDim.x * blockDim.x)
    x[i] = base * (1.f + spread * hash_uniform(i, seed));
}
