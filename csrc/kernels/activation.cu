// silu_and_mul: out[t, i] = silu(x[t, i]) * x[t, I + i] — the SwiGLU gate of Qwen3's MLP.
//
// Memory-bound: each element of x is read once and each output written once. The fast path moves
// 16 bytes per access (8 halves); rows may be strided (e.g. a view into a wider buffer) as long as
// every row start is 16-byte aligned. Anything else (I % 8 != 0, odd strides) takes the scalar path,
// which is slower but never wrong.
#include <algorithm>

#include "qwen3_kernels/common.cuh"

namespace qwen3_kernels {
namespace {

__device__ __forceinline__ float silu(float v) { return v / (1.0f + __expf(-v)); }

constexpr int kThreads = 256;  // scalar path
constexpr int kVecs = 4;        // 16-byte vectors per thread on the vector path (large T)
constexpr int kSmallT = 1024;   // below this many tokens: 1 vector per thread, more blocks

// grid (T, chunks): each thread owns up to kVecs vectors of one row, strided by blockDim so a warp's
// accesses stay coalesced. All loads are issued before any math: 2 x 64 bytes in flight per thread
// is what keeps HBM busy; one vector per thread left the kernel at ~0.96x Inductor.
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

bool aligned16(const void* p) { return reinterpret_cast<uintptr_t>(p) % 16 == 0; }

}  // namespace

cudaError_t silu_and_mul(void* out, const void* x, int64_t num_tokens, int64_t intermediate,
                         int64_t out_stride, int64_t x_stride, DType dtype, cudaStream_t stream) {
  if (num_tokens == 0 || intermediate == 0) return cudaSuccess;
  const bool vec = intermediate % 8 == 0 && out_stride % 8 == 0 && x_stride % 8 == 0 &&
                   aligned16(out) && aligned16(x);
  // Vector path: the fewest threads (whole warps, <= 1024) that cover the row at kVecs vectors
  // each; very wide rows get more blocks along y.
  const int64_t nvec = intermediate / 8;
  int threads = kThreads;
  unsigned chunks = static_cast<unsigned>(std::min<int64_t>((intermediate + kThreads - 1) / kThreads, 65535));
  if (vec) {
    // Few tokens: latency bound, so spread each row over many small blocks (1 vector per thread)
    // instead of a few deep ones; many tokens: deep threads keep more bytes in flight.
    const int vecs = num_tokens >= kSmallT ? kVecs : 1;
    threads = num_tokens >= kSmallT
                  ? static_cast<int>(std::min<int64_t>(1024, ((nvec + vecs - 1) / vecs + 31) / 32 * 32))
                  : 128;
    chunks = static_cast<unsigned>((nvec + threads * vecs - 1) / (threads * vecs));
  }
  const dim3 grid(static_cast<unsigned>(num_tokens), chunks);
  return QWEN3_DISPATCH_HALF(dtype, T, [&] {
    if (vec) {
      if (num_tokens >= kSmallT) {
        silu_and_mul_vec_kernel<T, kVecs><<<grid, threads, 0, stream>>>(
            static_cast<T*>(out), static_cast<const T*>(x), intermediate, out_stride, x_stride);
      } else {
        silu_and_mul_vec_kernel<T, 1><<<grid, threads, 0, stream>>>(
            static_cast<T*>(out), static_cast<const T*>(x), intermediate, out_stride, x_stride);
      }
    } else {
      silu_and_mul_scalar_kernel<T><<<grid, kThreads, 0, stream>>>(
          static_cast<T*>(out), static_cast<const T*>(x), intermediate, out_stride, x_stride);
    }
    return cudaGetLastError();
  });
}

}  // namespace qwen3_kernels
