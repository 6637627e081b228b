// linear_fp8: the FP8 block-scaled projection of Qwen3-*-FP8 checkpoints. The one place that picks
// its kernel, from the shape:
//   - M == 1: the weight-streaming GEMV (linear_fp8_gemv.cu), which quantizes x itself: one launch.
//   - M > 1: quantize_fp8 (quantize_fp8.cu) into the workspace, then
//     - up to 16 tokens where N < 16384 (fp8::tokens_gemv_fits): the same weight-streaming pass
//       over every token at once (linear_fp8_gemv.cu: gemv_tokens); wider weights (gate_up) go
//       to the GEMM from 2 tokens: its swapped 128 x 16 tile (wgmma reads e4m3 as stored) ran
//       gate_up at T = 2..16 in 31.4-31.7 us against gemv_tokens' 35.7-42.9 (linear_fp8_ab);
//     - above: the CUTLASS block-scaled GEMM (linear_fp8_sm90.cu).
//   Measured (H200, Qwen3-8B projections, quantize_fp8 included, CUDA-graph replays; us):
//   gemv_tokens at T = 2..8 qkv 14.3-14.8, o 12.4-12.7, gate_up 38.8-39.2, down 23.4-25.2; at
//   T = 16 17.9 / 12.7 / 46.4 / 24.2; the GEMM at T = 16 23.8 / 23.6 / 44.7 / 34.6 (it takes
//   ~24 us up to T = 64 on the small projections: its stream-K tiles of 128 tokens). At T = 32
//   the GEMM wins on gate_up (64.3 against ~47) and ties on qkv.
// Both compute quantize_fp8(x) @ dequant(w)^T in fp32 (reference.linear_fp8), so the choice moves
// only the summation order. linear_fp8_quantized takes x already quantized (rms_norm_fp8,
// fused_add_rms_norm_fp8, silu_and_mul_fp8 produce it): the same choice above one token, and the
// weight-streaming pass at one token too (its x needs no quantizing).
#include <cstdint>

#include "linear_fp8.h"
#include "qwen3_kernels/launchers.h"

namespace qwen3_kernels {
namespace {

constexpr size_t kAlign = 256;
size_t round_up(size_t v, size_t a) { return (v + a - 1) / a * a; }

// Workspace of M > 1: [xq: M x K e4m3][x_scales: G x scale_stride fp32][the GEMM's own, if run].
struct Layout {
  int64_t scale_stride;
  size_t scales_offset, gemm_offset, bytes;
};

Layout layout(int64_t m, int64_t n, int64_t k) {
  Layout l;
  const int64_t groups = (k + fp8::kGroup - 1) / fp8::kGroup;
  l.scale_stride = (m + 3) / 4 * 4;
  l.scales_offset = round_up(static_cast<size_t>(m * k), kAlign);
  l.gemm_offset =
      l.scales_offset + round_up(static_cast<size_t>(groups * l.scale_stride) * 4, kAlign);
  l.bytes = l.gemm_offset +
            (fp8::tokens_gemv_fits(m, n) ? 0 : fp8::gemm_workspace_size(m, n, k));
  return l;
}

}  // namespace

size_t linear_fp8_quantized_workspace_size(int64_t m, int64_t n, int64_t k) {
  return m <= 0 || fp8::tokens_gemv_fits(m, n) ? 0 : fp8::gemm_workspace_size(m, n, k);
}

cudaError_t linear_fp8_quantized(void* out, const void* xq, const float* x_scales,
                                 int64_t scale_stride, const void* w,
                                 const float* weight_scale_inv, int64_t m, int64_t n, int64_t k,
                                 void* workspace, size_t workspace_bytes, cudaStream_t stream) {
  if (m <= 0) return cudaSuccess;
  if (n % 8 || k % 16 || scale_stride < m || scale_stride % 4) return cudaErrorInvalidValue;
  if (fp8::tokens_gemv_fits(m, n))
    return fp8::gemv_tokens(out, xq, x_scales, scale_stride, w, weight_scale_inv, m, n, k, stream);
  if (workspace_bytes < fp8::gemm_workspace_size(m, n, k)) return cudaErrorInvalidValue;
  return fp8::gemm(out, xq, x_scales, scale_stride, w, weight_scale_inv, m, n, k, workspace,
                   workspace_bytes, stream);
}

cudaError_t linear_fp8_silu_and_mul(void* out, const void* x, const void* w,
                                    const float* weight_scale_inv, int64_t two_i, int64_t k,
                                    cudaStream_t stream) {
  return fp8::gemv_silu_and_mul(out, x, w, weight_scale_inv, two_i, k, stream);
}

size_t linear_fp8_workspace_size(int64_t m, int64_t n, int64_t k) {
  return m <= 1 ? 0 : layout(m, n, k).bytes;
}

cudaError_t linear_fp8(void* out, const void* x, const void* w, const float* weight_scale_inv,
                       int64_t m, int64_t n, int64_t k, void* workspace, size_t workspace_bytes,
                       cudaStream_t stream) {
  if (m <= 0) return cudaSuccess;
  if (n % 8 || k % 16) return cudaErrorInvalidValue;
  if (m == 1) return fp8::gemv(out, x, w, weight_scale_inv, n, k, stream);
  const Layout l = layout(m, n, k);
  if (workspace == nullptr || workspace_bytes < l.bytes) return cudaErrorInvalidValue;
  auto* base = static_cast<uint8_t*>(workspace);
  auto* xq = base;
  auto* x_scales = reinterpret_cast<float*>(base + l.scales_offset);
  cudaError_t err = quantize_fp8(xq, x_scales, x, m, k, /*x_stride=*/k, /*scale_stride_t=*/1,
                                 /*scale_stride_g=*/l.scale_stride, DType::kBFloat16, stream);
  if (err != cudaSuccess) return err;
  if (fp8::tokens_gemv_fits(m, n))
    return fp8::gemv_tokens(out, xq, x_scales, l.scale_stride, w, weight_scale_inv, m, n, k,
                            stream);
  return fp8::gemm(out, xq, x_scales, l.scale_stride, w, weight_scale_inv, m, n, k,
                   base + l.gemm_offset, workspace_bytes - l.gemm_offset, stream);
}

}  // namespace qwen3_kernels
