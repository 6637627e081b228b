// linear for decode batches (M <= 128 tokens) on the tensor cores: a weight-streaming wgmma
// kernel ("stream").
//
// At 17..128 tokens out[M, N] = x[M, K] @ w[N, K]^T is still mostly a pass over the weight (at
// M = 128, 128 FLOPs per weight byte: ~520 TFLOP/s at the HBM rate, within wgmma's reach), but
// cuBLAS reads the weight at only 2.4-2.9 TB/s on Qwen3-8B's o / down / qkv shapes (RESULTS.md,
// tenth session: o 14.4 us for 33.5 MB). What this kernel does about it:
//   - Swapped operands, as in the CUTLASS swap tiles: a CTA owns 256 weight rows (the wgmma M side:
//     two consumer warpgroups x two m64 blocks) and ALL the tokens (the wgmma N side, padded to
//     kTokens = 64 or 128), so the weight is read exactly once and each SM takes in only half a
//     weight byte of x per weight byte (128 tokens / 256 rows): what an SM can take in, not HBM,
//     is what caps small-tile GEMMs here.
//   - Too few row blocks to fill 132 SMs (N / 256 = 16 for o / down, 24 for qkv), so K is split S
//     ways (S <= 8); the S CTAs of one row block form a thread-block cluster and reduce their fp32
//     partials through distributed shared memory at the end: one launch, no workspace, no memset
//     node in a graph, deterministic.
//   - One producer thread streams 64-column stages of w and x into a ring of shared memory with
//     TMA (128-byte swizzle, the layout wgmma reads; edges zero-filled) onto a "full" mbarrier per
//     stage; the two consumer warpgroups issue wgmma on a stage, keep one stage's wgmma in flight,
//     and release the stage before that ("empty" mbarrier). (16-byte cp.async from a producer
//     warpgroup, as in prefill_sm90_ws.cu, read the weight at 1.2-2.4 TB/s here; TMA 1.9-3.4.)
//   - Launched with PDL: the first ring-full of weight is requested before griddepcontrol.wait,
//     so it streams while the kernel before finishes (the launch gap and ramp of a ~15 us GEMM).
//   - The output leaves through shared memory: each CTA writes its partial tile [tokens][rows]
//     into the (then idle) ring, and rank q of the cluster sums the partials of its share of the
//     tokens from every CTA and stores contiguous rows of out.
// Requires K % 8 == 0 and N % 8 == 0 (16-byte rows); rows past N and tokens past M are zero-filled
// at load and never stored. sm_90a only: the sm_80 pass compiles an empty body.
#include <cooperative_groups.h>
#include <cuda.h>  // CUtensorMap (the encode function comes through the runtime's entry point)
#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <algorithm>
#include <atomic>
#include <type_traits>

#include "linear_configs.h"
#include "qwen3_kernels/common.cuh"
#include "qwen3_kernels/mma.cuh"
#include "qwen3_kernels/tuning.cuh"  // pdl_wait, pdl_launch_dependents
#include <cudaTypedefs.h>  // PFN_cuTensorMapEncodeTiled

namespace qwen3_kernels::linear_detail {
namespace {

constexpr int kRows = 256;             // weight rows (output columns) per CTA
constexpr int kBlockK = 64;            // K columns per stage: one 128-byte swizzle row
constexpr int kWBytes = kRows * 128;   // one stage of w: 32 KiB
constexpr int kThreads = 384;          // producer warpgroup + two consumer warpgroups
constexpr int kRedStride = kRows + 4;  // floats per token of the partial tile (+4: no bank conflict)
constexpr int kProducerRegs = 40;
constexpr int kConsumerRegs = 232;
static_assert(128 * kProducerRegs + 256 * kConsumerRegs <= 65536, "register file");

template <int kTokens>
struct StreamShape {
  static constexpr int kStageBytes = kWBytes + kTokens * 128;
  static constexpr int kStages = kTokens == 128 ? 4 : 5;  // as many as fit next to nothing else
  static constexpr int kRedBytes = kTokens * kRedStride * 4;
  static_assert(kRedBytes <= kStages * kStageBytes, "the partial tile reuses the ring");
  // 1 KiB alignment slack (the swizzle) + the ring + full / empty mbarriers
  static constexpr int kSmemBytes = 1024 + kStages * kStageBytes + 16 * kStages;
  static_assert(kSmemBytes <= 227 * 1024, "opt-in shared memory");
};

#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
using namespace sm90;

// d[64 x kTokens] += A[64 x 16] B[16 x kTokens], both from shared memory.
template <typename T, int kTokens>
__device__ __forceinline__ void wgmma_rows64(float (&d)[kTokens / 2], uint64_t da, uint64_t db) {
  if constexpr (kTokens == 128) {
    wgmma_m64n128k16_ss<T>(d, da, db, 1);
  } else {
    wgmma_m64n64k16_ss<T>(d, da, db, 1);
  }
}

// The producer's TMA: one thread asks for a stage's bytes on the stage's "full" barrier, then loads
// a [rows, 64] box (128-byte swizzle, out-of-range rows / columns zero-filled) into it.
__device__ __forceinline__ void mbar_expect_tx(uint32_t bar, uint32_t bytes) {
  asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;\n" ::"r"(bar), "r"(bytes)
               : "memory");
}
__device__ __forceinline__ void tma_load_2d(uint32_t dst, const CUtensorMap* map, int col, int row,
                                            uint32_t bar) {
  asm volatile(
      "cp.async.bulk.tensor.2d.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1, {%2, "
      "%3}], [%4];\n" ::"r"(dst),
      "l"(reinterpret_cast<uint64_t>(map)), "r"(col), "r"(row), "r"(bar)
      : "memory");
}

__device__ __forceinline__ void cluster_arrive() {
  asm volatile("barrier.cluster.arrive.release.aligned;\n" ::: "memory");
}
__device__ __forceinline__ void cluster_wait() {
  asm volatile("barrier.cluster.wait.acquire.aligned;\n" ::: "memory");
}
#endif

// Grid (S, ceil(n / 256)), cluster (S, 1, 1): blockIdx.x is the K split (= the rank in the
// cluster), blockIdx.y the row block.
template <typename T, int kTokens>
__global__ void __launch_bounds__(kThreads, 1)
    stream_kernel(T* __restrict__ out,                   // [m, n]
                  const __grid_constant__ CUtensorMap x_map,  // x [m, k], m <= kTokens; box 64 x kTokens
                  const __grid_constant__ CUtensorMap w_map,  // w [n, k]; box 64 x 256
                  int m, int n, int k,
                  int kb_per_split) {         // 64-column blocks of K per split
#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
  using S = StreamShape<kTokens>;
  extern __shared__ __align__(16) uint8_t smem_raw[];
  const uint32_t raw_addr = smem_addr(smem_raw);
  const uint32_t ring = (raw_addr + 1023) & ~1023u;  // the 128-byte swizzle needs 1 KiB alignment
  uint8_t* ring_ptr = smem_raw + (ring - raw_addr);
  const uint32_t bar_full = ring + S::kStages * S::kStageBytes;  // [kStages]: TMA bytes
  const uint32_t bar_empty = bar_full + 8 * S::kStages;          // [kStages]: 8 consumer warps

  const int tid = threadIdx.x;
  const int wg = tid / 128;
  const int n0 = blockIdx.y * kRows;
  const int splits = gridDim.x, rank = blockIdx.x;
  const int num_kb = (k + kBlockK - 1) / kBlockK;
  const int kb0 = rank * kb_per_split;
  const int steps = max(0, min(num_kb, kb0 + kb_per_split) - kb0);

  if (tid == 0) {
    for (int s = 0; s < S::kStages; ++s) {
      mbar_init(bar_full + 8 * s, 1);
      mbar_init(bar_empty + 8 * s, 8);
    }
    mbar_init_fence();
  }
  __syncthreads();

  if (wg == 0) {
    // ---- producer: one thread issues the TMA loads of every stage ----
    regs_dealloc<kProducerRegs>();
    if (tid == 0) {
      asm volatile("prefetch.tensormap [%0];\n" ::"l"(reinterpret_cast<uint64_t>(&w_map)) : "memory");
      asm volatile("prefetch.tensormap [%0];\n" ::"l"(reinterpret_cast<uint64_t>(&x_map)) : "memory");
      // Launched with PDL: the CTAs may start while the kernel before (the norm, the attention,
      // silu_and_mul) still runs. The weight is no kernel's output during a forward, so the
      // first ring-full of it is asked for before griddepcontrol.wait; x (that kernel's output)
      // only after it. Every other read and the output follow x, so they follow the wait too.
      const int early = min(steps, S::kStages);
      for (int s = 0; s < early; ++s) {
        const uint32_t full = bar_full + 8 * s;
        mbar_expect_tx(full, S::kStageBytes);  // both boxes, zero-filled parts included
        tma_load_2d(ring + s * S::kStageBytes, &w_map, (kb0 + s) * kBlockK, n0, full);
      }
      pdl_wait();
      for (int s = 0; s < early; ++s) {
        tma_load_2d(ring + s * S::kStageBytes + kWBytes, &x_map, (kb0 + s) * kBlockK, 0,
                    bar_full + 8 * s);
      }
      for (int s = early; s < steps; ++s) {
        const int stage = s % S::kStages;
        mbar_wait(bar_empty + 8 * stage, ((s / S::kStages) & 1) ^ 1);
        const uint32_t full = bar_full + 8 * stage;
        const uint32_t ws = ring + stage * S::kStageBytes;
        const int col = (kb0 + s) * kBlockK;
        mbar_expect_tx(full, S::kStageBytes);
        tma_load_2d(ws, &w_map, col, n0, full);
        tma_load_2d(ws + kWBytes, &x_map, col, 0, full);
      }
      pdl_launch_dependents();  // the next kernel may be scheduled; its own wait orders it after us
    }
    // the consumers wait for every stage, so all copies have landed before the ring is reused
    cluster_arrive();  // partials written (by the consumers)
    cluster_wait();
    cluster_arrive();  // every CTA done reading the others' partials
    cluster_wait();
    return;
  }

  // ---- consumers: warpgroup c owns weight rows 128 c .. 128 c + 127 (two m64 blocks) ----
  regs_alloc<kConsumerRegs>();
  const int c = wg - 1;
  const int ctid = tid - 128;  // 0..255
  float acc[2][kTokens / 2];
#pragma unroll
  for (int j = 0; j < 2; ++j)
#pragma unroll
    for (int i = 0; i < kTokens / 2; ++i) acc[j][i] = 0.f;

  for (int s = 0; s < steps; ++s) {
    const int stage = s % S::kStages;
    mbar_wait(bar_full + 8 * stage, (s / S::kStages) & 1);
    const uint32_t ws = ring + stage * S::kStageBytes + c * (128 * 128);
    const uint32_t xs = ring + stage * S::kStageBytes + kWBytes;
    wgmma_fence();
#pragma unroll
    for (int kk = 0; kk < kBlockK / 16; ++kk) {
      const uint64_t db = desc_sw128(xs + kk * 32, 16, 1024);
#pragma unroll
      for (int j = 0; j < 2; ++j)
        wgmma_rows64<T, kTokens>(acc[j], desc_sw128(ws + j * (64 * 128) + kk * 32, 16, 1024), db);
    }
    wgmma_commit();
    wgmma_wait<1>();  // the previous stage's wgmma have read their operands: release it
    if (s > 0 && (tid & 31) == 0) mbar_arrive(bar_empty + 8 * ((s - 1) % S::kStages));
  }
  wgmma_wait<0>();
  fence_regs(acc[0]);
  fence_regs(acc[1]);
  named_bar_sync(1, 256);  // both warpgroups done with the ring: it becomes the partial tile
  fence_proxy_async();     // generic writes below, after the TMA's (async proxy) into the same bytes

  // Partial tile red[token][row] (fp32): lane (g, t4) of warp w4 holds rows 16 w4 + g (+ 8) of
  // each m64 block and tokens 8 j8 + 2 t4 (+ 1).
  float* red = reinterpret_cast<float*>(ring_ptr);
  {
    const int w4 = (ctid >> 5) & 3, lane = ctid & 31, g = lane >> 2, t4 = lane & 3;
#pragma unroll
    for (int j = 0; j < 2; ++j) {
      const int row = 128 * c + 64 * j + 16 * w4 + g;
#pragma unroll
      for (int j8 = 0; j8 < kTokens / 8; ++j8) {
#pragma unroll
        for (int e = 0; e < 4; ++e) {
          const int tok = 8 * j8 + 2 * t4 + (e & 1);
          if (tok < m) red[tok * kRedStride + row + 8 * (e >> 1)] = acc[j][4 * j8 + e];
        }
      }
    }
  }
  pdl_wait();  // (already true: x, loaded after the producer's wait, came first; cheap insurance)
  cluster_arrive();  // partials written and visible cluster-wide
  cluster_wait();

  // Rank q sums tokens [q m / S, (q + 1) m / S) over the S partials: 64 float4 per token row.
  namespace cg = cooperative_groups;
  cg::cluster_group cluster = cg::this_cluster();
  const int tok_lo = rank * m / splits, tok_hi = (rank + 1) * m / splits;
  for (int i = tok_lo * 64 + ctid; i < tok_hi * 64; i += 256) {
    const int tok = i >> 6, r4 = (i & 63) * 4;
    if (n0 + r4 >= n) continue;  // n % 8 == 0: a group of 4 is all in or all out
    // All S loads first, then the sum: a loop of dependent remote loads took microseconds.
    float4 v[8];
#pragma unroll
    for (int q = 0; q < 8; ++q) {
      if (q < splits) {
        v[q] = *reinterpret_cast<const float4*>(cluster.map_shared_rank(red, q) + tok * kRedStride +
                                                r4);
      }
    }
    float4 sum = v[0];
#pragma unroll
    for (int q = 1; q < 8; ++q) {
      if (q < splits) {
        sum.x += v[q].x;
        sum.y += v[q].y;
        sum.z += v[q].z;
        sum.w += v[q].w;
      }
    }
    T o[4] = {from_float<T>(sum.x), from_float<T>(sum.y), from_float<T>(sum.z),
              from_float<T>(sum.w)};
    *reinterpret_cast<uint2*>(out + static_cast<int64_t>(tok) * n + n0 + r4) =
        *reinterpret_cast<const uint2*>(o);
  }
  cluster_arrive();  // no CTA leaves while another still reads its shared memory
  cluster_wait();
#endif
}

PFN_cuTensorMapEncodeTiled_v12000 encode_tiled() {
  static const PFN_cuTensorMapEncodeTiled_v12000 fn = [] {
    void* p = nullptr;
    cudaDriverEntryPointQueryResult q;
    if (cudaGetDriverEntryPointByVersion("cuTensorMapEncodeTiled", &p, 12000, cudaEnableDefault,
                                         &q) != cudaSuccess ||
        q != cudaDriverEntryPointSuccess) {
      cudaGetLastError();
      return static_cast<PFN_cuTensorMapEncodeTiled_v12000>(nullptr);
    }
    return reinterpret_cast<PFN_cuTensorMapEncodeTiled_v12000>(p);
  }();
  return fn;
}

// A row-major [rows, cols] 16-bit matrix read in [box_rows, 64] boxes, 128-byte swizzled.
bool make_map(CUtensorMap* map, const void* base, int64_t rows, int64_t cols, int box_rows,
              bool bf16) {
  const auto encode = encode_tiled();
  if (encode == nullptr) return false;
  const cuuint64_t dims[2] = {static_cast<cuuint64_t>(cols), static_cast<cuuint64_t>(rows)};
  const cuuint64_t strides[1] = {static_cast<cuuint64_t>(cols) * 2};
  const cuuint32_t box[2] = {kBlockK, static_cast<cuuint32_t>(box_rows)};
  const cuuint32_t elem_strides[2] = {1, 1};
  return encode(map, bf16 ? CU_TENSOR_MAP_DATA_TYPE_BFLOAT16 : CU_TENSOR_MAP_DATA_TYPE_FLOAT16, 2,
                const_cast<void*>(base), dims, strides, box, elem_strides,
                CU_TENSOR_MAP_INTERLEAVE_NONE, CU_TENSOR_MAP_SWIZZLE_128B,
                CU_TENSOR_MAP_L2_PROMOTION_L2_256B,
                CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE) == CUDA_SUCCESS;
}

// The launch configuration of stream_kernel: grid (splits, row_blocks) in clusters of `splits`
// CTAs along x, optionally with PDL.
struct StreamLaunch : LaunchConfig {
  StreamLaunch(int splits, int row_blocks, int smem_bytes, cudaStream_t stream, bool pdl)
      : LaunchConfig(dim3(splits, row_blocks, 1), dim3(kThreads, 1, 1), smem_bytes, stream, pdl,
                     splits) {}
};

// Clusters of `splits` CTAs that can be resident at once (cudaOccupancyMaxActiveClusters: a
// cluster must fit in one GPC, one CTA per SM), asked once per instantiation and split count.
template <typename T, int kTokens>
int max_active_clusters(int splits) {
  static std::atomic<int> cached[9];  // 0 = not asked yet
  int v = cached[splits].load(std::memory_order_relaxed);
  if (v > 0) return v;
  const StreamLaunch l(splits, 1, StreamShape<kTokens>::kSmemBytes, nullptr, false);
  if (cudaOccupancyMaxActiveClusters(&v, stream_kernel<T, kTokens>, &l.cfg) != cudaSuccess ||
      v < 1) {
    cudaGetLastError();
    return 0;
  }
  cached[splits].store(v, std::memory_order_relaxed);
  return v;
}

template <typename T, int kTokens>
cudaError_t launch(const Problem& p, int splits) {
  using S = StreamShape<kTokens>;
  auto* kernel = stream_kernel<T, kTokens>;
  cudaError_t err =
      cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, S::kSmemBytes);
  if (err != cudaSuccess) return err;
  const int k = static_cast<int>(p.k);
  const int num_kb = (k + kBlockK - 1) / kBlockK;
  const int row_blocks = static_cast<int>((p.n + kRows - 1) / kRows);
  if (splits == 0) {
    // The default: the most splits (<= 8, >= two K blocks each) whose clusters are all resident
    // at once: one wave, every CTA streaming from the start.
    splits = 1;
    for (int s = 8; s > 1; --s) {
      if (num_kb >= 2 * s && row_blocks <= max_active_clusters<T, kTokens>(s)) {
        splits = s;
        break;
      }
    }
  }
  const int kb_per_split = (num_kb + splits - 1) / splits;
  splits = (num_kb + kb_per_split - 1) / kb_per_split;  // no split without K blocks
  constexpr bool kBf16 = std::is_same_v<T, __nv_bfloat16>;
  CUtensorMap x_map, w_map;
  if (!make_map(&x_map, p.x, p.m, p.k, kTokens, kBf16) ||
      !make_map(&w_map, p.w, p.n, p.k, kRows, kBf16)) {
    return cudaErrorNotSupported;
  }
  const StreamLaunch l(splits, row_blocks, S::kSmemBytes, p.stream, true);
  return launch_ex(kernel, l, static_cast<T*>(p.out), x_map, w_map,
                            static_cast<int>(p.m), static_cast<int>(p.n), k, kb_per_split);
}

template <typename T>
cudaError_t launch_for_m(const Problem& p, int splits) {
  if (p.m <= 64) return launch<T, 64>(p, splits);
  return launch<T, 128>(p, splits);
}

}  // namespace

cudaError_t stream_gemm(const Problem& p, bool bf16, int splits) {
  if (p.m < 1 || p.m > kStreamMaxM || splits < 0 || splits > 8) return cudaErrorNotSupported;
  if (p.n % 8 != 0 || p.k % 8 != 0 || p.k > (int64_t{1} << 30) || p.n > (int64_t{1} << 30)) {
    return cudaErrorNotSupported;
  }
  cudaError_t err = bf16 ? launch_for_m<__nv_bfloat16>(p, splits) : launch_for_m<__half>(p, splits);
  return err != cudaSuccess ? err : cudaGetLastError();
}

}  // namespace qwen3_kernels::linear_detail
