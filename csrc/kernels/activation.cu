// silu_and_mul: out[t, i] = silu(x[t, i]) * x[t, I + i] — the SwiGLU gate of Qwen3's MLP.
//
// Memory-bound: each element of x is read once and each output written once. The fast path moves
// 16 bytes per access (8 halves); rows may be strided (e.g. a view into a wider buffer) as long as
// every row start is 16-byte aligned. Anything else (I % 8 != 0, odd strides) takes the scalar path,
// which is slower but never wrong.
//
// The vector path's launch is picked from the shape in silu_and_mul below: a flat grid over the
// [T, I/8] vectors in memory order, at T >= 1024 128 threads x 2 vectors, at T < 1024 one vector
// per thread in CTAs sized so the launch covers many SMs (32-128 threads); on sm_90 with
// programmatic dependent launch, so the CTAs are scheduled while the previous kernel drains (H200:
// T=1 1.30 us vs 1.77 without, T=256 6.32 vs 7.03, T=16384 equal;
// python benchmarks/bench_elementwise.py). Past 2^30 vectors (the flat index is 32-bit) the
// row-tiled grid runs (as the default it measured 0.99x torch.compile at T=16384). Variants no
// shape picks (flat 128x1 / 256x2 / 128x4 / 64x1 / 32x1, a persistent 256x2 grid) are kept on
// branch experiment/kernel-launch-variants.
#include <algorithm>
#include <type_traits>

#include "qwen3_kernels/common.cuh"
#include "qwen3_kernels/launch.cuh"
#include "qwen3_kernels/silu.cuh"  // silu_mul8

namespace qwen3_kernels {
namespace {

__device__ __forceinline__ float silu(float v) { return v / (1.0f + __expf(-v)); }

constexpr int kThreads = 256;  // scalar path
constexpr int kVecs = 4;        // row-tiled: 16-byte vectors per thread (large T)
constexpr int kSmallT = 1024;   // below this many tokens: latency bound

// ---- row-tiled: grid (T, chunks), for more than 2^30 vectors ---------------------------------------------------------------------

// grid (T, chunks): each thread owns up to kVecs vectors of one row, strided by blockDim so a warp's
// accesses stay coalesced. All loads are issued before any math: 2 x 64 bytes in flight per thread
// is what keeps HBM busy; one vector per thread left the kernel at ~0.96x Inductor (with this
// token-major grid, where CTAs running together touch the same chunk of many rows).
template <typename T, int kVecs>
__global__ void silu_and_mul_vec_kernel(T* __restrict__ out,        // [T, I], row stride out_stride
                                        const T* __restrict__ x,    // [T, 2I], row stride x_stride
                                        int64_t intermediate, int64_t out_stride,
                                        int64_t x_stride) {
  const int64_t token = blockIdx.x;
  const int nvec = static_cast<int>(intermediate / 8);
  const T* row = x + token * x_stride;
  const int base = blockIdx.y * blockDim.x * kVecs + threadIdx.x;
  Vec8<T> gate[kVecs], up[kVecs];
#pragma unroll
  for (int j = 0; j < kVecs; ++j) {
    const int v = base + j * blockDim.x;
    if (v < nvec) {
      gate[j] = load_vec8(row + v * 8);
      up[j] = load_vec8(row + intermediate + v * 8);
    }
  }
#pragma unroll
  for (int j = 0; j < kVecs; ++j) {
    const int v = base + j * blockDim.x;
    if (v < nvec) {
      Vec8<T> r;
#pragma unroll
      for (int i = 0; i < 8; ++i)
        r.v[i] = from_float<T>(silu(to_float(gate[j].v[i])) * to_float(up[j].v[i]));
      store_vec8(out + token * out_stride + v * 8, r);
    }
  }
}

// ---- flat: the [T, I/8] vectors in memory order ---------------------------------------------------

// n / d for n < 2^31 with a multiply and a shift (Granlund-Montgomery); the host computes m and s.
struct FastDiv {
  uint32_t d, m, s;
  static FastDiv make(uint32_t d) {
    uint32_t s = 0;
    while ((uint64_t{1} << s) < d) ++s;
    const uint64_t m = ((uint64_t{1} << 32) * ((uint64_t{1} << s) - d)) / d + 1;
    return {d, static_cast<uint32_t>(m), s};
  }
  __device__ __forceinline__ uint32_t div(uint32_t n) const { return (__umulhi(n, m) + n) >> s; }
};

// Vector v of the flat index space [0, T * I/8) is row v / (I/8), column vector v % (I/8). A CTA
// owns blockDim.x * kVecs consecutive vectors (thread t: t, t + blockDim.x, ...), so CTAs that run
// together stream one contiguous stretch of memory, whatever I is (no half-empty CTA at a row
// end). The loop strides by the grid.
template <typename T, int kVecs, bool kPdl>
__global__ void silu_and_mul_flat_kernel(T* __restrict__ out,      // [T, I], row stride out_stride
                                         const T* __restrict__ x,  // [T, 2I], row stride x_stride
                                         int64_t intermediate, int64_t out_stride,
                                         int64_t x_stride, uint32_t total_vecs,
                                         FastDiv vecs_per_row) {
  if constexpr (kPdl) {
    pdl_launch_dependents();  // the next kernel's own wait waits for this grid
    pdl_wait();  // x may be the previous kernel's output
  }
  const uint32_t step = gridDim.x * blockDim.x * kVecs;
  for (uint32_t base = blockIdx.x * blockDim.x * kVecs + threadIdx.x; base < total_vecs;
       base += step) {
    Vec8<T> gate[kVecs], up[kVecs];
#pragma unroll
    for (int j = 0; j < kVecs; ++j) {  // every load first: bytes in flight hide the latency
      const uint32_t v = base + j * blockDim.x;
      if (v < total_vecs) {
        const uint32_t t = vecs_per_row.div(v);
        const T* src = x + t * x_stride + static_cast<int64_t>(v - t * vecs_per_row.d) * 8;
        gate[j] = load_vec8(src);
        up[j] = load_vec8(src + intermediate);
      }
    }
#pragma unroll
    for (int j = 0; j < kVecs; ++j) {
      const uint32_t v = base + j * blockDim.x;
      if (v < total_vecs) {  // the row again (3 instructions) rather than 2 registers per vector
        const uint32_t t = vecs_per_row.div(v);
        store_vec8(out + t * out_stride + static_cast<int64_t>(v - t * vecs_per_row.d) * 8,
                   silu_mul8(gate[j], up[j]));
      }
    }
  }
}

// ---- scalar ----------------------------------------------------------------------------------------

template <typename T>
__global__ void silu_and_mul_scalar_kernel(T* __restrict__ out, const T* __restrict__ x,
                                           int64_t intermediate, int64_t out_stride,
                                           int64_t x_stride) {
  const int64_t token = blockIdx.x;
  const T* row = x + token * x_stride;
  for (int64_t i = static_cast<int64_t>(blockIdx.y) * kThreads + threadIdx.x; i < intermediate;
       i += static_cast<int64_t>(gridDim.y) * kThreads) {
    out[token * out_stride + i] = from_float<T>(silu(to_float(row[i])) * to_float(row[intermediate + i]));
  }
}

template <typename T>
cudaError_t launch_row_tiled(T* out, const T* x, int64_t num_tokens, int64_t intermediate,
                          int64_t out_stride, int64_t x_stride, cudaStream_t stream) {
  // The fewest threads (whole warps, <= 1024) that cover the row at kVecs vectors each; very wide
  // rows get more blocks along y. Few tokens: 1 vector per thread, 128-thread blocks.
  const int64_t nvec = intermediate / 8;
  const bool large = num_tokens >= kSmallT;
  const int vecs = large ? kVecs : 1;
  const int threads =
      large ? static_cast<int>(std::min<int64_t>(1024, ((nvec + vecs - 1) / vecs + 31) / 32 * 32)) : 128;
  const unsigned chunks = static_cast<unsigned>((nvec + threads * vecs - 1) / (threads * vecs));
  const dim3 grid(static_cast<unsigned>(num_tokens), chunks);
  if (large) {
    silu_and_mul_vec_kernel<T, kVecs><<<grid, threads, 0, stream>>>(out, x, intermediate,
                                                                    out_stride, x_stride);
  } else {
    silu_and_mul_vec_kernel<T, 1><<<grid, threads, 0, stream>>>(out, x, intermediate, out_stride,
                                                                x_stride);
  }
  return cudaGetLastError();
}

template <typename T, int kVecs, bool kPdl>
cudaError_t launch_flat(T* out, const T* x, int64_t num_tokens, int64_t intermediate,
                        int64_t out_stride, int64_t x_stride, int threads, cudaStream_t stream) {
  const int64_t nvec = intermediate / 8;
  const uint32_t total = static_cast<uint32_t>(num_tokens * nvec);  // < 2^30, checked by the caller
  const int64_t per_cta = static_cast<int64_t>(threads) * kVecs;
  const int64_t blocks = (total + per_cta - 1) / per_cta;
  auto kernel = silu_and_mul_flat_kernel<T, kVecs, kPdl>;
  const FastDiv div = FastDiv::make(static_cast<uint32_t>(nvec));
  if (kPdl) {
    return launch_ex(kernel, dim3(static_cast<unsigned>(blocks)), dim3(threads), stream, true, 1,
                     out, x, intermediate, out_stride, x_stride, total, div);
  }
  kernel<<<static_cast<unsigned>(blocks), threads, 0, stream>>>(out, x, intermediate, out_stride,
                                                                 x_stride, total, div);
  return cudaGetLastError();
}

// At few tokens: one vector per thread, and CTAs small enough that the launch spreads over
// about two CTAs per SM (a lone row of I = 12288 is 1536 vectors: 48 CTAs of 32 threads rather
// than 12 of 128, so no single SM streams a large share of it).
int small_t_threads(int64_t total_vecs) {
  if (total_vecs >= int64_t{128} * 264) return 128;
  if (total_vecs >= int64_t{64} * 132) return 64;
  return 32;
}

}  // namespace

cudaError_t silu_and_mul(void* out, const void* x, int64_t num_tokens, int64_t intermediate,
                         int64_t out_stride, int64_t x_stride, DType dtype, cudaStream_t stream) {
  if (num_tokens == 0 || intermediate == 0) return cudaSuccess;
  const bool vec = intermediate % 8 == 0 && out_stride % 8 == 0 && x_stride % 8 == 0 &&
                   aligned16(out) && aligned16(x);
  if (!vec) {
    const unsigned chunks =
        static_cast<unsigned>(std::min<int64_t>((intermediate + kThreads - 1) / kThreads, 65535));
    const dim3 grid(static_cast<unsigned>(num_tokens), chunks);
    return QWEN3_DISPATCH_HALF(dtype, T, [&] {
      silu_and_mul_scalar_kernel<T><<<grid, kThreads, 0, stream>>>(
          static_cast<T*>(out), static_cast<const T*>(x), intermediate, out_stride, x_stride);
      return cudaGetLastError();
    });
  }
  const int64_t total_vecs = num_tokens * (intermediate / 8);
  const bool pdl = current_device_info().cc_major >= 9;
  const bool large = num_tokens >= kSmallT;
  return QWEN3_DISPATCH_HALF(dtype, T, [&] {
    T* o = static_cast<T*>(out);
    const T* xi = static_cast<const T*>(x);
    if (total_vecs >= (int64_t{1} << 30))  // the flat index is 32-bit
      return launch_row_tiled(o, xi, num_tokens, intermediate, out_stride, x_stride, stream);
    auto flat = [&](auto vecs, int threads) {
      constexpr int V = decltype(vecs)::value;
      return pdl ? launch_flat<T, V, true>(o, xi, num_tokens, intermediate, out_stride, x_stride,
                                           threads, stream)
                 : launch_flat<T, V, false>(o, xi, num_tokens, intermediate, out_stride, x_stride,
                                            threads, stream);
    };
    return large ? flat(std::integral_constant<int, 2>{}, 128)
                 : flat(std::integral_constant<int, 1>{}, small_t_threads(total_vecs));
  });
}

}  // namespace qwen3_kernels
