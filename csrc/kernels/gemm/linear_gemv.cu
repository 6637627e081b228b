// linear for decode (M <= 8 tokens) on the CUDA cores: a weight-streaming GEMV ("gemv").
//
// At M <= 8, out[M, N] = x[M, K] @ w[N, K]^T is a pass over the N*K weight and little else, so the
// only goal is to keep enough weight bytes in flight to reach the HBM read ceiling:
//   - Each warp owns R consecutive weight rows (output columns) over the whole K: no split-K, no
//     reduction between CTAs, no workspace, no atomics; every output is written by one lane.
//   - A lane reads 16 bytes (8 columns) of each row per 256-column slice, so a warp's loads are
//     512 contiguous bytes per row. A stage is 4 such loads per thread (R rows x 4/R slices), and
//     the next stage's 4 loads are issued before this stage's FMAs: 4..8 independent 16-byte
//     loads in flight per thread at all times. The loads bypass L1 (ld.global.nc.L1::no_allocate),
//     which exists on sm_80 too, so the kernel builds there.
//   - L2 fetches the sectors asked for: asking it for 256-byte lines (.L2::256B, the loads until
//     2026-12-02; QWEN3_GEMV_LOADS=l2_256b) was slower. Qwen3-8B at one token, 36 layers of
//     weights rotated, PDL launches as in the engine's graphs (H200, 2026-12-02, us): gate_up +
//     silu 52.37 -> 50.20, down 26.20 -> 25.63, qkv 14.12 -> 13.51, o_proj 10.26 -> 10.10, a
//     layer's six launches 106.8 -> 102.5. (One row a warp with 8 loads a stage, faster in
//     benchmarks/read_probe.cu's plain launches, was far slower there: down 33.5, o_proj 13.8.)
//   - Many small CTAs (4 warps, 4 * R rows): N / (4 R) = 256..5120 CTAs for the Qwen3 shapes,
//     several per SM, and the block scheduler balances them dynamically (nothing waits on a wave).
//   - x is read through L1 with __ldg, not staged in shared memory. It is at most 8 x K bf16
//     (80 KB at K = 5120), every warp of every CTA on an SM reads the same columns at about the
//     same time, and L1 is shared by all the SM's CTAs, whereas a shared-memory copy would be
//     fetched from L2 once per CTA (for 8B at M = 8: 384 CTAs x 64 KB = 24 MB of L2 reads, half
//     the weight) and would cap K (8 x 25600 x 2 B = 400 KB does not fit) or need a K-tiled
//     loop with barriers. L1 and shared memory share one data path, so nothing is lost on hits.
//   - fp32 accumulators acc[token][row] per lane, summed across the warp with shuffles at the end.
//   - M is padded to NT in {1, 2, 4, 8}; rows of x past M are clamped to row M - 1 (valid memory,
//     uniform control flow) and their results are never stored.
// Cost per 8 columns of one row and NT tokens: 8 NT FMAs, 8 / NT weight converts and 8 / R x
// converts per FMA slot: at M = 8 (R = 4) about 1.4 instructions per FMA, ~8 us of issue on the
// H200 for the 8B shape against ~12 us of weight streaming, so even M = 8 should stay memory-bound.
//
// Launch variants (QWEN3_GEMV_VARIANT, read once; qwen3_gemv_set_variant for the benchmarks):
//   auto  a plain launch
//   pdl   programmatic dependent launch (sm_90): the CTAs are scheduled while the kernel before
//         drains and wait (griddepcontrol.wait) before reading x; they let the next PDL kernel be
//         scheduled right after.
//   pdl_early  pdl, with each thread's first stage of weight loads issued before the wait: the
//         weight never depends on the kernel before, so its first bytes arrive while that kernel
//         finishes (the ramp of every launch is what the small projections lose at batch 1).
//         Its contract is narrower: the weight must not be written by the kernel right before it
//         (a model's weights are not written during a step). Measured (decode_step.py, H200,
//         2026-11-30, fifth session): Qwen3-8B TP 1 step 4,176 us against 4,081 / 4,145 plain
//         (pdl 4,178), one TP-2 rank's shapes 2,275 against 2,316 / 2,384 plain. In the TP-2
//         engine (sixth session) 357.6 / 357.6 tok/s against 344.6 / 344.9 plain, so the engine's
//         decode graphs capture it under tensor parallelism (model_runner._graph_gemv_variant);
//         the process default stays the plain launch.
//   pdl_late   pdl, with the trigger (launch_dependents) after the CTA's last store instead of
//         right after the wait. Triggered at the start, the next kernel's CTAs are placed as soon
//         as all of ours have started, into whatever slots our first CTAs to finish free: when the
//         two grids together exceed the SMs' slots they pile up on those SMs, and the kernel waits
//         for its most loaded SM (counted for the decode_chain flow kernel: 0 to 9 CTAs an SM where
//         4 would be even; not counted for the GEMV, but the late trigger removes pdl's loss:
//         Qwen3-8B qkv back to back pdl 18.6 us, plain 14.6-14.8, pdl_late 14.1-14.3).
//         Triggered last, the next CTAs are placed on SMs that are all about empty, and still
//         before our grid has been torn down.
//   pdl_early_late  pdl_early's early weight loads with pdl_late's trigger. Measured (H200,
//         2026-12-02, seventeenth session, bench_engine.py --size 8B --batch1, alternating):
//         pdl_early_late 225.8 / 225.9, pdl_late 225.5 / 225.6, plain 220.0-220.2 decode tok/s;
//         the engine's one-GPU decode graphs capture pdl_early_late
//         (model_runner._graph_gemv_variant). Not yet measured under tensor parallelism.
// Measured (benchmarks/decode_step.py, H200, 2026-11-30, graph replay of a whole Qwen3-8B decode
// step at batch 1, two calls): pdl 2.6-3.0% slower than a plain launch at TP 1, 0.4-1.6% faster on
// one TP-2 rank's shapes, i.e. within that benchmark's noise; asking L2 for the first 16 / 64 KB
// of each CTA's rows before the wait lost 1-12%, and 8 loads per stage instead of 4 lost 6-11%
// (both removed). So the plain launch stays the default.
#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include "linear_configs.h"
#include "qwen3_kernels/launchers.h"
#include "qwen3_kernels/common.cuh"
#include "qwen3_kernels/tuning.cuh"

namespace qwen3_kernels::linear_detail {
namespace {

constexpr int kWarps = 4;                 // per CTA
constexpr int kThreads = 32 * kWarps;
constexpr int kLoadsPerStage = 4;         // 16-byte weight loads per thread per pipeline stage
constexpr int kSlice = 32 * 8;            // columns one warp covers with one 16-byte load per lane

// The launch (QWEN3_GEMV_VARIANT: a LaunchVariant, tuning.cuh) and the weight loads' L2 hint
// (QWEN3_GEMV_LOADS), both read at each launch.
constexpr const char* kVariantNames[kNumLaunchVariants] = {"auto", "pdl", "pdl_early", "pdl_late",
                                                           "pdl_early_late"};
enum Loads { kSectors, kL2Lines, kNumLoads };
constexpr const char* kLoadsNames[kNumLoads] = {"auto", "l2_256b"};

VariantKnob<kNumLaunchVariants>& knob() {
  static VariantKnob<kNumLaunchVariants> k("QWEN3_GEMV_VARIANT", kVariantNames);
  return k;
}
VariantKnob<kNumLoads>& loads_knob() {
  static VariantKnob<kNumLoads> k("QWEN3_GEMV_LOADS", kLoadsNames);
  return k;
}
// linear_silu_and_mul at one token (QWEN3_GEMV_SILU): auto = silu_cta_rows_kernel, warp_rows =
// gemv_kernel as at more tokens.
enum SiluLayout { kSiluCtaRows, kSiluWarpRows, kNumSiluLayouts };
constexpr const char* kSiluLayoutNames[kNumSiluLayouts] = {"auto", "warp_rows"};
VariantKnob<kNumSiluLayouts>& silu_knob() {
  static VariantKnob<kNumSiluLayouts> k("QWEN3_GEMV_SILU", kSiluLayoutNames);
  return k;
}

// One stage of weight loads: slice u of row r at columns kk + 256 u + 8 lane .. +7. Columns at or
// past k (only in the last stage; k % 8 == 0, so a lane's 8 columns are all in or all out) are not
// read.
template <bool kL2Lines, typename T, int R, int U>
__device__ __forceinline__ void load_stage(uint4 (&buf)[R][U], const T* const (&rows)[R], int kk,
                                           int lane_col, int k) {
#pragma unroll
  for (int u = 0; u < U; ++u) {
    const int col = kk + u * kSlice + lane_col;
#pragma unroll
    for (int r = 0; r < R; ++r) {
      buf[r][u] = col < k ? load_stream<kL2Lines>(rows[r] + col) : make_uint4(0, 0, 0, 0);
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
// kLaunch (LaunchVariant): with PDL nothing is read before the previous kernel has finished,
// except with kEarly the first stage of weight; kLate lets the next kernel in after our stores, not
// at once. kL2Lines: the weight loads ask L2 for 256-byte lines (Loads).
// kSilu (linear_silu_and_mul): w is [gate; up], n = 2 I rows, out is [m, I] = silu(g) * u. A warp
// owns P = R / 2 output columns j0 .. j0 + P - 1 and streams gate rows j0.. and up rows I + j0..,
// so both factors of an output meet in one warp's registers and the [m, 2 I] product is never
// written. Grid ceil(I / (4 P)).
// kPush (tp_gemv_push; one token, R even): lanes 1 .. world - 1 also store the warp's R outputs,
// R / 2 packets, into slot `rank` of the peers' receive buffers, flagged with the all-reduce's
// next call. The count is read after the PDL wait: the kernel before has finished, and with it
// every earlier all-reduce (each advanced the count before it finished).
template <typename T, int NT, int R, int kLaunch, bool kSilu, bool kPush, bool kL2Lines>
__global__ void __launch_bounds__(kThreads)
    gemv_kernel(T* __restrict__ out,        // [m, n], or [m, n / 2] (kSilu)
                const T* __restrict__ x,    // [m, k], m <= NT
                const T* __restrict__ w,    // [n, k]
                int m, int n, int k, PushTarget push) {
  constexpr bool kWithPdl = LaunchTraits<kLaunch>::kPdl;
  constexpr bool kEarly = LaunchTraits<kLaunch>::kEarly;
  constexpr bool kLate = LaunchTraits<kLaunch>::kLate;
  constexpr int U = kLoadsPerStage / R;  // slices per row per stage
  constexpr int kStep = U * kSlice;      // columns per stage
  constexpr int P = kSilu ? R / 2 : R;   // output columns per warp
  static_assert(NT * R <= 32, "one lane stores each (token, row) result");
  static_assert(!kSilu || R % 2 == 0, "kSilu pairs gate and up rows");
  static_assert(!kPush || (NT == 1 && !kSilu && R % 2 == 0 && R <= 4),
                "kPush: one token, whole packets of two outputs");

  if constexpr (kWithPdl && !kEarly) {
    pdl_wait();  // x may be the previous kernel's output, out its input
    if constexpr (!kLate) pdl_launch_dependents();
  }
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  const int n_out = kSilu ? n / 2 : n;
  const int j0 = (blockIdx.x * kWarps + warp) * P;  // first output column of this warp
  // weight row of the warp's r-th row
  auto row_of = [&](int r) { return kSilu && r >= P ? n_out + j0 + (r - P) : j0 + r; };
  // n_out % P == 0 (n % 8 == 0, P divides 4), so a warp's rows are all in range or all out of it.
  // No barrier follows, so the idle warps of the last CTA can leave.
  if (j0 >= n_out) return;
  const int lane_col = 8 * lane;

  const T* rows[R];
#pragma unroll
  for (int r = 0; r < R; ++r) rows[r] = w + static_cast<int64_t>(row_of(r)) * k;
  const T* xr[NT];
#pragma unroll
  for (int t = 0; t < NT; ++t) xr[t] = x + static_cast<int64_t>(min(t, m - 1)) * k + lane_col;

  float acc[NT][R];
#pragma unroll
  for (int t = 0; t < NT; ++t)
#pragma unroll
    for (int r = 0; r < R; ++r) acc[t][r] = 0.f;

  uint4 cur[R][U];
  load_stage<kL2Lines>(cur, rows, 0, lane_col, k);
  if constexpr (kWithPdl && kEarly) {
    pdl_wait();  // x may be the previous kernel's output, out its input; the weight is neither
    if constexpr (!kLate) pdl_launch_dependents();
  }
  for (int kk = 0; kk < k; kk += kStep) {
    // the next stage in flight while this one is multiplied
    uint4 nxt[R][U];
    load_stage<kL2Lines>(nxt, rows, kk + kStep, lane_col, k);
#pragma unroll
    for (int u = 0; u < U; ++u) {
      const int c = kk + u * kSlice;  // column of lane 0
      if (c + lane_col < k) {         // divergent only in the last stage
        float wf[R][8];
#pragma unroll
        for (int r = 0; r < R; ++r) to_float8<T>(cur[r][u], wf[r]);
#pragma unroll
        for (int t = 0; t < NT; ++t) {
          float xf[8];
          to_float8<T>(__ldg(reinterpret_cast<const uint4*>(xr[t] + c)), xf);
#pragma unroll
          for (int r = 0; r < R; ++r)
#pragma unroll
            for (int e = 0; e < 8; ++e) acc[t][r] = fmaf(wf[r][e], xf[e], acc[t][r]);
        }
      }
    }
#pragma unroll
    for (int r = 0; r < R; ++r)
#pragma unroll
      for (int u = 0; u < U; ++u) cur[r][u] = nxt[r][u];
  }

  // Every lane ends with every sum (xor butterfly); lane t P + r stores (token t, column j0 + r).
  [[maybe_unused]] T pushed[kPush ? R : 1];  // kPush: the outputs as stored, for the packets
#pragma unroll
  for (int t = 0; t < NT; ++t) {
#pragma unroll
    for (int r = 0; r < P; ++r) {
      float s = warp_sum(acc[t][r]);
      if constexpr (kSilu) {
        // g and u rounded to T first, as the unfused GEMM's output would be; then silu_and_mul's
        // math (fp32, one rounding)
        const float g = to_float(from_float<T>(s));
        const float u = to_float(from_float<T>(warp_sum(acc[t][P + r])));
        s = g / (1.0f + __expf(-g)) * u;
      }
      if (lane == t * P + r && t < m)
        out[static_cast<int64_t>(t) * n_out + j0 + r] = from_float<T>(s);
      if constexpr (kPush) pushed[r] = from_float<T>(s);
    }
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
  // kLate: the next PDL kernel is scheduled only once every CTA got here, so its CTAs find the
  // SMs nearly empty and spread evenly (triggered at the start, they take the slots our first
  // CTAs to finish free, piling up there).
  if constexpr (kWithPdl && kLate) pdl_launch_dependents();
}

template <typename T, int NT, int R, bool kSilu, bool kPush, bool kL2Lines>
cudaError_t launch_loads(const Problem& p, PushTarget push, int variant) {
  const int64_t cols_per_cta = static_cast<int64_t>(kWarps) * (kSilu ? R / 2 : R);
  const int64_t n_out = kSilu ? p.n / 2 : p.n;
  const dim3 grid(static_cast<unsigned>((n_out + cols_per_cta - 1) / cols_per_cta));
  T* out = static_cast<T*>(p.out);
  const T* x = static_cast<const T*>(p.x);
  const T* w = static_cast<const T*>(p.w);
  const int m = static_cast<int>(p.m), n = static_cast<int>(p.n), k = static_cast<int>(p.k);
  auto kernel_of = [](auto v) {
    return gemv_kernel<T, NT, R, decltype(v)::value, kSilu, kPush, kL2Lines>;
  };
  return launch_pdl_variant(kernel_of, variant, grid, dim3(kThreads), p.stream, out, x, w, m, n, k,
                            push);
}

template <typename T, int NT, int R, bool kSilu, bool kPush = false>
cudaError_t launch(const Problem& p, PushTarget push = {}) {
  const int variant = knob().get();
  return loads_knob().get() == kL2Lines ? launch_loads<T, NT, R, kSilu, kPush, true>(p, push, variant)
                                        : launch_loads<T, NT, R, kSilu, kPush, false>(p, push, variant);
}

// linear_silu_and_mul at one token, with the CTA reading whole rows in order ("cta rows"): CTA b
// owns the outputs j0 = 4 b .. 4 b + 3 and reads gate rows j0 .. j0 + 3 (32 KB contiguous at
// K = 4096), then up rows I + j0 .. (another 32 KB), each row front to back: load l of stage s of
// thread t is the row's 16 bytes at column 8 (512 s + 128 l + t), so a stage of the CTA is 8 KB
// contiguous of one row, and the next stage (of the same row or the next) is in flight while this
// one is multiplied. Each thread keeps one partial sum per row; one CTA reduction at the end.
// Against gemv_kernel's warp rows (a warp streams one gate and one up row, 512 bytes of each per
// load) the GPU's reads at any moment are fewer, longer runs of addresses: Qwen3-8B gate_up
// (24576 x 4096) 47.3 vs 49.6 us in benchmarks/read_probe.cu (H200, 2026-12-02, PDL launches).
// x ([1, k]) is read through L1 as in gemv_kernel. The launch variants and loads as gemv_kernel's.
constexpr int kCtaRowsOut = 4;                 // output columns a CTA
constexpr int kCtaRows = 2 * kCtaRowsOut;      // weight rows a CTA: its gate rows, then up rows

template <typename T, int kLaunch, bool kL2Lines>
__global__ void __launch_bounds__(kThreads)
    silu_cta_rows_kernel(T* __restrict__ out,      // [1, n / 2]
                         const T* __restrict__ x,  // [1, k]
                         const T* __restrict__ w,  // [n, k]: [gate; up]
                         int n, int k) {
  constexpr bool kWithPdl = LaunchTraits<kLaunch>::kPdl;
  constexpr bool kEarly = LaunchTraits<kLaunch>::kEarly;
  constexpr bool kLate = LaunchTraits<kLaunch>::kLate;
  constexpr int kStage = kLoadsPerStage * kThreads;  // 16-byte words of a row a stage
  if constexpr (kWithPdl && !kEarly) {
    pdl_wait();  // x may be the previous kernel's output, out its input
    if constexpr (!kLate) pdl_launch_dependents();
  }
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
      buf[l] = c < words ? load_stream<kL2Lines>(base + 8 * c) : make_uint4(0, 0, 0, 0);
    }
  };
  float acc[kCtaRows];
  uint4 cur[kLoadsPerStage];
  load(cur, 0, 0);
  if constexpr (kWithPdl && kEarly) {
    pdl_wait();  // x may be the previous kernel's output, out its input; the weight is neither
    if constexpr (!kLate) pdl_launch_dependents();
  }
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
  if constexpr (kWithPdl && kLate) pdl_launch_dependents();
}

template <typename T, bool kL2Lines>
cudaError_t launch_silu_cta_rows_loads(const Problem& p, int variant) {
  const dim3 grid(static_cast<unsigned>(p.n / 2 / kCtaRowsOut));
  T* out = static_cast<T*>(p.out);
  const T* x = static_cast<const T*>(p.x);
  const T* w = static_cast<const T*>(p.w);
  const int n = static_cast<int>(p.n), k = static_cast<int>(p.k);
  auto kernel_of = [](auto v) { return silu_cta_rows_kernel<T, decltype(v)::value, kL2Lines>; };
  return launch_pdl_variant(kernel_of, variant, grid, dim3(kThreads), p.stream, out, x, w, n, k);
}

template <typename T>
cudaError_t launch_silu_cta_rows(const Problem& p) {
  const int variant = knob().get();
  return loads_knob().get() == kL2Lines ? launch_silu_cta_rows_loads<T, true>(p, variant)
                                        : launch_silu_cta_rows_loads<T, false>(p, variant);
}

template <typename T, int NT, bool kSilu>
cudaError_t launch_for_rows(const Problem& p, int rows_per_warp) {
  switch (rows_per_warp) {
    case 1:
      if constexpr (!kSilu) return launch<T, NT, 1, false>(p);
      return cudaErrorNotSupported;  // kSilu needs a gate row and an up row per warp
    case 2:
      return launch<T, NT, 2, kSilu>(p);
    case 4:
      return launch<T, NT, 4, kSilu>(p);
  }
  return cudaErrorNotSupported;
}

template <typename T, bool kSilu>
cudaError_t launch_for_m(const Problem& p, int rows_per_warp) {
  if (p.m <= 1) return launch_for_rows<T, 1, kSilu>(p, rows_per_warp);
  if (p.m <= 2) return launch_for_rows<T, 2, kSilu>(p, rows_per_warp);
  if (p.m <= 4) return launch_for_rows<T, 4, kSilu>(p, rows_per_warp);
  return launch_for_rows<T, 8, kSilu>(p, rows_per_warp);
}

bool gemv_fits(const Problem& p) {
  return p.m >= 1 && p.m <= kGemvMaxM && p.n % 8 == 0 && p.k % 8 == 0 && p.n >= 8 && p.k >= 8 &&
         p.n <= (int64_t{1} << 30) && p.k <= (int64_t{1} << 30);
}

}  // namespace

int gemv_default_rows_per_warp(int64_t m, int64_t n) {
  // From 3 tokens on, 4 rows a warp halve the x loads and converts per FMA (unmeasured guess).
  if (m > 2) return 4;
  // At 1 token (bench_linear.py, H200, 2026-11-30, every projection of 0.6B / 8B / 8B TP 2 and
  // the QKV of every size): 2 rows a warp were fastest or within 1% everywhere except
  // N = 10240..12288 (32B QKV, 8B gate_up under TP 2: 4 rows 26 vs 28 us), where 4 rows still
  // leave 640..768 CTAs; below 8192 rows 4 rows a warp leave too few CTAs (8B down, N 4096:
  // 35 vs 27 us), and at N = 24576 (8B gate_up) 4 rows were slower again (54 vs 51 us).
  return (n >= 8192 && n <= 16384) ? 4 : 2;
}

cudaError_t gemv_gemm(const Problem& p, bool bf16, int rows_per_warp) {
  if (rows_per_warp == 0) rows_per_warp = gemv_default_rows_per_warp(p.m, p.n);
  if (!gemv_fits(p)) return cudaErrorNotSupported;
  return bf16 ? launch_for_m<__nv_bfloat16, false>(p, rows_per_warp)
              : launch_for_m<__half, false>(p, rows_per_warp);
}

cudaError_t gemv_silu_and_mul(const Problem& p, bool bf16, int rows_per_warp) {
  if (!gemv_fits(p)) return cudaErrorNotSupported;
  if (p.m == 1 && rows_per_warp == 0 && silu_knob().get() == kSiluCtaRows)
    return bf16 ? launch_silu_cta_rows<__nv_bfloat16>(p) : launch_silu_cta_rows<__half>(p);
  // rows per warp by the whole [2 I, K] weight, as for the unfused GEMV; at least one gate + up pair
  if (rows_per_warp == 0) rows_per_warp = gemv_default_rows_per_warp(p.m, p.n);
  if (rows_per_warp < 2) rows_per_warp = 2;
  if (!gemv_fits(p)) return cudaErrorNotSupported;
  return bf16 ? launch_for_m<__nv_bfloat16, true>(p, rows_per_warp)
              : launch_for_m<__half, true>(p, rows_per_warp);
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
  // 2 or 4 rows a warp (never 1 at one token): whole packets
  const bool four = gemv_default_rows_per_warp(1, n) == 4;
  if (dtype == DType::kBFloat16)
    return four ? launch<__nv_bfloat16, 1, 4, false, true>(p, push)
                : launch<__nv_bfloat16, 1, 2, false, true>(p, push);
  return four ? launch<__half, 1, 4, false, true>(p, push) : launch<__half, 1, 2, false, true>(p, push);
}

cudaError_t linear_silu_and_mul(void* out, const void* x, const void* w, int64_t m, int64_t two_i,
                                int64_t k, DType dtype, cudaStream_t stream) {
  if (dtype != DType::kBFloat16 && dtype != DType::kFloat16) return cudaErrorNotSupported;
  if (m > linear_silu_and_mul_max_tokens) return cudaErrorNotSupported;
  linear_detail::Problem p{};
  p.out = out;
  p.x = x;
  p.w = w;
  p.m = m;
  p.n = two_i;
  p.k = k;
  p.stream = stream;
  return linear_detail::gemv_silu_and_mul(p, dtype == DType::kBFloat16, 0);
}

}  // namespace qwen3_kernels

// ---- tuning hooks (C ABI, for the benchmarks) ---------------------------------------------------

// The launch variant of the following GEMV launches (QWEN3_GEMV_VARIANT), their weight loads' L2
// hint (QWEN3_GEMV_LOADS: auto = none, l2_256b = 256-byte lines) and linear_silu_and_mul's kernel
// at one token (QWEN3_GEMV_SILU: auto = cta rows, warp_rows = gemv_kernel).
QWEN3_TUNING_HOOKS(qwen3_gemv, qwen3_kernels::linear_detail::knob())
QWEN3_TUNING_HOOKS(qwen3_gemv_loads, qwen3_kernels::linear_detail::loads_knob())
QWEN3_TUNING_HOOKS(qwen3_gemv_silu, qwen3_kernels::linear_detail::silu_knob())
