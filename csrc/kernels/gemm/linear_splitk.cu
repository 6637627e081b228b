// linear for a few tokens (M <= 8), hand-written: a weight-streaming split-K kernel.
//
// At decode sizes out[M, N] = x[M, K] @ w[N, K]^T moves the N*K weight and almost nothing else,
// so the kernel is built around reading w once at the full HBM rate:
//   - Each warp owns 16 weight rows and streams them with 16-byte loads straight into the
//     registers of mma.sync.m16n8k16 A fragments (no shared memory, no TMA: nothing between HBM and
//     the tensor core but the load). The loads bypass L1 (ld.global.nc.L1::no_allocate) and ask L2
//     for 256-byte lines, and the next 128 columns are in flight while the current ones multiply.
//   - x (at most 8 x K, L2-resident) is the B operand, read through L1 where the CTA's four
//     warps, working on the same K range, share it.
//   - The fragment layout is matched to the loads by permuting K: thread (g, t) of a warp loads
//     8 consecutive columns k0 + 8t .. k0 + 8t + 7 of a row and feeds them to two mma k-steps as
//     the slots {2t, 2t+1, 2t+8, 2t+9} of each. A dot product does not care about the order of
//     K, so A (w) and B (x) just have to use the same permutation, which they do.
//   - Too few rows to fill 132 SMs (N / 64 = 64..160 row blocks of 64), so K is split S ways
//     (S <= 8). The S CTAs of one row block form a thread-block cluster and reduce their partial
//     sums through distributed shared memory: one launch, no workspace, no atomics, deterministic.
//
// The choice table (linear.cu) picks it for Qwen3-14B's QKV at M = 2..8, with 4 splits. Its
// multi-token fragments (M <= 64), an L2 prefetch of the weight ahead of the loads and a PDL
// launch, which no cell picks, are kept on branch experiment/kernel-launch-variants.
//
// Everything needs sm_90 (clusters); the sm_80 pass of the build compiles an empty body.
#include <cooperative_groups.h>
#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <algorithm>

#include "linear_configs.h"
#include "qwen3_kernels/common.cuh"
#include "qwen3_kernels/launch.cuh"  // LaunchConfig, launch_ex
#include "qwen3_kernels/mma.cuh"     // mma_16816

namespace qwen3_kernels::linear_detail {
namespace {

constexpr int kWarps = 4;                  // per CTA; each owns 16 weight rows
constexpr int kRowsPerCta = 16 * kWarps;   // 64 weight rows per CTA
constexpr int kThreads = 32 * kWarps;
constexpr int kKStep = 128;                // columns per pipelined main-loop step (4 x 32)
// CTAs per SM the kernel is compiled for (the register cap: 65536 / (128 x CTAs)).
constexpr int kMinCtasPerSm = 4;

#if !defined(__CUDA_ARCH__) || __CUDA_ARCH__ >= 900  // device helpers: the sm_80 pass has no use

constexpr int kRedStride = kRowsPerCta + 4;  // fp32 partials [token][row]; +4 avoids bank conflicts

// 16 bytes of x: reused by the CTA's four warps, so through L1.
__device__ __forceinline__ uint4 load_shared_operand(const void* p) {
  return __ldg(reinterpret_cast<const uint4*>(p));
}

// 32 columns of K for this warp: w_lo / w_hi hold columns kk + 8t .. +7 of rows g and g + 8;
// x_rows[j] points at token row 8j + g (clamped to a valid row), already offset by kk + 8t.
template <typename T, int NT>
__device__ __forceinline__ void mma_k32(float (&acc)[NT][4], const uint4& w_lo, const uint4& w_hi,
                                        const T* const (&x_rows)[NT], bool valid) {
#pragma unroll
  for (int j = 0; j < NT; ++j) {
    const uint4 xb = valid ? load_shared_operand(x_rows[j]) : make_uint4(0, 0, 0, 0);
    // k-step 0: loaded columns 0..3 are slots {2t, 2t+1} (.x) and {2t+8, 2t+9} (.y)
    mma_16816<T>(acc[j], {w_lo.x, w_hi.x, w_lo.y, w_hi.y}, xb.x, xb.y);
    // k-step 1: loaded columns 4..7, same slots
    mma_16816<T>(acc[j], {w_lo.z, w_hi.z, w_lo.w, w_hi.w}, xb.z, xb.w);
  }
}

#endif  // !__CUDA_ARCH__ || __CUDA_ARCH__ >= 900

// Grid (S, ceil(n / 64)), cluster (S, 1, 1): blockIdx.x is the K split, blockIdx.y the row block.
template <typename T, int NT>
__global__ void __launch_bounds__(kThreads, kMinCtasPerSm)
    splitk_kernel(T* __restrict__ out,        // [m, n]
                  const T* __restrict__ x,    // [m, k], m <= 8 * NT
                  const T* __restrict__ w,    // [n, k]
                  int m, int n, int k,
                  int k_chunk) {              // columns per split, a multiple of 8
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  namespace cg = cooperative_groups;
  __shared__ __align__(16) float red[8 * NT][kRedStride];

  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  const int g = lane / 4, t = lane % 4;
  const int row_block = blockIdx.y * kRowsPerCta;
  // Rows past n (only in the last row block) load a valid row; their results are never stored.
  const int r_lo = min(row_block + warp * 16 + g, n - 1);
  const int r_hi = min(row_block + warp * 16 + g + 8, n - 1);
  const int kb = blockIdx.x * k_chunk;
  const int ke = min(k, kb + k_chunk);

  const T* w_lo = w + static_cast<int64_t>(r_lo) * k + 8 * t;
  const T* w_hi = w + static_cast<int64_t>(r_hi) * k + 8 * t;
  const T* x_rows[NT];
#pragma unroll
  for (int j = 0; j < NT; ++j) x_rows[j] = x + static_cast<int64_t>(min(8 * j + g, m - 1)) * k + 8 * t;

  float acc[NT][4];
#pragma unroll
  for (int j = 0; j < NT; ++j) acc[j][0] = acc[j][1] = acc[j][2] = acc[j][3] = 0.f;

  // 128 columns a step, software-pipelined: the next step's 8 loads per thread are issued before
  // this step's mmas, so each warp keeps up to 2 x 4 KB of weight in flight. The last step of a
  // split may be partial: a thread's 8 columns are all in or all out (k % 8 == 0), and columns
  // out of range load as zeros on both operands.
  uint4 cur_lo[4], cur_hi[4];
#pragma unroll
  for (int u = 0; u < 4; ++u) {
    const bool valid = kb + 32 * u + 8 * t < ke;
    cur_lo[u] = valid ? load_stream(w_lo + kb + 32 * u) : make_uint4(0, 0, 0, 0);
    cur_hi[u] = valid ? load_stream(w_hi + kb + 32 * u) : make_uint4(0, 0, 0, 0);
  }
  for (int kk = kb; kk < ke; kk += kKStep) {
    const int kn = kk + kKStep;
    uint4 nxt_lo[4], nxt_hi[4];
#pragma unroll
    for (int u = 0; u < 4; ++u) {
      const bool valid = kn + 32 * u + 8 * t < ke;
      nxt_lo[u] = valid ? load_stream(w_lo + kn + 32 * u) : make_uint4(0, 0, 0, 0);
      nxt_hi[u] = valid ? load_stream(w_hi + kn + 32 * u) : make_uint4(0, 0, 0, 0);
    }
#pragma unroll
    for (int u = 0; u < 4; ++u) {
      const T* xr[NT];
#pragma unroll
      for (int j = 0; j < NT; ++j) xr[j] = x_rows[j] + kk + 32 * u;
      mma_k32<T, NT>(acc, cur_lo[u], cur_hi[u], xr, kk + 32 * u + 8 * t < ke);
    }
#pragma unroll
    for (int u = 0; u < 4; ++u) {
      cur_lo[u] = nxt_lo[u];
      cur_hi[u] = nxt_hi[u];
    }
  }

  // Partial sums to shared memory as [token][row]: c0, c1 are (row g, tokens 2t, 2t+1) and
  // c2, c3 the same tokens for row g + 8.
#pragma unroll
  for (int j = 0; j < NT; ++j) {
    const int row = warp * 16 + g;
    red[8 * j + 2 * t][row] = acc[j][0];
    red[8 * j + 2 * t + 1][row] = acc[j][1];
    red[8 * j + 2 * t][row + 8] = acc[j][2];
    red[8 * j + 2 * t + 1][row + 8] = acc[j][3];
  }

  // Reduce across the S splits of this row block: CTA rank r sums every S-th slice of the
  // [m, 64] tile over all S CTAs' shared memory, two adjacent rows at a time.
  cg::cluster_group cluster = cg::this_cluster();
  cluster.sync();  // all partials written and visible cluster-wide
  const int splits = static_cast<int>(cluster.num_blocks());
  const int rank = static_cast<int>(cluster.block_rank());
  for (int e = rank * kThreads + threadIdx.x; e < m * (kRowsPerCta / 2); e += splits * kThreads) {
    const int tok = e / (kRowsPerCta / 2);
    const int row = 2 * (e % (kRowsPerCta / 2));
    float2 sum = make_float2(0.f, 0.f);
    for (int q = 0; q < splits; ++q) {
      const float* part = cluster.map_shared_rank(&red[0][0], q);
      const float2 v = *reinterpret_cast<const float2*>(part + tok * kRedStride + row);
      sum.x += v.x;
      sum.y += v.y;
    }
    const int col = row_block + row;
    if (col < n) {  // n % 8 == 0, so col + 1 < n too
      T pair[2] = {from_float<T>(sum.x), from_float<T>(sum.y)};
      *reinterpret_cast<uint32_t*>(out + static_cast<int64_t>(tok) * n + col) =
          *reinterpret_cast<const uint32_t*>(pair);
    }
  }
  cluster.sync();  // no CTA leaves while another still reads its shared memory
#endif
}

template <typename T>
cudaError_t launch(const Problem& p, int splits) {
  const int k = static_cast<int>(p.k);
  // Columns per split, a multiple of 8 (a thread's load); the last split may get fewer.
  const int k_chunk = ((k + splits - 1) / splits + 7) / 8 * 8;
  const LaunchConfig cfg(dim3(splits, static_cast<unsigned>((p.n + kRowsPerCta - 1) / kRowsPerCta), 1),
                         dim3(kThreads, 1, 1), 0, p.stream, false, splits);
  return launch_ex(splitk_kernel<T, 1>, cfg, static_cast<T*>(p.out), static_cast<const T*>(p.x),
                   static_cast<const T*>(p.w), static_cast<int>(p.m), static_cast<int>(p.n), k,
                   k_chunk);
}

}  // namespace

cudaError_t splitk_gemm(const Problem& p, bool bf16, int splits) {
  if (p.m < 1 || p.m > kSplitKMaxM || splits < 1 || splits > 8) return cudaErrorNotSupported;
  if (p.n % 8 != 0 || p.k % 8 != 0 || p.k > (int64_t{1} << 30) || p.n > (int64_t{1} << 30)) {
    return cudaErrorNotSupported;
  }
  cudaError_t err = bf16 ? launch<__nv_bfloat16>(p, splits) : launch<__half>(p, splits);
  return err != cudaSuccess ? err : cudaGetLastError();
}

}  // namespace qwen3_kernels::linear_detail
