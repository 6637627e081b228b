// linear launcher: picks one configuration by M (= tokens) and N * K (= weight size) from the
// measured table below and runs it.
//
//   out[M, N] = x[M, K] @ w[N, K]^T, bf16 / fp16 in and out, fp32 accumulate; Hopper (sm_90) only:
//   on any other device the launcher returns cudaErrorNotSupported (the binding then uses cuBLAS).
//
// Configurations (one TU each; see linear_configs.h):
//   splitk        hand-written weight-streaming split-K, K splits reduced in a cluster (M <= 64)
//   splitk_pf     the same kernel, also prefetching its weight into L2 two steps ahead of the loads
//   splitk_pdl    splitk_pf launched with programmatic dependent launch: the first steps' weight is
//                 prefetched into L2 while the previous kernel in the stream is still finishing
//   swap_128x64   CUTLASS, out^T = w @ x^T, tile 128 weight rows x 64 tokens
//   tile_128x128  CUTLASS, tile 128 tokens x 128 weight rows, 2x1 cluster
//   tile_128x256  CUTLASS, tile 128 tokens x 256 weight rows, 2x1 cluster
//   stream        hand-written weight-streaming wgmma kernel, 256 weight rows x all tokens a CTA,
//                 K splits reduced in a cluster (M <= 128; linear_stream.cu)
//   gemv          hand-written weight-streaming GEMV on the CUDA cores, a warp per 1 / 2 / 4 weight
//                 rows over the whole K, no split-K (M <= 8); the table's choice at M = 1
//   cublas        not ours: where cuBLAS measured faster, the table says so and the op runs
//                 cuBLAS (at::mm_out in the binding)
// The CUTLASS ones use the stream-K tile scheduler, so each also takes a decomposition at run
// time (data-parallel, split-K, stream-K or CUTLASS's heuristic).
//
// QWEN3_LINEAR_FORCE=<config>[:<mode>] overrides the table for every call (read per call, so a
// benchmark can compare configurations in one process): <mode> is heuristic | dp | streamk |
// split<S> for the CUTLASS configs, the split count S (1..8) for the splitk ones (without it,
// splitk_default_splits; for stream, the most whose clusters are all resident) and the weight rows per warp R (1, 2, 4) for gemv (without it,
// gemv_default_rows_per_warp). A forced config that cannot run the problem (splitk with M > 64,
// gemv with M > 8) makes the call fail with cudaErrorNotSupported.
#include <algorithm>
#include <atomic>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <limits>
#include <string>

#include "linear_configs.h"
#include "qwen3_kernels/launchers.h"

namespace qwen3_kernels {
namespace linear_detail {
namespace {

enum class Config {
  kSplitK, kSplitKPf, kSplitKPdl, kSwap128x64, kTile128x128, kTile128x256, kGemv, kStream,
  kCublas  // cuBLAS measured faster: the op runs at::mm_out (linear_prefers_cublas)
};

struct Choice {
  Config config;
  Decomposition decomposition;  // CUTLASS configs; kSplitK with splits > 0 also for splitk*
  int splits;                   // split-K factor (gemv: weight rows per warp); 0 = the default
};

// Short names for the table below.
constexpr Decomposition H = Decomposition::kHeuristic;
constexpr Decomposition DP = Decomposition::kDataParallel;
constexpr Decomposition SK = Decomposition::kStreamK;
constexpr Choice splitk(int s) { return {Config::kSplitK, Decomposition::kSplitK, s}; }
// Not in the table yet (unmeasured); here so that a measured win is a data edit.
[[maybe_unused]] constexpr Choice splitk_pf(int s) {
  return {Config::kSplitKPf, Decomposition::kSplitK, s};
}
[[maybe_unused]] constexpr Choice splitk_pdl(int s) {
  return {Config::kSplitKPdl, Decomposition::kSplitK, s};
}
constexpr Choice gemv(int rows_per_warp) {
  return {Config::kGemv, Decomposition::kSplitK, rows_per_warp};
}
constexpr Choice CB = {Config::kCublas, Decomposition::kHeuristic, 0};
[[maybe_unused]] constexpr Choice swap(Decomposition d) { return {Config::kSwap128x64, d, 0}; }
constexpr Choice t128(Decomposition d) { return {Config::kTile128x128, d, 0}; }
constexpr Choice t256(Decomposition d) { return {Config::kTile128x256, d, 0}; }

// The choice table: the configuration measured fastest for each (tokens, weight size) case.
// Measured on the H200, 2026-11-29, by benchmarks/bench_linear.py's configs sweep (bf16; every
// candidate on every Qwen3 QKV shape at T = 1, 8, 16, 32, 64, ..., 16384; its "fastest per case"
// list). The winner at the row's max_m covers every M between the previous row and it; a weight
// of N * K elements takes the first column whose bound it does not exceed, so each Qwen3 shape is
// its own column and other shapes take the next larger one. fp16 uses the bf16 choices.
// What the measurement showed:
//   - M = 1: the weight-streaming GEMV, rows per warp by N (gemv(0): gemv_default_rows_per_warp,
//     2, or 4 for N = 8192..16384 such as 32B), measured 2026-11-30
//     (bench_linear.py's gemv rows, RESULTS.md): 1.02-1.61x cuBLAS and 1.12-1.29x split-K on
//     every shape (8B: 14.7 us, 3.41 TB/s, vs cuBLAS 16.3 and split-K 16.7). At M = 3 and 8 it
//     lost to cuBLAS (0.67-1.08x), so split-K keeps M = 2..8.
//   - M <= 32: the hand-written split-K streams fastest with 4 splits (all CTAs resident at once,
//     clusters of 4); 32B (160 row blocks) with 2 or 3, since 4 x 160 CTAs need a second wave.
//     4 splits beat the old SM-count default (5 or 8 splits) by up to 27% (8B M=1: 16.6 vs
//     22.8 us).
//   - M = 33..128: CUTLASS with swapped operands (weight rows on the 128-wide side); splitk only
//     for the two small shapes, the 128x128 tile at M = 128 for 0.6B.
//   - M = 129..1024: 128x128 tiles mostly, swapped tiles for the small / mid shapes where measured
//     faster; 128x256 from M = 1024 on the small shapes, from M = 2048..16384 on the larger ones.
//   - Among stream-K modes, ties (< 1%) were common; where dp or streamk lost it lost by up to 25%
//     (e.g. 32B M = 256: dp 61.3 us vs heuristic 48.5 us), so the printed winner is taken as is.
// Then (2026-11-30, bench_linear.py -k vs_cublas at 520a9b7, RESULTS.md) each cell's winner ran
// against cuBLAS (torch.matmul) on the same inputs, and where cuBLAS was faster the cell now says
// CB: the op runs cuBLAS there (issue 7: "where cuBLAS wins, cuBLAS runs"). Our configuration
// stayed where it measured >= 1.0x: the GEMV at M = 1 (1.02-1.61x), split-K at M = 2..8 for 14B
// (1.06x), the 128x128 tile at M = 1024 for 14B / 32B (1.12x / 1.02x) and at M = 2048 for 4B / 8B
// (1.03x / 1.12x), the 128x256 tile at M = 16384 for 0.6B / 8B (1.00x / 1.01x). The cells' own
// winners listed above still run with QWEN3_LINEAR_FORCE, which is how the sweep times them.
// "stream" (2026-11-30, tenth session, bench_linear.py -k stream_vs, RESULTS.md) is in no cell:
// on Qwen3-8B it beat cuBLAS(Lt) alone on o at T <= 32 (1.09-1.13x) and down at T = 16..96
// (1.02-1.04x), lost on qkv (0.93-0.98x) and at T = 128 (0.78-0.98x), and routed through
// QWEN3_STREAM_MAX_M it did not speed up the 8B workload.
constexpr int kWeightColumns = 6;
constexpr int64_t kMaxWeight[kWeightColumns] = {
    4096LL * 1024,                         // 0.6B  N=4096  K=1024
    4096LL * 2048,                         // 1.7B  N=4096  K=2048
    6144LL * 2560,                         // 4B    N=6144  K=2560
    6144LL * 4096,                         // 8B    N=6144  K=4096
    7168LL * 5120,                         // 14B   N=7168  K=5120
    std::numeric_limits<int64_t>::max(),   // 32B   N=10240 K=5120, and anything larger
};

struct Row {
  int64_t max_m;                  // tokens up to which this row applies
  Choice by_weight[kWeightColumns];
};

constexpr Row kTable[] = {
    //            0.6B       1.7B       4B         8B         14B        32B
    {1,        {gemv(0),   gemv(0),   gemv(0),   gemv(0),   gemv(0),   gemv(0)}},
    {8,        {CB,        CB,        CB,        CB,        splitk(4), CB}},
    {16,       {CB,        CB,        CB,        CB,        CB,        CB}},
    {32,       {CB,        CB,        CB,        CB,        CB,        CB}},
    {64,       {CB,        CB,        CB,        CB,        CB,        CB}},
    {128,      {CB,        CB,        CB,        CB,        CB,        CB}},
    {256,      {CB,        CB,        CB,        CB,        CB,        CB}},
    {512,      {CB,        CB,        CB,        CB,        CB,        CB}},
    {1024,     {CB,        CB,        CB,        CB,        t128(H),   t128(H)}},
    {2048,     {CB,        CB,        t128(H),   t128(H),   CB,        CB}},
    {4096,     {CB,        CB,        CB,        CB,        CB,        CB}},
    {std::numeric_limits<int64_t>::max(),  // measured at 16384
               {t256(DP),  CB,        CB,        t256(SK),  CB,        CB}},
};

Choice choose_from_table(int64_t m, int64_t n, int64_t k) {
  const int64_t weight = n * k;
  int col = 0;
  while (col < kWeightColumns - 1 && weight > kMaxWeight[col]) ++col;
  for (const Row& r : kTable) {
    if (m <= r.max_m) return r.by_weight[col];
  }
  return kTable[sizeof(kTable) / sizeof(kTable[0]) - 1].by_weight[col];
}

bool is_splitk(Config c) {
  return c == Config::kSplitK || c == Config::kSplitKPf || c == Config::kSplitKPdl;
}

bool parse_mode(const std::string& mode, Choice& c) {
  if (mode.empty() || mode == "heuristic") {
    c.decomposition = Decomposition::kHeuristic;
  } else if (mode == "dp") {
    c.decomposition = Decomposition::kDataParallel;
  } else if (mode == "streamk") {
    c.decomposition = Decomposition::kStreamK;
  } else if (mode.rfind("split", 0) == 0 || (mode[0] >= '0' && mode[0] <= '9')) {
    const char* digits = mode.c_str() + (mode[0] == 's' ? 5 : 0);
    char* end = nullptr;
    long s = std::strtol(digits, &end, 10);
    if (end == digits || *end != '\0' || s < 1 || s > 64) return false;
    c.decomposition = Decomposition::kSplitK;
    c.splits = static_cast<int>(s);
  } else {
    return false;
  }
  return true;
}

// The table's choice, or QWEN3_LINEAR_FORCE's. A malformed override is reported once and ignored.
// QWEN3_STREAM_MAX_M=T (an experiment, read once; 0 = off): the wgmma streaming kernel for 2..T
// tokens on weights of at most QWEN3_STREAM_MAX_N rows (default 8192), ahead of the table.
int env_int(const char* name, int fallback) {
  const char* s = std::getenv(name);
  if (s == nullptr || *s == '\0') return fallback;
  char* end = nullptr;
  const long v = std::strtol(s, &end, 10);
  return end != s && *end == '\0' && v >= 0 && v <= (1L << 30) ? static_cast<int>(v) : fallback;
}

Choice choose(int64_t m, int64_t n, int64_t k) {
  Choice c = choose_from_table(m, n, k);
  static const int stream_max_m = std::min(env_int("QWEN3_STREAM_MAX_M", 0), kStreamMaxM);
  static const int stream_max_n = env_int("QWEN3_STREAM_MAX_N", 8192);
  if (m >= 2 && m <= stream_max_m && n <= stream_max_n) {
    c = Choice{Config::kStream, Decomposition::kHeuristic, 0};
  }
  const char* env = std::getenv("QWEN3_LINEAR_FORCE");
  if (env == nullptr || env[0] == '\0' || std::strcmp(env, "auto") == 0) return c;
  const std::string s(env);
  const size_t colon = s.find(':');
  const std::string name = s.substr(0, colon);
  const std::string mode = colon == std::string::npos ? "" : s.substr(colon + 1);
  Choice f{Config::kSplitK, Decomposition::kHeuristic, 0};
  bool ok = true;
  if (name == "splitk") {
    f.config = Config::kSplitK;
  } else if (name == "splitk_pf") {
    f.config = Config::kSplitKPf;
  } else if (name == "splitk_pdl") {
    f.config = Config::kSplitKPdl;
  } else if (name == "swap_128x64") {
    f.config = Config::kSwap128x64;
  } else if (name == "tile_128x128") {
    f.config = Config::kTile128x128;
  } else if (name == "tile_128x256") {
    f.config = Config::kTile128x256;
  } else if (name == "gemv") {
    f.config = Config::kGemv;
  } else if (name == "stream") {
    f.config = Config::kStream;
  } else if (name == "cublas") {
    f.config = Config::kCublas;
  } else {
    ok = false;
  }
  ok = ok && parse_mode(mode, f);
  if (ok && f.config == Config::kCublas && !mode.empty()) ok = false;  // cuBLAS takes no mode
  if (ok && (is_splitk(f.config) || f.config == Config::kStream) && f.decomposition != Decomposition::kHeuristic &&
      f.decomposition != Decomposition::kSplitK) {
    ok = false;  // the splitk kernels take a split count only
  }
  if (ok && f.config == Config::kGemv &&
      !(f.decomposition == Decomposition::kHeuristic ||
        (f.decomposition == Decomposition::kSplitK &&
         (f.splits == 1 || f.splits == 2 || f.splits == 4)))) {
    ok = false;  // gemv takes rows per warp only: 1, 2 or 4
  }
  if (!ok) {
    static std::atomic<bool> warned{false};
    if (!warned.exchange(true)) {
      std::fprintf(stderr,
                   "qwen3_kernels.linear: ignoring QWEN3_LINEAR_FORCE=%s (expected auto or "
                   "cublas | splitk[:S] | splitk_pf[:S] | splitk_pdl[:S] | stream[:S] | gemv[:1|2|4] | "
                   "swap_128x64 | "
                   "tile_128x128 | tile_128x256 [:heuristic|dp|streamk|split<S>])\n",
                   env);
    }
    return c;
  }
  return f;
}

constexpr int kMaxDevices = 64;
std::atomic<int> g_compute_capability[kMaxDevices];  // major * 10 + minor; 0 = not yet queried
std::atomic<int> g_sm_count[kMaxDevices];

// Queried once per device: the launcher runs on every decode step.
cudaError_t device_info(int* device, int* cc, int* sm_count) {
  cudaError_t err = cudaGetDevice(device);
  if (err != cudaSuccess) return err;
  if (*device < 0 || *device >= kMaxDevices) return cudaErrorInvalidDevice;
  int c = g_compute_capability[*device].load(std::memory_order_relaxed);
  int s = g_sm_count[*device].load(std::memory_order_relaxed);
  if (c == 0 || s == 0) {
    int major = 0, minor = 0;
    if ((err = cudaDeviceGetAttribute(&major, cudaDevAttrComputeCapabilityMajor, *device)) ||
        (err = cudaDeviceGetAttribute(&minor, cudaDevAttrComputeCapabilityMinor, *device)) ||
        (err = cudaDeviceGetAttribute(&s, cudaDevAttrMultiProcessorCount, *device))) {
      return err;
    }
    c = major * 10 + minor;
    g_sm_count[*device].store(s, std::memory_order_relaxed);
    g_compute_capability[*device].store(c, std::memory_order_relaxed);
  }
  *cc = c;
  *sm_count = s;
  return cudaSuccess;
}

// Fills everything but the buffers; returns cudaErrorNotSupported off Hopper.
cudaError_t make_problem(int64_t m, int64_t n, int64_t k, Problem& p, Choice& c) {
  int device = 0, cc = 0, sms = 0;
  cudaError_t err = device_info(&device, &cc, &sms);
  if (err != cudaSuccess) return err;
  // sm_90a code (wgmma, TMA, clusters) runs on compute capability 9.0 exactly.
  if (cc != 90) return cudaErrorNotSupported;
  if (m < 1 || n < 8 || k < 8 || n % 8 != 0 || k % 8 != 0 ||
      m > std::numeric_limits<int>::max() || n > std::numeric_limits<int>::max() ||
      k > std::numeric_limits<int>::max()) {
    return cudaErrorInvalidValue;
  }
  c = choose(m, n, k);
  p = Problem{};
  p.m = m;
  p.n = n;
  p.k = k;
  p.device = device;
  p.sm_count = sms;
  p.decomposition = c.decomposition;
  p.splits = c.splits;
  return cudaSuccess;
}

size_t cutlass_workspace(Config config, bool bf16, const Problem& p) {
  switch (config) {
    case Config::kSwap128x64:
      return bf16 ? sm90_swap_128x64_bf16_workspace(p) : sm90_swap_128x64_fp16_workspace(p);
    case Config::kTile128x128:
      return bf16 ? sm90_tile_128x128_bf16_workspace(p) : sm90_tile_128x128_fp16_workspace(p);
    case Config::kTile128x256:
      return bf16 ? sm90_tile_128x256_bf16_workspace(p) : sm90_tile_128x256_fp16_workspace(p);
    default:
      return 0;
  }
}

cudaError_t run(Config config, bool bf16, const Problem& p) {
  const int splits = p.decomposition == Decomposition::kSplitK && p.splits > 0
                         ? p.splits
                         : splitk_default_splits(p.m, p.n, p.k, p.sm_count);
  switch (config) {
    case Config::kSplitK:
      return splitk_gemm(p, bf16, splits, SplitKVariant::kRound2);
    case Config::kSplitKPf:
      return splitk_gemm(p, bf16, splits, SplitKVariant::kPrefetch);
    case Config::kSplitKPdl:
      return splitk_gemm(p, bf16, splits, SplitKVariant::kPrefetchPdl);
    case Config::kSwap128x64:
      return bf16 ? sm90_swap_128x64_bf16(p) : sm90_swap_128x64_fp16(p);
    case Config::kTile128x128:
      return bf16 ? sm90_tile_128x128_bf16(p) : sm90_tile_128x128_fp16(p);
    case Config::kTile128x256:
      return bf16 ? sm90_tile_128x256_bf16(p) : sm90_tile_128x256_fp16(p);
    case Config::kGemv:
      return gemv_gemm(p, bf16, p.decomposition == Decomposition::kSplitK ? p.splits : 0);
    case Config::kStream:
      return stream_gemm(p, bf16, p.decomposition == Decomposition::kSplitK ? p.splits : 0);
    case Config::kCublas:  // the caller runs cuBLAS (it asks linear_prefers_cublas first)
      return cudaErrorNotSupported;
  }
  return cudaErrorNotSupported;
}

}  // namespace
}  // namespace linear_detail

bool linear_prefers_cublas(int64_t m, int64_t n, int64_t k) {
  return linear_detail::choose(m, n, k).config == linear_detail::Config::kCublas;
}

size_t linear_workspace_size(int64_t m, int64_t n, int64_t k, DType dtype) {
  linear_detail::Problem p;
  linear_detail::Choice c;
  if (linear_detail::make_problem(m, n, k, p, c) != cudaSuccess) return 0;
  return linear_detail::cutlass_workspace(c.config, dtype == DType::kBFloat16, p);
}

cudaError_t linear(void* out, const void* x, const void* w, int64_t m, int64_t n, int64_t k,
                     void* workspace, size_t workspace_bytes, DType dtype, cudaStream_t stream) {
  linear_detail::Problem p;
  linear_detail::Choice c;
  cudaError_t err = linear_detail::make_problem(m, n, k, p, c);
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
