// qkv_gemm launcher: picks one configuration by M (= tokens) from the table below and runs it.
//
//   out[M, N] = x[M, K] @ w[N, K]^T, bf16 / fp16 in and out, fp32 accumulate; Hopper (sm_90) only:
//   on any other device the launcher returns cudaErrorNotSupported (the binding then uses cuBLAS).
//
// Configurations (one TU each; see qkv_gemm_configs.h):
//   splitk        hand-written weight-streaming split-K, K splits reduced in a cluster (M <= 64)
//   swap_128x64   CUTLASS, out^T = w @ x^T, tile 128 weight rows x 64 tokens (M <= 64)
//   tile_128x128  CUTLASS, tile 128 tokens x 128 weight rows, 2x1 cluster
//   tile_128x256  CUTLASS, tile 128 tokens x 256 weight rows, 2x1 cluster
// The CUTLASS ones use the stream-K tile scheduler, so each also takes a decomposition at run
// time (data-parallel, split-K, stream-K or CUTLASS's heuristic).
//
// QWEN3_QKV_GEMM_FORCE=<config>[:<mode>] overrides the table for every call (read per call, so a
// benchmark can compare configurations in one process): <mode> is heuristic | dp | streamk |
// split<S> for the CUTLASS configs and the split count S (1..8) for splitk. A forced config that
// cannot run the problem (splitk with M > 64) makes the call fail with cudaErrorNotSupported.
#include <atomic>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <limits>
#include <string>

#include "qkv_gemm_configs.h"
#include "qwen3_kernels/launchers.h"

namespace qwen3_kernels {
namespace qkv_gemm_detail {
namespace {

enum class Config { kSplitK, kSwap128x64, kTile128x128, kTile128x256 };

struct Choice {
  int64_t max_m;                // rows of x (tokens) up to which this entry applies
  Config config;
  Decomposition decomposition;  // CUTLASS configs only
  int splits;                   // split-K factor (kSplitK decomposition / splitk config); 0 = default
};

// The choice table. PROVISIONAL, set from reasoning, not yet from measurements:
//   M <= 16   weight streaming; the hand-written kernel reads w at the HBM rate with no workspace
//             and a single launch.
//   M <= 64   still weight streaming; swapped CUTLASS tile (128 weight rows x 64 tokens), stream-K
//             so all SMs stream (N / 128 = 32..80 tiles would leave most SMs idle otherwise).
//   M <= 512  128x128 tiles; CUTLASS's heuristic picks stream-K where the tile count is ragged.
//   larger    128x256 tiles, the shape that runs wgmma at its largest (64x256 per warp group).
// Re-derive with: cd benchmarks && pytest -q -s bench_qkv_gemm.py (its "configs" section times
// every configuration on every shape and prints the best per T).
constexpr Choice kTable[] = {
    {16, Config::kSplitK, Decomposition::kHeuristic, 0},
    {64, Config::kSwap128x64, Decomposition::kStreamK, 0},
    {512, Config::kTile128x128, Decomposition::kHeuristic, 0},
    {std::numeric_limits<int64_t>::max(), Config::kTile128x256, Decomposition::kHeuristic, 0},
};

Choice choose_from_table(int64_t m) {
  for (const Choice& c : kTable) {
    if (m <= c.max_m) return c;
  }
  return kTable[sizeof(kTable) / sizeof(kTable[0]) - 1];
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

// The table's choice, or QWEN3_QKV_GEMM_FORCE's. A malformed override is reported once and ignored.
Choice choose(int64_t m) {
  Choice c = choose_from_table(m);
  const char* env = std::getenv("QWEN3_QKV_GEMM_FORCE");
  if (env == nullptr || env[0] == '\0' || std::strcmp(env, "auto") == 0) return c;
  const std::string s(env);
  const size_t colon = s.find(':');
  const std::string name = s.substr(0, colon);
  const std::string mode = colon == std::string::npos ? "" : s.substr(colon + 1);
  Choice f{0, Config::kSplitK, Decomposition::kHeuristic, 0};
  bool ok = true;
  if (name == "splitk") {
    f.config = Config::kSplitK;
  } else if (name == "swap_128x64") {
    f.config = Config::kSwap128x64;
  } else if (name == "tile_128x128") {
    f.config = Config::kTile128x128;
  } else if (name == "tile_128x256") {
    f.config = Config::kTile128x256;
  } else {
    ok = false;
  }
  ok = ok && parse_mode(mode, f);
  if (ok && f.config == Config::kSplitK && f.decomposition != Decomposition::kHeuristic &&
      f.decomposition != Decomposition::kSplitK) {
    ok = false;  // splitk takes a split count only
  }
  if (!ok) {
    static std::atomic<bool> warned{false};
    if (!warned.exchange(true)) {
      std::fprintf(stderr,
                   "qwen3_kernels.qkv_gemm: ignoring QWEN3_QKV_GEMM_FORCE=%s (expected auto or "
                   "splitk[:S] | swap_128x64 | tile_128x128 | tile_128x256 [:heuristic|dp|streamk|"
                   "split<S>])\n",
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
  c = choose(m);
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
  switch (config) {
    case Config::kSplitK:
      return splitk_gemm(p, bf16,
                         p.decomposition == Decomposition::kSplitK
                             ? p.splits
                             : splitk_default_splits(p.m, p.n, p.k, p.sm_count));
    case Config::kSwap128x64:
      return bf16 ? sm90_swap_128x64_bf16(p) : sm90_swap_128x64_fp16(p);
    case Config::kTile128x128:
      return bf16 ? sm90_tile_128x128_bf16(p) : sm90_tile_128x128_fp16(p);
    case Config::kTile128x256:
      return bf16 ? sm90_tile_128x256_bf16(p) : sm90_tile_128x256_fp16(p);
  }
  return cudaErrorNotSupported;
}

}  // namespace
}  // namespace qkv_gemm_detail

size_t qkv_gemm_workspace_size(int64_t m, int64_t n, int64_t k, DType dtype) {
  qkv_gemm_detail::Problem p;
  qkv_gemm_detail::Choice c;
  if (qkv_gemm_detail::make_problem(m, n, k, p, c) != cudaSuccess) return 0;
  return qkv_gemm_detail::cutlass_workspace(c.config, dtype == DType::kBFloat16, p);
}

cudaError_t qkv_gemm(void* out, const void* x, const void* w, int64_t m, int64_t n, int64_t k,
                     void* workspace, size_t workspace_bytes, DType dtype, cudaStream_t stream) {
  qkv_gemm_detail::Problem p;
  qkv_gemm_detail::Choice c;
  cudaError_t err = qkv_gemm_detail::make_problem(m, n, k, p, c);
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
  return qkv_gemm_detail::run(c.config, dtype == DType::kBFloat16, p);
}

}  // namespace qwen3_kernels
