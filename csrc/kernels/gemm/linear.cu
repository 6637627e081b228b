// linear: out[M, N] = x[M, K] @ w[N, K]^T, bf16 / fp16 in and out, fp32 accumulate. The one place
// that picks the kernel of a projection: the GEMV, a CUTLASS / hand-written configuration, or
// cuBLAS (run by the binding, at::mm_out), from the shape (choose() below).
//
// batch_invariant (the deterministic mode): CUTLASS tiles run data-parallel only (each output
// tile's whole K loop in one CTA, k16 wgmma steps in order from k = 0, no split-K or stream-K), so
// an output's sum is the same chain of the same instruction whatever M is, and every such tile
// gives the same bits (tests/test_batch_invariant_ops.py checks it at every shape). Which tile
// then only decides the speed, so choose_invariant picks it by (M, N) from a measurement (below).
// sm_90 only; elsewhere the launcher refuses (cuBLAS picks its kernel, split-K included, by M).
//
// The rule (Hopper, sm_90; any other GPU runs cuBLAS):
//   - M == 1: the weight-streaming GEMV (linear_gemv.cu) for every shape. bench_linear.py's gemv
//     rows (H200): 1.02-1.61x cuBLAS and 1.12-1.29x split-K on every Qwen3 QKV shape (8B: 14.7
//     us, 3.41 TB/s, vs cuBLAS 16.3 and split-K 16.7), and 1.00-2.61x cuBLAS on the other
//     projections of 0.6B, 8B and 8B under TP 2 (o, gate_up, down, LM head) but for 8B gate_up
//     (0.98x).
//   - (N, K) one of the six Qwen3 QKV shapes the table below was measured on: that column's cell.
//   - Any other shape: cuBLAS. The engine's o / gate_up / down / LM head projections, whose shapes
//     the table was not measured on, ran cuBLAS above one token before too. The QKV projection
//     under tensor parallelism (a rank's N is a fraction of the table's) used to take the next
//     larger column of the table; its shapes were never measured, so it now runs cuBLAS. No other
//     Qwen3 projection has one of the six (N, K).
//
// The table: measured on the H200 by the configs sweep of benchmarks/bench_qkv_gemm.py (bf16;
// every configuration on every Qwen3 QKV shape at T = 1, 8, 16, 32, 64, ..., 16384), then each
// cell's winner against cuBLAS (torch.matmul) on the same inputs (the sweep, which forced each
// configuration, is on branch experiment/kernel-launch-variants); where cuBLAS was faster the
// cell says CB. Ours stayed where it measured >= 1.0x: split-K at M = 2..8 for 14B (1.06x), the
// 128x128 tile at M = 1024 for 14B / 32B (1.12x / 1.02x) and at M = 2048 for 4B / 8B (1.03x /
// 1.12x), the 128x256 tile at M = 16384 for 0.6B / 8B (1.00x / 1.01x). fp16 uses the bf16 cells.
// The winner at a row's max_m covers every M between the previous row and it.
// Configurations no cell picks are kept on branch experiment/kernel-launch-variants (CUTLASS
// swap_128x64: won M = 33..128 against our other kernels but lost to cuBLAS; split-K with an L2
// prefetch / PDL: unmeasured) and experiment/qkv-gemm-stream (a wgmma weight-streaming kernel:
// 1.09-1.13x cuBLAS on Qwen3-8B o at T <= 32 and 1.02-1.04x on down at T = 16..96, 0.93-0.98x on
// qkv and 0.78-0.98x at T = 128; routed to T <= 64 it did not speed up the 8B workload, 9,752 vs
// 9,758 tok/s).
#include <cstdint>
#include <limits>

#include "linear_configs.h"
#include "qwen3_kernels/launch.cuh"  // current_device_info
#include "qwen3_kernels/launchers.h"

namespace qwen3_kernels {
namespace linear_detail {
namespace {

enum class Config {
  kGemv, kSplitK, kTile128x128, kTile128x256,
  kSwap64x16, kSwap64x32, kSwap64x64, kSwap64x128, kSwap128x64, kSwap128x96, kSwap128x128,
  kSwap128x192,  // batch-invariant
  kCublas,  // cuBLAS measured faster: the binding runs at::mm_out (linear_prefers_cublas)
  kUnsupported  // batch-invariant on a GPU without the sm_90 kernels
};

struct Choice {
  Config config;
  Decomposition decomposition;  // the CUTLASS configs' stream-K decomposition
  int splits;                   // split-K factor (kSplitK)
};

// Short names for the table below.
constexpr Decomposition H = Decomposition::kHeuristic;
constexpr Decomposition DP = Decomposition::kDataParallel;
constexpr Decomposition SK = Decomposition::kStreamK;
constexpr Choice CB = {Config::kCublas, H, 0};
constexpr Choice GEMV = {Config::kGemv, H, 0};
constexpr Choice splitk(int s) { return {Config::kSplitK, Decomposition::kSplitK, s}; }
constexpr Choice t128(Decomposition d) { return {Config::kTile128x128, d, 0}; }
constexpr Choice t256(Decomposition d) { return {Config::kTile128x256, d, 0}; }

struct Shape {
  int64_t n, k;
};
constexpr int kQkvShapes = 6;
constexpr Shape kQkv[kQkvShapes] = {
    {4096, 1024},   // 0.6B
    {4096, 2048},   // 1.7B
    {6144, 2560},   // 4B
    {6144, 4096},   // 8B
    {7168, 5120},   // 14B
    {10240, 5120},  // 32B
};

struct Row {
  int64_t max_m;  // tokens up to which this row applies
  Choice by_shape[kQkvShapes];
};

constexpr Row kTable[] = {
    //            0.6B       1.7B       4B         8B         14B        32B
    {8,        {CB,        CB,        CB,        CB,        splitk(4), CB}},
    {512,      {CB,        CB,        CB,        CB,        CB,        CB}},
    {1024,     {CB,        CB,        CB,        CB,        t128(H),   t128(H)}},
    {2048,     {CB,        CB,        t128(H),   t128(H),   CB,        CB}},
    {4096,     {CB,        CB,        CB,        CB,        CB,        CB}},
    {std::numeric_limits<int64_t>::max(),  // measured at 16384
               {t256(DP),  CB,        CB,        t256(SK),  CB,        CB}},
};

constexpr Choice dp(Config c) { return {c, DP, 0}; }

// batch_invariant: the fastest data-parallel tile by (M, N), from benchmarks/probe_bi.py on branch
// experiment/bi-shapes (H200, bf16, Qwen3-8B's projections: QKV N 6144, o 4096, gate_up 24576,
// down 4096 with K 12288, LM head 151936; at M = 1..64, and 64..2048 in steps of the decode
// graphs' buckets). Swapping puts the weight rows on the 64- or 128-row side of the tile, so few
// tokens neither pad a 128-row tile nor leave too few CTAs to stream the weight; tiles whose
// token side has rows past M (out of bounds for TMA) cost up to 2x at the same M. Mode time /
// automatic choice's at M = 1 (the GEMV): 1.09 / 1.14 / 1.06 / 1.07 / 1.04 (QKV / o / gate_up /
// down / LM head); the range over the five at M = 32: 0.85-1.02; 64: 0.86-1.08; 128: 0.97-1.11;
// 256: 0.87-1.13; 512: 0.95-1.18; 1024: 0.95-1.05; 2048: 0.94-1.07.
// Lost to the swap 64x16 tile at M <= 8 (branch experiment/gemv-invariant): the same chain of k16
// steps on mma.sync (one warp per 16 weight rows, N / 16 CTAs, TMA boxes of 16 rows x 256
// columns; bit-identical to these tiles, since mma.sync m16n8k16 and a wgmma k16 step give the
// same fp32 bits, H200 probe). H200, CUDA-graph replays, us at M = 1 against swap 64x16: qkv 16.10
// / 16.04, o 11.66 / 11.34, gate_up 55.34 / 50.98, down 29.00 / 27.55, LM head 302.0 / 287.8;
// Qwen3-8B batch 1 in the mode 212.1-212.2 decode tok/s (default 241.3-241.4, same call).
// At 129..384 tokens (the throughput schedule's decode steps of <= 176 sequences and its mixed
// steps of 384 tokens) from benchmarks/linear_bi_ab (H200, every tile data-parallel, all
// bit-identical to swap 64x16): swap 128x96 (M = 176 in two token tiles) on QKV / gate_up at
// 129..192, swap 128x192 on the LM head there and on QKV / gate_up / LM head at 257..384, swap
// 128x96 on o / down at 257..384. us at M = 176, the tile before -> this one: QKV 31.6 -> 21.9
// (tile 128x128), gate_up 91.7 -> 64.8 (tile 128x256), LM head 418.0 -> 357.8; at M = 384 (swap
// 128x64 / 128x128 before): QKV 42.4 -> 35.1, o 24.9 -> 21.0, gate_up 119.1 -> 106.4, down 64.0
// -> 55.0. The mode's Qwen3-8B workload 8,513 / 8,503 against 8,036 / 8,018 output tok/s (H100,
// alternating; the default mode 8,941 in the same call: 0.95x).
// At M <= 16 the swap 64x16 tile streams K in steps of 256 (its TU says why): the mode's Qwen3-8B
// batch 1 171.7 / 171.7 against 170.1 / 170.1 decode tok/s with steps of 128 (H100, alternating;
// the default mode 177.0 in the same call: 0.97x).
constexpr Choice choose_invariant(int64_t m, int64_t n, int64_t k) {
  const bool lm_head = n >= 65536;  // the vocabulary
  const bool wide = n > 8192;       // gate_up; QKV, o and down are at most 8192 wide
  if (m <= 16) return dp(Config::kSwap64x16);
  if (m <= 32) return dp(Config::kSwap64x32);
  if (m <= 64) return dp(Config::kSwap64x64);
  if (m <= 128)
    return dp(lm_head ? Config::kSwap128x128 : wide ? Config::kSwap128x64 : Config::kSwap64x128);
  if (m <= 192) {
    if (lm_head) return dp(Config::kSwap128x192);
    return dp(n > 4096 ? Config::kSwap128x96 : Config::kSwap128x64);
  }
  if (m <= 256) {
    if (lm_head) return t256(DP);
    return n > 4096 ? t128(DP) : dp(Config::kSwap128x64);
  }
  if (m <= 384) return dp(n > 4096 ? Config::kSwap128x192 : Config::kSwap128x96);
  if (m <= 512) return dp(n > 4096 && !wide ? Config::kSwap128x64 : Config::kSwap128x128);
  return wide || k > 8192 ? t256(DP) : t128(DP);
}

constexpr Choice kUnsupported = {Config::kUnsupported, H, 0};

// The rule at the top of the file. cc: the device's compute capability (major * 10 + minor).
Choice choose(int64_t m, int64_t n, int64_t k, int cc, bool batch_invariant) {
  if (cc != 90) return batch_invariant ? kUnsupported : CB;  // sm_90a code runs on 9.0 exactly
  if (batch_invariant) return choose_invariant(m, n, k);
  if (m == 1) return GEMV;
  for (int col = 0; col < kQkvShapes; ++col) {
    if (kQkv[col].n != n || kQkv[col].k != k) continue;
    for (const Row& r : kTable) {
      if (m <= r.max_m) return r.by_shape[col];
    }
  }
  return CB;
}

int compute_capability() {
  const DeviceInfo d = current_device_info();
  return d.cc_major * 10 + d.cc_minor;
}

// Fills everything but the buffers.
cudaError_t make_problem(int64_t m, int64_t n, int64_t k, bool batch_invariant, Problem& p,
                         Choice& c) {
  if (m < 1 || n < 8 || k < 8 || n % 8 != 0 || k % 8 != 0 ||
      m > std::numeric_limits<int>::max() || n > std::numeric_limits<int>::max() ||
      k > std::numeric_limits<int>::max()) {
    return cudaErrorInvalidValue;
  }
  const DeviceInfo d = current_device_info();
  c = choose(m, n, k, d.cc_major * 10 + d.cc_minor, batch_invariant);
  if (c.config == Config::kCublas || c.config == Config::kUnsupported)
    return cudaErrorNotSupported;
  int device = 0;
  const cudaError_t err = cudaGetDevice(&device);
  if (err != cudaSuccess) return err;
  p = Problem{};
  p.m = m;
  p.n = n;
  p.k = k;
  p.device = device;
  p.sm_count = d.num_sms;
  p.decomposition = c.decomposition;
  p.splits = c.splits;
  return cudaSuccess;
}

size_t cutlass_workspace(Config config, bool bf16, const Problem& p) {
  switch (config) {
    case Config::kTile128x128:
      return bf16 ? sm90_tile_128x128_bf16_workspace(p) : sm90_tile_128x128_fp16_workspace(p);
    case Config::kTile128x256:
      return bf16 ? sm90_tile_128x256_bf16_workspace(p) : sm90_tile_128x256_fp16_workspace(p);
#define QWEN3_LINEAR_WORKSPACE(CONFIG, NAME) \
    case Config::CONFIG:                      \
      return bf16 ? sm90_##NAME##_bf16_workspace(p) : sm90_##NAME##_fp16_workspace(p);
    QWEN3_LINEAR_WORKSPACE(kSwap64x16, swap_64x16)
    QWEN3_LINEAR_WORKSPACE(kSwap64x32, swap_64x32)
    QWEN3_LINEAR_WORKSPACE(kSwap64x64, swap_64x64)
    QWEN3_LINEAR_WORKSPACE(kSwap64x128, swap_64x128)
    QWEN3_LINEAR_WORKSPACE(kSwap128x64, swap_128x64)
    QWEN3_LINEAR_WORKSPACE(kSwap128x96, swap_128x96)
    QWEN3_LINEAR_WORKSPACE(kSwap128x128, swap_128x128)
    QWEN3_LINEAR_WORKSPACE(kSwap128x192, swap_128x192)
#undef QWEN3_LINEAR_WORKSPACE
    default:
      return 0;
  }
}

cudaError_t run(Config config, bool bf16, const Problem& p) {
  switch (config) {
    case Config::kGemv:
      return gemv_gemm(p, bf16);
    case Config::kSplitK:
      return splitk_gemm(p, bf16, p.splits);
    case Config::kTile128x128:
      return bf16 ? sm90_tile_128x128_bf16(p) : sm90_tile_128x128_fp16(p);
    case Config::kTile128x256:
      return bf16 ? sm90_tile_128x256_bf16(p) : sm90_tile_128x256_fp16(p);
#define QWEN3_LINEAR_RUN(CONFIG, NAME) \
    case Config::CONFIG:                \
      return bf16 ? sm90_##NAME##_bf16(p) : sm90_##NAME##_fp16(p);
    QWEN3_LINEAR_RUN(kSwap64x16, swap_64x16)
    QWEN3_LINEAR_RUN(kSwap64x32, swap_64x32)
    QWEN3_LINEAR_RUN(kSwap64x64, swap_64x64)
    QWEN3_LINEAR_RUN(kSwap64x128, swap_64x128)
    QWEN3_LINEAR_RUN(kSwap128x64, swap_128x64)
    QWEN3_LINEAR_RUN(kSwap128x96, swap_128x96)
    QWEN3_LINEAR_RUN(kSwap128x128, swap_128x128)
    QWEN3_LINEAR_RUN(kSwap128x192, swap_128x192)
#undef QWEN3_LINEAR_RUN
    case Config::kCublas:  // the caller runs cuBLAS (it asks linear_prefers_cublas first)
    case Config::kUnsupported:
      return cudaErrorNotSupported;
  }
  return cudaErrorNotSupported;
}

}  // namespace
}  // namespace linear_detail

bool linear_prefers_cublas(int64_t m, int64_t n, int64_t k, bool batch_invariant) {
  return linear_detail::choose(m, n, k, linear_detail::compute_capability(), batch_invariant)
             .config == linear_detail::Config::kCublas;
}

size_t linear_workspace_size(int64_t m, int64_t n, int64_t k, bool batch_invariant,
                             DType dtype) {
  linear_detail::Problem p;
  linear_detail::Choice c;
  if (linear_detail::make_problem(m, n, k, batch_invariant, p, c) != cudaSuccess) return 0;
  return linear_detail::cutlass_workspace(c.config, dtype == DType::kBFloat16, p);
}

cudaError_t linear(void* out, const void* x, const void* w, int64_t m, int64_t n, int64_t k,
                   void* workspace, size_t workspace_bytes, bool batch_invariant, DType dtype,
                   cudaStream_t stream) {
  linear_detail::Problem p;
  linear_detail::Choice c;
  cudaError_t err = linear_detail::make_problem(m, n, k, batch_invariant, p, c);
  if (err != cudaSuccess) return err;
  // TMA and the 16-byte loads need 16-byte aligned bases (rows are, since K, N % 8 == 0).
  for (const void* ptr : {static_cast<const void*>(out), x, w}) {
    if (reinterpret_cast<uintptr_t>(ptr) % 16 != 0) return cudaErrorMisalignedAddress;
  }
  p.out = out;
  p.x = x;
  p.w = w;
  p.workspace = workspace;
  p.workspace_bytes = workspace_bytes;
  p.stream = stream;
  return linear_detail::run(c.config, dtype == DType::kBFloat16, p);
}

}  // namespace qwen3_kernels
