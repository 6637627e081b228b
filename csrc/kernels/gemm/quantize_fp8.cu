// quantize_fp8: x [T, K] (bf16 / fp16) -> e4m3 [T, K] and one fp32 scale per token per 128-wide
// group of K (reference.quantize_fp8; the math is in quantize_fp8.cuh). The activation side of
// the FP8 GEMM at M > 1 (linear_fp8.cu), and an op of its own.
//
// Memory bound (2 bytes read, 1 written per element), so the layout only has to keep enough
// 16-byte loads in flight: a warp owns 1024 columns of one token (8 groups) and issues its four
// loads (two groups, 512 contiguous bytes, each) before any arithmetic; half a warp quantizes one
// group. Tokens x 1024-column chunks spread over many small CTAs, so T = 1 is one CTA and T =
// 16384 (K 4096) is 8192 of them. The division per element is a correctly rounded one (the
// scales and values must be the reference's); about a dozen instructions an element, under the
// memory time at these sizes.
//
// silu_and_mul_fp8 is the same pass over silu_and_mul(x) (x [T, 2I] = gate | up): each lane loads
// the gate and up vectors of its 8 columns and quantizes silu_mul8 of them (qwen3_kernels/silu.cuh,
// silu_and_mul's own math), so the FP8 down projection's input needs no [T, I] round trip and one
// launch fewer; its values are quantize_fp8(silu_and_mul(x)) bit for bit.
//
// Runs on every architecture: cuda_fp8.h rounds in software before sm_89. On sm_90 a PDL launch
// (x is read only after griddepcontrol.wait; the trigger follows the stores).
#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include "qwen3_kernels/common.cuh"
#include "qwen3_kernels/launch.cuh"
#include "qwen3_kernels/launchers.h"
#include "qwen3_kernels/silu.cuh"
#include "quantize_fp8.cuh"

namespace qwen3_kernels {
namespace {

constexpr int kWarps = 8;  // per CTA
constexpr int kThreads = 32 * kWarps;
constexpr int kGroupsPerWarp = 8;                       // a warp's columns: 8 groups of 128
constexpr int kLoads = kGroupsPerWarp * fp8::kGroupLanes / 32;  // 16-byte loads a lane: 4

// Warp w of CTA b owns chunk c = (b * kWarps + w) % chunks of token (b * kWarps + w) / chunks:
// groups 8 c .. 8 c + 7, of which half h of the warp quantizes 8 c + 2 u + h (u = 0..3), so one
// load instruction of the warp reads two adjacent groups. kSiluMul: x's row is gate | up (2 k
// columns) and the values quantized are silu_mul8(gate, up).
template <typename T, bool kPdl, bool kSiluMul>
__global__ void __launch_bounds__(kThreads)
    quantize_fp8_kernel(uint8_t* __restrict__ out,     // [t, k] e4m3
                        float* __restrict__ x_scales,  // [t, ceil(k / 128)], strides st, sg
                        const T* __restrict__ x,       // [t, k] ([t, 2 k]), row stride x_stride
                        int64_t t, int k, int64_t x_stride, int64_t st, int64_t sg, int chunks) {
  const int lane = threadIdx.x % 32;
  const int64_t task = static_cast<int64_t>(blockIdx.x) * kWarps + threadIdx.x / 32;
  if (task >= t * chunks) return;  // whole warps; no barrier follows
  const int64_t token = task / chunks;
  const int chunk = static_cast<int>(task % chunks);
  const int half = lane / fp8::kGroupLanes;
  const int lane_col = 8 * (lane % fp8::kGroupLanes);
  const T* xr = x + token * x_stride;
  uint8_t* outr = out + token * k;

  if constexpr (kPdl) pdl_wait();  // x is the previous kernel's output
  uint4 v[kLoads], up[kSiluMul ? kLoads : 1];
#pragma unroll
  for (int u = 0; u < kLoads; ++u) {
    const int col = (chunk * kGroupsPerWarp + 2 * u + half) * fp8::kGroup + lane_col;
    // k % 8 == 0: a lane's 8 columns are all in or all out; out ones count as 0 in the amax
    v[u] = col < k ? load_stream<false>(xr + col) : make_uint4(0, 0, 0, 0);
    if constexpr (kSiluMul)
      up[u] = col < k ? load_stream<false>(xr + k + col) : make_uint4(0, 0, 0, 0);
  }
  if constexpr (kSiluMul) {
#pragma unroll
    for (int u = 0; u < kLoads; ++u) {  // silu(0) * 0 = 0: columns past k stay out of the amax
      const Vec8<T> r = silu_mul8(*reinterpret_cast<const Vec8<T>*>(&v[u]),
                                  *reinterpret_cast<const Vec8<T>*>(&up[u]));
      v[u] = *reinterpret_cast<const uint4*>(&r);
    }
  }
#pragma unroll
  for (int u = 0; u < kLoads; ++u) {
    const int group = chunk * kGroupsPerWarp + 2 * u + half;
    const int col = group * fp8::kGroup + lane_col;
    const float scale =
        fp8::group_scale(fp8::bits_to_float<T>(fp8::group_max_bits(fp8::abs_max_bits8(v[u]))));
    if (col < k) *reinterpret_cast<uint2*>(outr + col) = fp8::quantize8<T>(v[u], scale);
    if (lane_col == 0 && col < k) x_scales[token * st + group * sg] = scale;
  }
  if constexpr (kPdl) pdl_launch_dependents();
}

template <typename T, bool kSiluMul>
cudaError_t launch(uint8_t* out, float* x_scales, const T* x, int64_t t, int k, int64_t x_stride,
                   int64_t st, int64_t sg, cudaStream_t stream) {
  const int groups = (k + fp8::kGroup - 1) / fp8::kGroup;
  const int chunks = (groups + kGroupsPerWarp - 1) / kGroupsPerWarp;
  const int64_t ctas = (t * chunks + kWarps - 1) / kWarps;
  if (ctas > 0x7fffffff) return cudaErrorInvalidValue;
  const dim3 grid(static_cast<unsigned>(ctas));
  if (current_device_info().cc_major >= 9)
    return launch_ex(quantize_fp8_kernel<T, true, kSiluMul>, grid, dim3(kThreads), stream, true,
                     1, out, x_scales, x, t, k, x_stride, st, sg, chunks);
  return launch_ex(quantize_fp8_kernel<T, false, kSiluMul>, grid, dim3(kThreads), stream, false,
                   1, out, x_scales, x, t, k, x_stride, st, sg, chunks);
}

// x_cols: the columns x's rows hold (k, or 2 k for silu_and_mul_fp8).
template <bool kSiluMul>
cudaError_t run(void* out, float* x_scales, const void* x, int64_t t, int64_t k, int64_t x_stride,
                int64_t st, int64_t sg, DType dtype, cudaStream_t stream) {
  if (dtype != DType::kBFloat16 && dtype != DType::kFloat16) return cudaErrorNotSupported;
  if (t == 0 || k == 0) return cudaSuccess;
  // 16-byte loads of x and 8-byte stores of out: K % 16 == 0, x rows 16-byte aligned.
  const int64_t x_cols = kSiluMul ? 2 * k : k;
  if (t < 0 || k < 0 || k % 16 || x_cols > (int64_t{1} << 30) || x_stride < x_cols ||
      x_stride % 8 || !aligned16(x) || !aligned16(out) || x_scales == nullptr)
    return cudaErrorInvalidValue;
  auto* q = static_cast<uint8_t*>(out);
  const int ki = static_cast<int>(k);
  if (dtype == DType::kBFloat16)
    return launch<__nv_bfloat16, kSiluMul>(q, x_scales, static_cast<const __nv_bfloat16*>(x), t,
                                           ki, x_stride, st, sg, stream);
  return launch<__half, kSiluMul>(q, x_scales, static_cast<const __half*>(x), t, ki, x_stride, st,
                                  sg, stream);
}

}  // namespace

cudaError_t quantize_fp8(void* out, float* x_scales, const void* x, int64_t t, int64_t k,
                         int64_t x_stride, int64_t scale_stride_t, int64_t scale_stride_g,
                         DType dtype, cudaStream_t stream) {
  return run<false>(out, x_scales, x, t, k, x_stride, scale_stride_t, scale_stride_g, dtype,
                    stream);
}

cudaError_t silu_and_mul_fp8(void* out, float* x_scales, const void* x, int64_t t,
                             int64_t intermediate, int64_t x_stride, int64_t scale_stride_t,
                             int64_t scale_stride_g, DType dtype, cudaStream_t stream) {
  return run<true>(out, x_scales, x, t, intermediate, x_stride, scale_stride_t, scale_stride_g,
                   dtype, stream);
}

}  // namespace qwen3_kernels
