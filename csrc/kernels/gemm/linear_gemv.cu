// linear at one token on the CUDA cores: a weight-streaming GEMV ("gemv").
//
// At M = 1, out[1, N] = x[1, K] @ w[N, K]^T is a pass over the N*K weight and little else, so the
// only goal is to keep enough weight bytes in flight to reach the HBM read ceiling:
//   - Each warp owns R consecutive weight rows (output columns) over the whole K: no split-K, no
//     reduction between CTAs, no workspace, no atomics; every output is written by one lane.
//   - A lane reads 16 bytes (8 columns) of each row per 256-column slice, so a warp's loads are
//     512 contiguous bytes per row. A stage is 4 such loads per thread (R rows x 4/R slices), and
//     the next stage's 4 loads are issued before this stage's FMAs: 4..8 independent 16-byte
//     loads in flight per thread at all times. The loads bypass L1 (ld.global.nc.L1::no_allocate),
//     which exists on sm_80 too, so the kernel builds there.
//   - L2 fetches the sectors asked for: asking it for 256-byte lines (.L2::256B) was slower.
//     Qwen3-8B at one token, 36 layers of weights rotated, PDL launches as in the engine's
//     graphs (H200, us): gate_up + silu 52.37 -> 50.20, down 26.20 -> 25.63, qkv 14.12 ->
//     13.51, o_proj 10.26 -> 10.10, a layer's six launches 106.8 -> 102.5 (python
//     benchmarks/bench_linear.py). One row a warp
//     with 8 loads a stage, faster in plain launches of a read probe (branch
//     experiment/one-off-probes), was far slower there: down 33.5, o_proj 13.8.
//   - Many small CTAs (4 warps, 4 * R rows): N / (4 R) = 256..5120 CTAs for the Qwen3 shapes,
//     several per SM, and the block scheduler balances them dynamically (nothing waits on a wave).
//   - x is read through L1 with __ldg, not staged in shared memory. Every warp of every CTA on
//     an SM reads the same columns at about the same time, and L1 is shared by all the SM's
//     CTAs, whereas a shared-memory copy would be fetched from L2 once per CTA. L1 and shared
//     memory share one data path, so nothing is lost on hits.
//   - fp32 accumulators acc[row] per lane, summed across the warp with shuffles at the end.
//
// The launch, on sm_90: programmatic dependent launch with each thread's first stage of weight
// loads issued before griddepcontrol.wait (the weight is no kernel's output during a forward, so
// its first bytes arrive while the kernel before finishes) and the trigger for the next kernel
// after the CTA's last store (triggered at the start, the next kernel's CTAs take the slots our
// first CTAs to finish free and pile up there; triggered last, they find the SMs about empty).
// Its contract: the weight must not be written by the kernel right before. Measured (H200,
// python benchmarks/bench_engine.py --size 8B --batch1, alternating): 225.8 / 225.9 decode tok/s
// against pdl_late 225.5 / 225.6 and a plain launch 220.0-220.2; Qwen3-8B qkv back to back: pdl
// (trigger at the start) 18.6 us, plain 14.6-14.8, trigger last 14.1-14.3. Before sm_90 a plain
// launch. Two stages of weight loads issued before the wait instead of one (branch
// experiment/gemv-prewait-stages: more of o_proj's weight in flight while the attention chain
// runs) lost: Qwen3-8B batch 1 172.1 / 172.2 against 177.2 / 177.1 decode tok/s (H100,
// alternating). The multi-token GEMV (M <= 8: lost to cuBLAS at M = 3 and 8, 0.67-1.08x), the
// other launches (plain, pdl, pdl_early, pdl_late), the .L2::256B loads and linear_silu_and_mul
// by warp rows are kept on branch experiment/kernel-launch-variants.
// The residual add + RMSNorm before qkv_proj and gate_up fused into these GEMVs (every warp
// forming the normalised row from x, the residual and the norm weight, 1 / rms on the finished
// sums; branch experiment/norm-in-gemv) measured slower: the norm's own launch already hides
// behind the GEMV's PDL prologue. Qwen3-8B at one token, 36 layers rotated, H100: qkv 19.26 us a
// layer against 19.29 with the norm before it, gate_up + silu 70.40 against 66.52; engine batch
// 1 174.9 against 180.9 decode tok/s (both twice, alternating).
#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include "linear_configs.h"
#include "qwen3_kernels/launchers.h"
#include "qwen3_kernels/common.cuh"
#include "qwen3_kernels/launch.cuh"

namespace qwen3_kernels::linear_detail {
namespace {

constexpr int kWarps = 4;                 // per CTA
constexpr int kThreads = 32 * kWarps;
constexpr int kLoadsPerStage = 4;         // 16-byte weight loads per thread per pipeline stage
constexpr int kSlice = 32 * 8;            // columns one warp covers with one 16-byte load per lane

// One stage of weight loads: slice u of row r at columns kk + 256 u + 8 lane .. +7. Columns at or
// past k (only in the last stage; k % 8 == 0, so a lane's 8 columns are all in or all out) are not
// read.
template <typename T, int R, int U>
__device__ __forceinline__ void load_stage(uint4 (&buf)[R][U], const T* const (&rows)[R], int kk,
                                           int lane_col, int k) {
#pragma unroll
  for (int u = 0; u < U; ++u) {
    const int col = kk + u * kSlice + lane_col;
#pragma unroll
    for (int r = 0; r < R; ++r) {
      buf[r][u] = col < k ? load_stream<false>(rows[r] + col) : make_uint4(0, 0, 0, 0);
    }
  }
}

// Where a one-token GEMV also sends its output (tp_gemv_push): every peer's receive buffer of the
// one-shot all-reduce (custom_all_reduce.cu), in that kernel's layout and LL packets, as the
// all-reduce itself would send the row. The all-reduce that follows then only waits and adds.
struct PushTarget {
  const int64_t* peer_ptrs;  // [world]: each rank's receive buffer
  const uint32_t* counters;  // [2]: the all-reduce's call count (read here, advanced there)
  int64_t slot_bytes;
  int world, rank;
};

// One aligned 8-byte LL packet (custom_all_reduce.cu): 4 data bytes, then the 4-byte flag.
__device__ __forceinline__ void store_packet_sys(char* p, uint64_t v) {
  asm volatile("st.relaxed.sys.global.b64 [%0], %1;\n" ::"l"(p), "l"(v) : "memory");
}

// Grid ceil(n / (4 R)) CTAs of 4 warps; warp w of CTA b owns rows (4 b + w) R .. + R - 1.
// kPdl (sm_90): nothing but the first stage of weight is read before the previous kernel has
// finished, and the next kernel is let in after our stores (see the top of the file).
// kPush (tp_gemv_push; R even): lanes 1 .. world - 1 also store the warp's R outputs, R / 2
// packets, into slot `rank` of the peers' receive buffers, flagged with the all-reduce's next
// call. The count is read after the PDL wait: the kernel before has finished, and with it every
// earlier all-reduce (each advanced the count before it finished).
template <typename T, int R, bool kPdl, bool kPush>
__global__ void __launch_bounds__(kThreads)
    gemv_kernel(T* __restrict__ out,        // [1, n]
                const T* __restrict__ x,    // [1, k]
                const T* __restrict__ w,    // [n, k]
                int n, int k, PushTarget push) {
  constexpr int U = kLoadsPerStage / R;  // slices per row per stage
  constexpr int kStep = U * kSlice;      // columns per stage
  static_assert(R <= 32, "one lane stores each row's result");
  static_assert(!kPush || (R % 2 == 0 && R <= 4), "kPush: whole packets of two outputs");

  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  const int j0 = (blockIdx.x * kWarps + warp) * R;  // first output column of this warp
  // n % R == 0 (n % 8 == 0, R divides 4), so a warp's rows are all in range or all out of it.
  // No barrier follows, so the idle warps of the last CTA can leave.
  if (j0 >= n) return;
  const int lane_col = 8 * lane;

  const T* rows[R];
#pragma unroll
  for (int r = 0; r < R; ++r) rows[r] = w + static_cast<int64_t>(j0 + r) * k;
  const T* xr = x + lane_col;

  float acc[R];
#pragma unroll
  for (int r = 0; r < R; ++r) acc[r] = 0.f;

  uint4 cur[R][U];
  load_stage(cur, rows, 0, lane_col, k);
  if constexpr (kPdl) pdl_wait();  // x may be the previous kernel's output, out its input
  for (int kk = 0; kk < k; kk += kStep) {
    // the next stage in flight while this one is multiplied
    uint4 nxt[R][U];
    load_stage(nxt, rows, kk + kStep, lane_col, k);
#pragma unroll
    for (int u = 0; u < U; ++u) {
      const int c = kk + u * kSlice;  // column of lane 0
      if (c + lane_col < k) {         // divergent only in the last stage
        float wf[R][8];
#pragma unroll
        for (int r = 0; r < R; ++r) to_float8<T>(cur[r][u], wf[r]);
        float xf[8];
        to_float8<T>(__ldg(reinterpret_cast<const uint4*>(xr + c)), xf);
#pragma unroll
        for (int r = 0; r < R; ++r)
#pragma unroll
          for (int e = 0; e < 8; ++e) acc[r] = fmaf(wf[r][e], xf[e], acc[r]);
      }
    }
#pragma unroll
    for (int r = 0; r < R; ++r)
#pragma unroll
      for (int u = 0; u < U; ++u) cur[r][u] = nxt[r][u];
  }

  // Every lane ends with every sum (xor butterfly); lane r stores column j0 + r.
  [[maybe_unused]] T pushed[kPush ? R : 1];  // kPush: the outputs as stored, for the packets
#pragma unroll
  for (int r = 0; r < R; ++r) {
    const float s = warp_sum(acc[r]);
    if (lane == r) out[j0 + r] = from_float<T>(s);
    if constexpr (kPush) pushed[r] = from_float<T>(s);
  }
  if constexpr (kPush) {
    if (lane >= 1 && lane < push.world) {
      const uint32_t call = *reinterpret_cast<const volatile uint32_t*>(push.counters);
      const uint32_t flag = call + 1u;  // the all-reduce's flag for this call (never 0)
      const int peer = push.rank + lane < push.world ? push.rank + lane
                                                     : push.rank + lane - push.world;
      // slot `rank` of half (call & 1); outputs j0, j0 + 1 are the packet at byte 4 j0
      char* dst = reinterpret_cast<char*>(push.peer_ptrs[peer]) +
                  (static_cast<int64_t>(call & 1u) * push.world + push.rank) * push.slot_bytes +
                  static_cast<int64_t>(j0) * 4;
#pragma unroll
      for (int q = 0; q < R / 2; ++q) {
        uint32_t word;
        T* pair = reinterpret_cast<T*>(&word);
        pair[0] = pushed[2 * q];
        pair[1] = pushed[2 * q + 1];
        store_packet_sys(dst + 8 * q, static_cast<uint64_t>(word) |
                                          (static_cast<uint64_t>(flag) << 32));
      }
    }
  }
  // The next PDL kernel is scheduled only once every CTA got here, so its CTAs find the SMs
  // nearly empty and spread evenly.
  if constexpr (kPdl) pdl_launch_dependents();
}

// Launches kernel_of(std::bool_constant<kPdl>{}) with PDL on sm_90, plainly before.
template <typename KernelOf, typename... Args>
cudaError_t launch_pdl_on_sm90(KernelOf kernel_of, dim3 grid, cudaStream_t stream, Args... args) {
  if (current_device_info().cc_major >= 9)
    return launch_ex(kernel_of(std::true_type{}), grid, dim3(kThreads), stream, true, 1, args...);
  return launch_ex(kernel_of(std::false_type{}), grid, dim3(kThreads), stream, false, 1, args...);
}

template <typename T, int R, bool kPush = false>
cudaError_t launch(const Problem& p, PushTarget push = {}) {
  const int64_t cols_per_cta = static_cast<int64_t>(kWarps) * R;
  const dim3 grid(static_cast<unsigned>((p.n + cols_per_cta - 1) / cols_per_cta));
  auto kernel_of = [](auto pdl) { return gemv_kernel<T, R, decltype(pdl)::value, kPush>; };
  return launch_pdl_on_sm90(kernel_of, grid, p.stream, static_cast<T*>(p.out),
                            static_cast<const T*>(p.x), static_cast<const T*>(p.w),
                            static_cast<int>(p.n), static_cast<int>(p.k), push);
}

// linear_silu_and_mul at one token, with the CTA reading whole rows in order ("cta rows"): CTA b
// owns the outputs j0 = 4 b .. 4 b + 3 and reads gate rows j0 .. j0 + 3 (32 KB contiguous at
// K = 4096), then up rows I + j0 .. (another 32 KB), each row front to back: load l of stage s of
// thread t is the row's 16 bytes at column 8 (512 s + 128 l + t), so a stage of the CTA is 8 KB
// contiguous of one row, and the next stage (of the same row or the next) is in flight while this
// one is multiplied. Each thread keeps one partial sum per row; one CTA reduction at the end.
// Against gemv_kernel's warp rows (a warp streams one gate and one up row, 512 bytes of each per
// load) the GPU's reads at any moment are fewer, longer runs of addresses: Qwen3-8B gate_up
// (24576 x 4096) 47.3 vs 49.6 us in a read probe (H200, PDL launches; branch
// experiment/one-off-probes). x ([1, k]) is read through L1 and the launch is as gemv_kernel's.
constexpr int kCtaRowsOut = 4;                 // output columns a CTA
constexpr int kCtaRows = 2 * kCtaRowsOut;      // weight rows a CTA: its gate rows, then up rows

template <typename T, bool kPdl>
__global__ void __launch_bounds__(kThreads)
    silu_cta_rows_kernel(T* __restrict__ out,      // [1, n / 2]
                         const T* __restrict__ x,  // [1, k]
                         const T* __restrict__ w,  // [n, k]: [gate; up]
                         int n, int k) {
  constexpr int kStage = kLoadsPerStage * kThreads;  // 16-byte words of a row a stage
  const int t = threadIdx.x;
  const int half = n / 2;                 // I: n % 8 == 0, so I % 4 == 0 and every CTA is full
  const int j0 = blockIdx.x * kCtaRowsOut;
  const int words = k / 8;                // 16-byte words a row
  const int stages = (words + kStage - 1) / kStage;  // a row's stages
  auto row = [&](int r) {
    return w + static_cast<int64_t>(r < kCtaRowsOut ? j0 + r : half + j0 + r - kCtaRowsOut) * k;
  };
  auto load = [&](uint4(&buf)[kLoadsPerStage], int r, int s) {
    const T* base = row(r);
#pragma unroll
    for (int l = 0; l < kLoadsPerStage; ++l) {
      const int c = s * kStage + l * kThreads + t;
      buf[l] = c < words ? load_stream<false>(base + 8 * c) : make_uint4(0, 0, 0, 0);
    }
  };
  float acc[kCtaRows];
  uint4 cur[kLoadsPerStage];
  load(cur, 0, 0);
  if constexpr (kPdl) pdl_wait();  // x may be the previous kernel's output, out its input
#pragma unroll
  for (int r = 0; r < kCtaRows; ++r) {
    acc[r] = 0.f;
    for (int s = 0; s < stages; ++s) {
      // the next stage in flight while this one is multiplied
      uint4 nxt[kLoadsPerStage];
      if (s + 1 < stages) {
        load(nxt, r, s + 1);
      } else if (r + 1 < kCtaRows) {
        load(nxt, r + 1, 0);
      } else {
#pragma unroll
        for (int l = 0; l < kLoadsPerStage; ++l) nxt[l] = make_uint4(0, 0, 0, 0);
      }
#pragma unroll
      for (int l = 0; l < kLoadsPerStage; ++l) {
        const int c = s * kStage + l * kThreads + t;
        if (c < words) {  // divergent only in a row's last stage
          float wf[8], xf[8];
          to_float8<T>(cur[l], wf);
          to_float8<T>(__ldg(reinterpret_cast<const uint4*>(x) + c), xf);
#pragma unroll
          for (int e = 0; e < 8; ++e) acc[r] = fmaf(wf[e], xf[e], acc[r]);
        }
      }
#pragma unroll
      for (int l = 0; l < kLoadsPerStage; ++l) cur[l] = nxt[l];
    }
  }
  __shared__ float partial[kWarps][kCtaRows];
#pragma unroll
  for (int r = 0; r < kCtaRows; ++r) {
    const float v = warp_sum(acc[r]);
    if (t % 32 == 0) partial[t / 32][r] = v;
  }
  __syncthreads();
  if (t < kCtaRowsOut) {
    float g = 0.f, u = 0.f;
#pragma unroll
    for (int i = 0; i < kWarps; ++i) {
      g += partial[i][t];
      u += partial[i][kCtaRowsOut + t];
    }
    // g and u rounded to T first, as the unfused GEMM's output would be; then silu_and_mul's math
    g = to_float(from_float<T>(g));
    u = to_float(from_float<T>(u));
    out[j0 + t] = from_float<T>(g / (1.0f + __expf(-g)) * u);
  }
  if constexpr (kPdl) pdl_launch_dependents();
}

template <typename T>
cudaError_t launch_silu_cta_rows(const Problem& p) {
  const dim3 grid(static_cast<unsigned>(p.n / 2 / kCtaRowsOut));
  auto kernel_of = [](auto pdl) { return silu_cta_rows_kernel<T, decltype(pdl)::value>; };
  return launch_pdl_on_sm90(kernel_of, grid, p.stream, static_cast<T*>(p.out),
                            static_cast<const T*>(p.x), static_cast<const T*>(p.w),
                            static_cast<int>(p.n), static_cast<int>(p.k));
}

bool gemv_fits(const Problem& p) {
  return p.m == 1 && p.n % 8 == 0 && p.k % 8 == 0 && p.n >= 8 && p.k >= 8 &&
         p.n <= (int64_t{1} << 30) && p.k <= (int64_t{1} << 30);
}

}  // namespace

// Weight rows a warp for N output columns. At 1 token (bench_linear.py, H200, every projection
// of 0.6B / 8B / 8B TP 2 and the QKV of every size): 2 rows a warp were fastest or within 1%
// everywhere except N = 10240..12288 (32B QKV, 8B gate_up under TP 2: 4 rows 26 vs 28 us), where
// 4 rows still leave 640..768 CTAs; below 8192 rows 4 rows a warp leave too few CTAs (8B down,
// N 4096: 35 vs 27 us), and at N = 24576 (8B gate_up) 4 rows were slower again (54 vs 51 us).
bool gemv_four_rows_per_warp(int64_t n) { return n >= 8192 && n <= 16384; }

cudaError_t gemv_gemm(const Problem& p, bool bf16) {
  if (!gemv_fits(p)) return cudaErrorNotSupported;
  if (gemv_four_rows_per_warp(p.n))
    return bf16 ? launch<__nv_bfloat16, 4>(p) : launch<__half, 4>(p);
  return bf16 ? launch<__nv_bfloat16, 2>(p) : launch<__half, 2>(p);
}

cudaError_t gemv_silu_and_mul(const Problem& p, bool bf16) {
  if (!gemv_fits(p)) return cudaErrorNotSupported;
  return bf16 ? launch_silu_cta_rows<__nv_bfloat16>(p) : launch_silu_cta_rows<__half>(p);
}

}  // namespace qwen3_kernels::linear_detail

namespace qwen3_kernels {

cudaError_t tp_gemv_push(void* out, const void* x, const void* w, int64_t n, int64_t k,
                         const int64_t* peer_ptrs, const uint32_t* counters, int64_t slot_bytes,
                         int world, int rank, DType dtype, cudaStream_t stream) {
  using namespace linear_detail;
  if (dtype != DType::kBFloat16 && dtype != DType::kFloat16) return cudaErrorNotSupported;
  if (world < 2 || world > 8 || rank < 0 || rank >= world || n * 4 > slot_bytes ||
      peer_ptrs == nullptr || counters == nullptr)
    return cudaErrorInvalidValue;
  Problem p{};
  p.out = out;
  p.x = x;
  p.w = w;
  p.m = 1;
  p.n = n;
  p.k = k;
  p.stream = stream;
  if (!gemv_fits(p)) return cudaErrorNotSupported;
  const PushTarget push{peer_ptrs, counters, slot_bytes, world, rank};
  // 2 or 4 rows a warp: whole packets
  const bool four = gemv_four_rows_per_warp(n);
  if (dtype == DType::kBFloat16)
    return four ? launch<__nv_bfloat16, 4, true>(p, push) : launch<__nv_bfloat16, 2, true>(p, push);
  return four ? launch<__half, 4, true>(p, push) : launch<__half, 2, true>(p, push);
}

cudaError_t linear_silu_and_mul(void* out, const void* x, const void* w, int64_t m, int64_t two_i,
                                int64_t k, DType dtype, cudaStream_t stream) {
  if (dtype != DType::kBFloat16 && dtype != DType::kFloat16) return cudaErrorNotSupported;
  linear_detail::Problem p{};
  p.out = out;
  p.x = x;
  p.w = w;
  p.m = m;
  p.n = two_i;
  p.k = k;
  p.stream = stream;
  return linear_detail::gemv_silu_and_mul(p, dtype == DType::kBFloat16);
}

}  // namespace qwen3_kernels
