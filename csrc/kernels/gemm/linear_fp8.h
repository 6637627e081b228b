// The kernels kernels/gemm/linear_fp8.cu chooses from for the FP8 block-scaled projection
// (launchers.h: linear_fp8). Plain C++: the dispatcher includes only this.
#pragma once

#include <cstddef>
#include <cstdint>
#include <cuda_runtime.h>

namespace qwen3_kernels::fp8 {

constexpr int kGroup = 128;  // weight block edge and activation group width
constexpr float kMax = 448.f;          // largest finite e4m3
constexpr float kScaleFloor = 1e-10f;  // amax of an all-zero group (reference.FP8_SCALE_FLOOR)

// linear_fp8_gemv.cu: M == 1, the weight-streaming pass. Quantizes x per 128-group itself (the
// same values quantize_fp8 gives), then out[n] = sum_g w_scale[n / 128, g] * x_scale[g] *
// sum_{k in g} xq[k] * w[n, k]. bf16 x / out; N % 8 == 0, K % 16 == 0.
cudaError_t gemv(void* out,             // [1, N] bf16
                 const void* x,         // [1, K] bf16
                 const void* w,         // [N, K] e4m3
                 const float* w_scales, // [ceil(N/128), ceil(K/128)]
                 int64_t n, int64_t k, cudaStream_t stream);

// linear_fp8_gemv.cu: the same pass over w = gate rows | up rows [2I, K], writing
// out[i] = silu(gate_i) * up_i (each rounded to bf16 first) [1, I]. 2I % 16 == 0.
cudaError_t gemv_silu_and_mul(void* out,              // [1, I] bf16
                              const void* x,          // [1, K] bf16
                              const void* w,          // [2I, K] e4m3
                              const float* w_scales,  // [ceil(2I/128), ceil(K/128)]
                              int64_t two_i, int64_t k, cudaStream_t stream);

// linear_fp8_gemv.cu: a few tokens (T <= 16), the same weight-streaming pass with the mma's 8
// columns as 8 tokens: x pre-quantized (quantize_fp8's xq and token-contiguous x_scales, as the
// GEMM below takes them). tokens_gemv_fits says where it is chosen (linear_fp8.cu).
constexpr int kTokensPerTile = 8;      // tokens of one mma tile: the mma's N
constexpr int64_t kTokensWideN = 16384;  // N from which 2..16 tokens go to the GEMM instead
bool tokens_gemv_fits(int64_t t, int64_t n);
cudaError_t gemv_tokens(void* out,              // [T, N] bf16
                        const void* xq,         // [T, K] e4m3
                        const float* x_scales,  // [ceil(K/128), scale_stride]
                        int64_t scale_stride,
                        const void* w,          // [N, K] e4m3
                        const float* w_scales,  // [ceil(N/128), ceil(K/128)]
                        int64_t t, int64_t n, int64_t k, cudaStream_t stream);

// linear_fp8_sm90.cu: the CUTLASS sm90 block-scaled GEMM (warp-specialised, TMA, fp32
// accumulation, scales applied in the mainloop). x_scales token-contiguous: scale of token t,
// group g at x_scales[g * scale_stride + t], scale_stride >= M and a multiple of 4 (TMA: 16-byte
// rows). cudaErrorNotSupported where the device or CUTLASS's can_implement refuses.
size_t gemm_workspace_size(int64_t m, int64_t n, int64_t k);
cudaError_t gemm(void* out,              // [M, N] bf16
                 const void* xq,         // [M, K] e4m3
                 const float* x_scales,  // [ceil(K/128), scale_stride]
                 int64_t scale_stride,
                 const void* w,          // [N, K] e4m3
                 const float* w_scales,  // [ceil(N/128), ceil(K/128)]
                 int64_t m, int64_t n, int64_t k,
                 void* workspace, size_t workspace_bytes, cudaStream_t stream);

}  // namespace qwen3_kernels::fp8
