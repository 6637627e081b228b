// rms_norm and fused_add_rms_norm: out = x * rsqrt(mean(x^2) + eps) * weight, one row per block.
//
// Memory-bound. The fast path keeps the row in registers (up to kMaxVecs 16-byte vectors per
// thread) so each input is read from HBM exactly once: rms_norm moves read x + write out,
// fused_add_rms_norm read x, read residual, write residual, write x. The sum x + residual is rounded
// to the storage dtype before it is normalised, exactly as it is stored (the reference does the same).
// Rows that do not fit (hidden > 8 * kMaxVecs * 1024) or are not 16-byte aligned take the scalar
// path, which re-reads the row (from L1/L2) instead.
//
// Below kSmallT rows the kernel is latency bound (one CTA per row, few rows): what counts is how
// long one CTA takes, i.e. how many instructions each thread runs in sequence and how many bytes
// one SM moves. The launch is picked from the shape in launch() below: at T < kSmallT one 16-byte
// vector per thread (512 threads for H = 4096: a quarter of the serial work of 4 vectors), more
// only where the row needs over 1024 threads, launched with programmatic dependent launch on
// sm_90 so the CTAs are scheduled while the previous kernel drains (H200: rms_norm T=64 1.95 us
// vs 2.67 without; fused_add_rms_norm T=64 1.99 vs 2.52; python benchmarks/bench_elementwise.py).
// At T >= kSmallT the fewest threads that hold the row in kMaxVecs vectors each (measured 1.07x /
// 1.24x torch.compile). batch_invariant (the deterministic mode) takes the T < kSmallT launch at
// every T: the block's sum runs over the same threads in the same order whatever T is. Variants
// no shape picks (2 vectors per thread, Inductor's shape for H = 4096; one row split over a
// cluster of 2/4/8 CTAs on sm_90) are kept on branch experiment/kernel-launch-variants.
//
// rms_norm_fp8 / fused_add_rms_norm_fp8: the same kernels with the normalised row quantized for
// the FP8 projections instead of stored (per 128-wide group, gemm/quantize_fp8.cuh): a group is
// 16 consecutive vectors, which 16 consecutive threads hold (blockDim is whole warps), so half a
// warp reduces its amax with 4 shuffles, and the values are quantize_fp8(rms_norm(x)) bit for
// bit, in one launch and without the [T, H] round trip. Vector path only, H a multiple of 128.
#include <algorithm>
#include <type_traits>

#include "gemm/quantize_fp8.cuh"
#include "qwen3_kernels/common.cuh"
#include "qwen3_kernels/launch.cuh"

namespace qwen3_kernels {
namespace {

constexpr int kMaxVecs = 4;  // 16-byte vectors held per thread: 4 x 8 = 32 elements
constexpr int64_t kSmallT = 1024;  // rows below which the kernel is latency bound

// Where a kQuant kernel puts the normalised row: e4m3 values [T, H] (contiguous) and one fp32
// scale per 128-wide group at scales + t * scale_stride_t + g * scale_stride_g.
struct QuantOut {
  uint8_t* values;
  float* scales;
  int64_t scale_stride_t, scale_stride_g;
};

// kAdd: fused_add_rms_norm (residual += x, x = norm(residual)); else out = norm(x).
// kEarlyWeight: load the weight with the row (small T: saves a dependent memory round trip after
// the block sum); off for large T, where the weight sits in L1/L2 and the registers are better
// spent on occupancy (measured: 4.09 -> 3.85 TB/s for fused_add_rms_norm at T=16384 with it on).
// kVecs: 16-byte vectors per thread (the launch gives each row >= nvec / kVecs threads).
// kPdl: launched with programmatic dependent launch; waits for the previous kernel first.
// kQuant: the row goes to q (quantized per 128-group), not to out. The body of both kernels below
// (rms_norm_vec_kernel keeps the parameters it had before the fp8 one joined it).
template <typename T, bool kAdd, bool kEarlyWeight, int kVecs, bool kPdl, bool kQuant>
__device__ __forceinline__ void rms_norm_vec_row(T* __restrict__ out,         // [T, H]
                                                 T* __restrict__ residual,    // [T, H] (kAdd)
                                                 const T* __restrict__ x,     // [T, H]
                                                 const T* __restrict__ weight,  // [H]
                                                 int64_t hidden, int64_t out_stride,
                                                 int64_t residual_stride, int64_t x_stride,
                                                 float eps, const QuantOut& q) {
  const int64_t row = blockIdx.x;
  const int nvec = static_cast<int>(hidden / 8);
  const T* xr = x + row * x_stride;
  T* rr = kAdd ? residual + row * residual_stride : nullptr;
  if constexpr (kPdl) {
    // The next kernel may launch before this one's wait (its own wait still waits for this whole
    // grid): a GEMV after the norm then streams its weight while the GEMV before drains.
    pdl_launch_dependents();
    pdl_wait();  // x / residual may be the previous kernel's output
  }

  Vec8<T> v[kVecs], w[kVecs];
  float sumsq = 0.0f;
#pragma unroll
  for (int j = 0; j < kVecs; ++j) {  // issue every load first: bytes in flight hide latency
    const int idx = threadIdx.x + j * blockDim.x;
    if (idx < nvec) {
      // The weight is loaded here, not after the reduction: at small T the kernel is latency
      // bound and a dependent load after the block sum costs a whole memory round trip.
      if constexpr (kEarlyWeight) w[j] = load_vec8(weight + idx * 8);
      v[j] = load_vec8(xr + idx * 8);
      if constexpr (kAdd) {
        const Vec8<T> r = load_vec8(rr + idx * 8);
#pragma unroll
        for (int i = 0; i < 8; ++i) v[j].v[i] = from_float<T>(to_float(v[j].v[i]) + to_float(r.v[i]));
      }
    }
  }
#pragma unroll
  for (int j = 0; j < kVecs; ++j) {
    const int idx = threadIdx.x + j * blockDim.x;
    if (idx < nvec) {
      if constexpr (kAdd) store_vec8(rr + idx * 8, v[j]);
#pragma unroll
      for (int i = 0; i < 8; ++i) {
        const float f = to_float(v[j].v[i]);
        sumsq += f * f;
      }
    }
  }
  const float inv_rms = rsqrtf(block_sum(sumsq) / static_cast<float>(hidden) + eps);
  T* outr = kQuant ? nullptr : out + row * out_stride;
#pragma unroll
  for (int j = 0; j < kVecs; ++j) {
    const int idx = threadIdx.x + j * blockDim.x;
    uint4 ob = make_uint4(0, 0, 0, 0);  // past the row: zeros, outside every amax
    if (idx < nvec) {
      if constexpr (!kEarlyWeight) w[j] = load_vec8(weight + idx * 8);
      Vec8<T> o;
#pragma unroll
      for (int i = 0; i < 8; ++i)
        o.v[i] = from_float<T>(to_float(v[j].v[i]) * inv_rms * to_float(w[j].v[i]));
      if constexpr (kQuant) ob = *reinterpret_cast<const uint4*>(&o);
      else store_vec8(outr + idx * 8, o);
    }
    if constexpr (kQuant) {  // every lane: the group's amax is a half-warp shuffle
      const float scale = fp8::group_scale(
          fp8::bits_to_float<T>(fp8::group_max_bits(fp8::abs_max_bits8(ob))));
      if (idx < nvec) {
        *reinterpret_cast<uint2*>(q.values + row * hidden + idx * 8) = fp8::quantize8<T>(ob, scale);
        if (idx % fp8::kGroupLanes == 0)
          q.scales[row * q.scale_stride_t + idx / fp8::kGroupLanes * q.scale_stride_g] = scale;
      }
    }
  }
}

template <typename T, bool kAdd, bool kEarlyWeight, int kVecs = kMaxVecs, bool kPdl = false>
__global__ void rms_norm_vec_kernel(T* __restrict__ out,             // [T, H], row stride out_stride
                                    T* __restrict__ residual,        // [T, H] (kAdd only)
                                    const T* __restrict__ x,         // [T, H], row stride x_stride
                                    const T* __restrict__ weight,    // [H]
                                    int64_t hidden, int64_t out_stride, int64_t residual_stride,
                                    int64_t x_stride, float eps) {
  rms_norm_vec_row<T, kAdd, kEarlyWeight, kVecs, kPdl, false>(
      out, residual, x, weight, hidden, out_stride, residual_stride, x_stride, eps, QuantOut{});
}

template <typename T, bool kAdd, bool kEarlyWeight, int kVecs = kMaxVecs, bool kPdl = false>
__global__ void rms_norm_vec_fp8_kernel(T* __restrict__ residual,      // [T, H] (kAdd only)
                                        const T* __restrict__ x,       // [T, H], x_stride apart
                                        const T* __restrict__ weight,  // [H]
                                        int64_t hidden, int64_t residual_stride, int64_t x_stride,
                                        float eps, QuantOut q) {
  rms_norm_vec_row<T, kAdd, kEarlyWeight, kVecs, kPdl, true>(
      nullptr, residual, x, weight, hidden, hidden, residual_stride, x_stride, eps, q);
}

// Any hidden size and alignment: two passes over the row, the second from cache.
template <typename T, bool kAdd>
__global__ void rms_norm_scalar_kernel(T* __restrict__ out, T* __restrict__ residual,
                                       const T* __restrict__ x, const T* __restrict__ weight,
                                       int64_t hidden, int64_t out_stride,
                                       int64_t residual_stride, int64_t x_stride, float eps) {
  const int64_t row = blockIdx.x;
  const T* xr = x + row * x_stride;
  T* rr = kAdd ? residual + row * residual_stride : nullptr;
  float sumsq = 0.0f;
  for (int64_t i = threadIdx.x; i < hidden; i += blockDim.x) {
    float f = to_float(xr[i]);
    if constexpr (kAdd) {
      const T s = from_float<T>(f + to_float(rr[i]));
      rr[i] = s;
      f = to_float(s);
    }
    sumsq += f * f;
  }
  const float inv_rms = rsqrtf(block_sum(sumsq) / static_cast<float>(hidden) + eps);
  // Each thread re-reads only the elements it wrote itself, so no barrier is needed for kAdd.
  const T* src = kAdd ? rr : xr;
  for (int64_t i = threadIdx.x; i < hidden; i += blockDim.x)
    out[row * out_stride + i] = from_float<T>(to_float(src[i]) * inv_rms * to_float(weight[i]));
}

// kQuant: the rows go to q (out unused); the vector path only, H % 128 == 0.
template <bool kAdd, bool kQuant = false>
cudaError_t launch(void* out, void* residual, const void* x, const void* weight,
                   int64_t num_tokens, int64_t hidden, int64_t out_stride, int64_t residual_stride,
                   int64_t x_stride, float eps, bool batch_invariant, DType dtype,
                   cudaStream_t stream, QuantOut q = {}) {
  if (num_tokens == 0 || hidden == 0) return cudaSuccess;
  const int64_t nvec = hidden / 8;
  bool vec = hidden % 8 == 0 && out_stride % 8 == 0 && x_stride % 8 == 0 &&
             (kQuant || aligned16(out)) && aligned16(x) && aligned16(weight) &&
             nvec <= kMaxVecs * 1024;
  if (kAdd) vec = vec && residual_stride % 8 == 0 && aligned16(residual);
  if (kQuant && (!vec || hidden % fp8::kGroup != 0 || q.values == nullptr ||
                 !aligned16(q.values) || q.scales == nullptr))
    return cudaErrorInvalidValue;
  const dim3 grid(static_cast<unsigned>(num_tokens));
  return QWEN3_DISPATCH_HALF(dtype, T, [&] {
    T* o = static_cast<T*>(out);
    T* res = static_cast<T*>(residual);
    const T* xi = static_cast<const T*>(x);
    const T* wi = static_cast<const T*>(weight);
    if (!vec) {  // (never kQuant: refused above)
      rms_norm_scalar_kernel<T, kAdd><<<grid, 256, 0, stream>>>(o, res, xi, wi, hidden, out_stride,
                                                                 residual_stride, x_stride, eps);
      return cudaGetLastError();
    }
    if (num_tokens >= kSmallT && !batch_invariant) {
      // Fewest threads that hold the row in kMaxVecs vectors each, rounded to whole warps; at
      // least 64 threads so small rows still have a few warps of loads in flight.
      int threads = static_cast<int>((nvec + kMaxVecs - 1) / kMaxVecs);
      threads = std::max(64, std::min(1024, (threads + 31) / 32 * 32));
      if constexpr (kQuant)
        rms_norm_vec_fp8_kernel<T, kAdd, false><<<grid, threads, 0, stream>>>(
            res, xi, wi, hidden, residual_stride, x_stride, eps, q);
      else
        rms_norm_vec_kernel<T, kAdd, false><<<grid, threads, 0, stream>>>(
            o, res, xi, wi, hidden, out_stride, residual_stride, x_stride, eps);
      return cudaGetLastError();
    }
    const bool pdl = current_device_info().cc_major >= 9;
    // One vector per thread; more only where the row needs over 1024 threads.
    int vecs = 1;
    while (nvec > int64_t{vecs} * 1024) vecs *= 2;
    const int threads = std::max<int>(64, static_cast<int>((nvec + vecs - 1) / vecs + 31) / 32 * 32);
    auto go = [&](auto kv) -> cudaError_t {
      constexpr int V = decltype(kv)::value;
      if constexpr (kQuant) {
        if (pdl) {
          return launch_ex(rms_norm_vec_fp8_kernel<T, kAdd, true, V, true>, grid, dim3(threads),
                           stream, true, 1, res, xi, wi, hidden, residual_stride, x_stride, eps,
                           q);
        }
        rms_norm_vec_fp8_kernel<T, kAdd, true, V, false><<<grid, threads, 0, stream>>>(
            res, xi, wi, hidden, residual_stride, x_stride, eps, q);
        return cudaGetLastError();
      }
      if (pdl) {
        return launch_ex(rms_norm_vec_kernel<T, kAdd, true, V, true>, grid, dim3(threads), stream,
                         true, 1, o, res, xi, wi, hidden, out_stride, residual_stride, x_stride, eps);
      }
      rms_norm_vec_kernel<T, kAdd, true, V, false><<<grid, threads, 0, stream>>>(
          o, res, xi, wi, hidden, out_stride, residual_stride, x_stride, eps);
      return cudaGetLastError();
    };
    if (vecs == 1) return go(std::integral_constant<int, 1>{});
    if (vecs == 2) return go(std::integral_constant<int, 2>{});
    return go(std::integral_constant<int, 4>{});
  });
}

}  // namespace

cudaError_t rms_norm(void* out, const void* x, const void* weight, int64_t num_tokens,
                     int64_t hidden, int64_t out_stride, int64_t x_stride, float eps,
                     bool batch_invariant, DType dtype, cudaStream_t stream) {
  return launch<false>(out, nullptr, x, weight, num_tokens, hidden, out_stride, 0, x_stride, eps,
                       batch_invariant, dtype, stream);
}

cudaError_t fused_add_rms_norm(void* x, void* residual, const void* weight, int64_t num_tokens,
                               int64_t hidden, int64_t x_stride, int64_t residual_stride,
                               float eps, bool batch_invariant, DType dtype, cudaStream_t stream) {
  // x is both the input and the output: each thread reads its vectors before it writes them.
  return launch<true>(x, residual, x, weight, num_tokens, hidden, x_stride, residual_stride,
                      x_stride, eps, batch_invariant, dtype, stream);
}

cudaError_t rms_norm_fp8(void* out, float* x_scales, const void* x, const void* weight,
                         int64_t num_tokens, int64_t hidden, int64_t x_stride,
                         int64_t scale_stride_t, int64_t scale_stride_g, float eps, DType dtype,
                         cudaStream_t stream) {
  const QuantOut q{static_cast<uint8_t*>(out), x_scales, scale_stride_t, scale_stride_g};
  return launch<false, true>(nullptr, nullptr, x, weight, num_tokens, hidden, hidden, 0, x_stride,
                             eps, false, dtype, stream, q);
}

cudaError_t fused_add_rms_norm_fp8(void* out, float* x_scales, const void* x, void* residual,
                                   const void* weight, int64_t num_tokens, int64_t hidden,
                                   int64_t x_stride, int64_t residual_stride,
                                   int64_t scale_stride_t, int64_t scale_stride_g, float eps,
                                   DType dtype, cudaStream_t stream) {
  const QuantOut q{static_cast<uint8_t*>(out), x_scales, scale_stride_t, scale_stride_g};
  return launch<true, true>(nullptr, residual, x, weight, num_tokens, hidden, hidden,
                            residual_stride, x_stride, eps, false, dtype, stream, q);
}

}  // namespace qwen3_kernels
