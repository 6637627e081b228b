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
// one SM moves. Launch variants of that regime (QWEN3_NORM_VARIANT = a name below or its index,
// read once; benchmarks flip it with qwen3_norm_set_variant, see qwen3_kernels/elementwise_tuning.py);
// at T >= kSmallT every variant runs the legacy launch (measured 1.07x / 1.24x torch.compile):
//   auto       1 vector per thread (512 threads for H = 4096): a quarter of the serial work of legacy
//   legacy     4 vectors per thread (128 threads for H = 4096), weight loaded with the row
//   vec2       2 vectors per thread (Inductor's shape for H = 4096: 8 warps x 16 elements)
//   cluster2/4/8  (sm_90) one row split over a cluster of 2/4/8 CTAs on as many SMs, the partial
//              sums exchanged through distributed shared memory: each SM moves 1/C of the row
//   auto       (the default) also launched with programmatic dependent launch on sm_90: the CTAs
//              are scheduled while the previous kernel drains (H200, 2026-11-30: rms_norm T=64
//              1.95 us vs 2.67 without; fused_add_rms_norm T=64 1.99 vs 2.52)
//   auto_nopdl auto without programmatic dependent launch
#include <algorithm>
#include <type_traits>

#include "qwen3_kernels/common.cuh"
#include "qwen3_kernels/tuning.cuh"

namespace qwen3_kernels {
namespace {

constexpr int kMaxVecs = 4;  // 16-byte vectors held per thread: 4 x 8 = 32 elements
constexpr int64_t kSmallT = 1024;  // rows below which the kernel is latency bound
constexpr int kMaxCluster = 8;     // portable cluster size limit

enum Variant { kAuto, kLegacy, kVec2, kCluster2, kCluster4, kCluster8, kAutoNoPdl, kNumVariants };
constexpr const char* kVariantNames[kNumVariants] = {"auto",     "legacy",   "vec2",    "cluster2",
                                                     "cluster4", "cluster8", "auto_nopdl"};

VariantKnob<kNumVariants>& knob() {
  static VariantKnob<kNumVariants> k("QWEN3_NORM_VARIANT", kVariantNames);
  return k;
}

// kAdd: fused_add_rms_norm (residual += x, x = norm(residual)); else out = norm(x).
// kEarlyWeight: load the weight with the row (small T: saves a dependent memory round trip after
// the block sum); off for large T, where the weight sits in L1/L2 and the registers are better
// spent on occupancy (measured: 4.09 -> 3.85 TB/s for fused_add_rms_norm at T=16384 with it on).
// kVecs: 16-byte vectors per thread (the launch gives each row >= nvec / kVecs threads).
// kPdl: launched with programmatic dependent launch; waits for the previous kernel first.
template <typename T, bool kAdd, bool kEarlyWeight, int kVecs = kMaxVecs, bool kPdl = false>
__global__ void rms_norm_vec_kernel(T* __restrict__ out,             // [T, H], row stride out_stride
                                    T* __restrict__ residual,        // [T, H] (kAdd only)
                                    const T* __restrict__ x,         // [T, H], row stride x_stride
                                    const T* __restrict__ weight,    // [H]
                                    int64_t hidden, int64_t out_stride, int64_t residual_stride,
                                    int64_t x_stride, float eps) {
  const int64_t row = blockIdx.x;
  const int nvec = static_cast<int>(hidden / 8);
  const T* xr = x + row * x_stride;
  T* rr = kAdd ? residual + row * residual_stride : nullptr;
  if constexpr (kPdl) {
    pdl_wait();  // x / residual may be the previous kernel's output
    pdl_launch_dependents();
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
  T* outr = out + row * out_stride;
#pragma unroll
  for (int j = 0; j < kVecs; ++j) {
    const int idx = threadIdx.x + j * blockDim.x;
    if (idx < nvec) {
      if constexpr (!kEarlyWeight) w[j] = load_vec8(weight + idx * 8);
      Vec8<T> o;
#pragma unroll
      for (int i = 0; i < 8; ++i)
        o.v[i] = from_float<T>(to_float(v[j].v[i]) * inv_rms * to_float(w[j].v[i]));
      store_vec8(outr + idx * 8, o);
    }
  }
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

// ---- cluster split (sm_90): one row over the C CTAs of a cluster --------------------------------

#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
__device__ __forceinline__ unsigned cluster_rank() {
  unsigned r;
  asm volatile("mov.u32 %0, %%cluster_ctarank;\n" : "=r"(r));
  return r;
}
__device__ __forceinline__ unsigned cluster_size() {
  unsigned n;
  asm volatile("mov.u32 %0, %%cluster_nctarank;\n" : "=r"(n));
  return n;
}
__device__ __forceinline__ void cluster_arrive_relaxed() {
  asm volatile("barrier.cluster.arrive.relaxed.aligned;\n" ::: "memory");
}
__device__ __forceinline__ void cluster_arrive_release() {
  asm volatile("barrier.cluster.arrive.release.aligned;\n" ::: "memory");
}
__device__ __forceinline__ void cluster_wait_acquire() {
  asm volatile("barrier.cluster.wait.acquire.aligned;\n" ::: "memory");
}
// Stores v into the same shared-memory word as `local` in CTA `rank` of this cluster.
__device__ __forceinline__ void store_to_peer(float* local, unsigned rank, float v) {
  const uint32_t a = static_cast<uint32_t>(__cvta_generic_to_shared(local));
  uint32_t remote;
  asm volatile("mapa.shared::cluster.u32 %0, %1, %2;\n" : "=r"(remote) : "r"(a), "r"(rank));
  asm volatile("st.shared::cluster.f32 [%0], %1;\n" ::"r"(remote), "f"(v) : "memory");
}
#endif

// grid (T * C), clusters of C CTAs along x: cluster t normalises row t, CTA rank c holding vectors
// [c * slice, (c + 1) * slice) of it, one per thread. Each CTA sends its partial sum of squares to
// every CTA of the cluster (st.shared::cluster), one cluster barrier makes them visible, and every
// CTA adds the C partials in the same order, so all slices of a row use the same inv_rms.
template <typename T, bool kAdd>
__global__ void rms_norm_cluster_kernel(T* __restrict__ out,           // [T, H], row stride out_stride
                                        T* __restrict__ residual,      // [T, H] (kAdd only)
                                        const T* __restrict__ x,       // [T, H], row stride x_stride
                                        const T* __restrict__ weight,  // [H]
                                        int64_t hidden, int64_t out_stride,
                                        int64_t residual_stride, int64_t x_stride, float eps,
                                        int slice) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  __shared__ float peer_sums[kMaxCluster];
  const unsigned rank = cluster_rank(), csize = cluster_size();
  // A CTA's shared memory may be written by its peers only once it runs: arrive now, wait just
  // before the first remote store, by when every CTA of the cluster has long started.
  cluster_arrive_relaxed();
  const int64_t row = blockIdx.x / csize;
  const int nvec = static_cast<int>(hidden / 8);
  const int idx = static_cast<int>(rank) * slice + static_cast<int>(threadIdx.x);
  const bool live = static_cast<int>(threadIdx.x) < slice && idx < nvec;
  T* rr = kAdd ? residual + row * residual_stride : nullptr;
  Vec8<T> v, w;
  float sumsq = 0.0f;
  if (live) {
    w = load_vec8(weight + idx * 8);
    v = load_vec8(x + row * x_stride + idx * 8);
    if constexpr (kAdd) {
      const Vec8<T> r = load_vec8(rr + idx * 8);
#pragma unroll
      for (int i = 0; i < 8; ++i) v.v[i] = from_float<T>(to_float(v.v[i]) + to_float(r.v[i]));
      store_vec8(rr + idx * 8, v);
    }
#pragma unroll
    for (int i = 0; i < 8; ++i) {
      const float f = to_float(v.v[i]);
      sumsq += f * f;
    }
  }
  const float part = block_sum(sumsq);
  asm volatile("barrier.cluster.wait.aligned;\n" ::: "memory");  // every peer has started
  if (threadIdx.x < csize) store_to_peer(&peer_sums[rank], threadIdx.x, part);
  cluster_arrive_release();  // our stores reach the peers before they pass their wait
  cluster_wait_acquire();
  float total = 0.0f;
  for (unsigned r = 0; r < csize; ++r) total += peer_sums[r];
  const float inv_rms = rsqrtf(total / static_cast<float>(hidden) + eps);
  if (live) {
    Vec8<T> o;
#pragma unroll
    for (int i = 0; i < 8; ++i) o.v[i] = from_float<T>(to_float(v.v[i]) * inv_rms * to_float(w.v[i]));
    store_vec8(out + row * out_stride + idx * 8, o);
  }
#endif
}

bool aligned16(const void* p) { return reinterpret_cast<uintptr_t>(p) % 16 == 0; }

template <bool kAdd>
cudaError_t launch(void* out, void* residual, const void* x, const void* weight,
                   int64_t num_tokens, int64_t hidden, int64_t out_stride, int64_t residual_stride,
                   int64_t x_stride, float eps, DType dtype, cudaStream_t stream) {
  if (num_tokens == 0 || hidden == 0) return cudaSuccess;
  const int64_t nvec = hidden / 8;
  bool vec = hidden % 8 == 0 && out_stride % 8 == 0 && x_stride % 8 == 0 && aligned16(out) &&
             aligned16(x) && aligned16(weight) && nvec <= kMaxVecs * 1024;
  if (kAdd) vec = vec && residual_stride % 8 == 0 && aligned16(residual);
  const dim3 grid(static_cast<unsigned>(num_tokens));
  int variant = num_tokens < kSmallT ? knob().get() : kLegacy;
  return QWEN3_DISPATCH_HALF(dtype, T, [&] {
    T* o = static_cast<T*>(out);
    T* res = static_cast<T*>(residual);
    const T* xi = static_cast<const T*>(x);
    const T* wi = static_cast<const T*>(weight);
    if (!vec) {
      rms_norm_scalar_kernel<T, kAdd><<<grid, 256, 0, stream>>>(o, res, xi, wi, hidden, out_stride,
                                                                 residual_stride, x_stride, eps);
      return cudaGetLastError();
    }
    if (variant == kLegacy) {
      // Fewest threads that hold the row in kMaxVecs vectors each, rounded to whole warps; at
      // least 64 threads so small rows still have a few warps of loads in flight.
      int threads = static_cast<int>((nvec + kMaxVecs - 1) / kMaxVecs);
      threads = std::max(64, std::min(1024, (threads + 31) / 32 * 32));
      if (num_tokens < kSmallT) {
        rms_norm_vec_kernel<T, kAdd, true><<<grid, threads, 0, stream>>>(
            o, res, xi, wi, hidden, out_stride, residual_stride, x_stride, eps);
      } else {
        rms_norm_vec_kernel<T, kAdd, false><<<grid, threads, 0, stream>>>(
            o, res, xi, wi, hidden, out_stride, residual_stride, x_stride, eps);
      }
      return cudaGetLastError();
    }
    bool pdl = false;
    if (variant == kAuto) {
      pdl = current_device_info().cc_major >= 9;
    } else if (variant == kAutoNoPdl) {
      variant = kAuto;
    }
    const int cluster = variant == kCluster2 ? 2 : variant == kCluster4 ? 4 : variant == kCluster8 ? 8 : 1;
    if (cluster > 1 && cluster <= kMaxCluster && current_device_info().cc_major >= 9) {
      const int slice = static_cast<int>((nvec + cluster - 1) / cluster);
      if (slice <= 1024) {
        return launch_ex(rms_norm_cluster_kernel<T, kAdd>,
                         dim3(static_cast<unsigned>(num_tokens * cluster)),
                         dim3((slice + 31) / 32 * 32), stream, false, cluster, o, res, xi, wi,
                         hidden, out_stride, residual_stride, x_stride, eps, slice);
      }
    }
    // One vector per thread (vec2: two); more only where the row needs over 1024 threads.
    int vecs = variant == kVec2 ? 2 : 1;
    while (nvec > int64_t{vecs} * 1024) vecs *= 2;
    const int threads = std::max<int>(64, static_cast<int>((nvec + vecs - 1) / vecs + 31) / 32 * 32);
    auto go = [&](auto kv) -> cudaError_t {
      constexpr int V = decltype(kv)::value;
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
                     int64_t hidden, int64_t out_stride, int64_t x_stride, float eps, DType dtype,
                     cudaStream_t stream) {
  return launch<false>(out, nullptr, x, weight, num_tokens, hidden, out_stride, 0, x_stride, eps,
                       dtype, stream);
}

cudaError_t fused_add_rms_norm(void* x, void* residual, const void* weight, int64_t num_tokens,
                               int64_t hidden, int64_t x_stride, int64_t residual_stride,
                               float eps, DType dtype, cudaStream_t stream) {
  // x is both the input and the output: each thread reads its vectors before it writes them.
  return launch<true>(x, residual, x, weight, num_tokens, hidden, x_stride, residual_stride,
                      x_stride, eps, dtype, stream);
}

}  // namespace qwen3_kernels

// ---- tuning hooks (C ABI, for qwen3_kernels/elementwise_tuning.py) --------------------------------

// The launch variant of the following rms_norm / fused_add_rms_norm calls at T < 1024.
QWEN3_TUNING_HOOKS(qwen3_norm, qwen3_kernels::knob())
