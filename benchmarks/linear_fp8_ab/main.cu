// Every kernel linear_fp8 could run a projection with, on Qwen3-8B's projections at the token
// counts of batch 1, the decode and mixed steps, and 2048 / 4096 (bench_linear_fp8.py's GEMM
// rows): each configuration of the block-scaled FP8 GEMM (linear_fp8_sm90.cu, included here so
// each is reachable) and, at up to 16 tokens, the weight-streaming passes (linear_fp8_gemv.cu:
// gemv at one token, from the bf16 x it quantizes itself; gemv_tokens above). Alternating rounds
// on the same inputs, the weight rotated through enough copies to pass the 60 MB L2 (as the
// engine reads it: once a step). Printed per contender: best time, weight-read rate, TFLOP/s, the
// configuration fp8::gemm chooses marked (*), and every output against Coop128's (largest absolute
// difference over the largest |out|: the same sums in another order). The GEMM rows exclude
// quantize_fp8 (fused into the producers of their input in the engine; gemv includes it).
#include <cuda_bf16.h>
#include <cuda_fp8.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <map>
#include <string>
#include <vector>

#include "ab_common.cuh"
#include "linear_fp8_sm90.cu"
#include "qwen3_kernels/launchers.h"  // quantize_fp8 (quantize_fp8.cu, linked in)

namespace f = qwen3_kernels::fp8;

// Coop128 with a 2 x 1 cluster, multicasting the weight tile to the CTAs of two neighbouring
// token tiles (large M: each weight tile is read by M / 128 CTAs); fp8::gemm never chooses it
// (within 1% of Coop128 at M >= 512), so only this harness instantiates it.
using Coop128Mc = f::BlockScaledGemm<
    cute::Shape<cute::_128, cute::_128, cute::_128>, cute::Shape<cute::_2, cute::_1, cute::_1>,
    cutlass::gemm::KernelTmaWarpSpecializedCooperativeFP8BlockScaledAccum,
    cutlass::epilogue::TmaWarpSpecializedCooperative,
    cutlass::gemm::StreamKScheduler>;
constexpr int kCoop128Mc = 100;  // its contender id, past every f::Config

// The configurations fp8::gemm runs (f::Coop128 ...) overlap each k-tile's promotion with the next
// k-tile's wgmma (OverlappedPromotion). The same configurations on CUTLASS's own mainloop (the
// promotion after a wgmma.wait_group 0 every k-tile), ids from kCutlass0 in f::Config's order:
// the first of them, Coop128's, is every output's reference.
template <class Tile, class Cluster, class Schedule, class Epi, class Sched, bool kSwap>
using CutlassMainloop = f::BlockScaledGemm<Tile, Cluster, Schedule, Epi, Sched, kSwap, false>;
using Coop = cutlass::gemm::KernelTmaWarpSpecializedCooperativeFP8BlockScaledAccum;
using Pp = cutlass::gemm::KernelTmaWarpSpecializedPingpongFP8BlockScaledAccum;
using CoopEpi = cutlass::epilogue::TmaWarpSpecializedCooperative;
using PpEpi = cutlass::epilogue::TmaWarpSpecialized;
using SK = cutlass::gemm::StreamKScheduler;
using PS = cutlass::gemm::PersistentScheduler;
using cute::_1; using cute::_2; using cute::_16; using cute::_32; using cute::_64;
using cute::_128; using cute::Shape;
using ClCoop128 =
    CutlassMainloop<Shape<_128, _128, _128>, Shape<_1, _2, _1>, Coop, CoopEpi, SK, false>;
using ClPingpong64 =
    CutlassMainloop<Shape<_64, _128, _128>, Shape<_1, _2, _1>, Pp, PpEpi, PS, false>;
using ClSwapPingpong128x64 =
    CutlassMainloop<Shape<_128, _64, _128>, Shape<_1, _1, _1>, Pp, PpEpi, PS, true>;
using ClSwapCoop128x16 =
    CutlassMainloop<Shape<_128, _16, _128>, Shape<_1, _1, _1>, Coop, CoopEpi, SK, true>;
using ClSwapCoop128x32 =
    CutlassMainloop<Shape<_128, _32, _128>, Shape<_1, _1, _1>, Coop, CoopEpi, SK, true>;

constexpr int kCutlass0 = 200;
// (no twin for SwapCoop128x96: its id and above are not CUTLASS-mainloop contenders)
bool is_cutlass(int config) {
  return config >= kCutlass0 && config < kCutlass0 + static_cast<int>(f::Config::kSwapCoop128x96);
}
template <class G>
size_t cl_ws(const f::Call& c) { return G::workspace_size(c); }
size_t cutlass_workspace(int config, const f::Call& c) {
  switch (static_cast<f::Config>(config - kCutlass0)) {
    case f::Config::kPingpong64: return cl_ws<ClPingpong64>(c);
    case f::Config::kSwapPingpong128x64: return cl_ws<ClSwapPingpong128x64>(c);
    case f::Config::kSwapCoop128x16: return cl_ws<ClSwapCoop128x16>(c);
    case f::Config::kSwapCoop128x32: return cl_ws<ClSwapCoop128x32>(c);
    default: return cl_ws<ClCoop128>(c);
  }
}
cudaError_t run_cutlass(int config, const f::Call& c, void* ws, size_t bytes, cudaStream_t s) {
  switch (static_cast<f::Config>(config - kCutlass0)) {
    case f::Config::kPingpong64: return ClPingpong64::run(c, ws, bytes, s);
    case f::Config::kSwapPingpong128x64: return ClSwapPingpong128x64::run(c, ws, bytes, s);
    case f::Config::kSwapCoop128x16: return ClSwapCoop128x16::run(c, ws, bytes, s);
    case f::Config::kSwapCoop128x32: return ClSwapCoop128x32::run(c, ws, bytes, s);
    default: return ClCoop128::run(c, ws, bytes, s);
  }
}

// Coop128 with the tile scheduler's arguments set (fp8::gemm leaves CUTLASS's defaults: heuristic
// decomposition and raster order, no swizzle): whether large M meets its operands in L2 more often
// in another order, or loses to stream-K's partial tiles in the last wave. Ids past kCoop128Mc.
using Dm = cutlass::gemm::kernel::detail::PersistentTileSchedulerSm90StreamKParams::DecompositionMode;
using Ro = cutlass::gemm::kernel::detail::RasterOrderOptions;
struct Sched {
  int swizzle;
  Ro raster;
  Dm decomposition;
};
constexpr int kSched0 = 101;
constexpr Sched kScheds[] = {
    {1, Ro::Heuristic, Dm::DataParallel},
    {2, Ro::AlongM, Dm::Heuristic}, {2, Ro::AlongN, Dm::Heuristic},
    {4, Ro::AlongM, Dm::Heuristic}, {4, Ro::AlongN, Dm::Heuristic},
    {8, Ro::AlongM, Dm::Heuristic}, {8, Ro::AlongN, Dm::Heuristic},
};
constexpr int kSchedCount = sizeof(kScheds) / sizeof(kScheds[0]);
bool is_sched(int config) { return config >= kSched0 && config < kSched0 + kSchedCount; }

typename f::Coop128::Gemm::Arguments sched_arguments(int config, const f::Call& c) {
  auto args = f::Coop128::arguments(c);
  const Sched& sc = kScheds[config - kSched0];
  args.scheduler.max_swizzle_size = sc.swizzle;
  args.scheduler.raster_order = sc.raster;
  args.scheduler.decomposition_mode = sc.decomposition;
  return args;
}
cudaError_t run_sched(int config, const f::Call& c, void* ws, size_t bytes, cudaStream_t s) {
  using G = f::Coop128::Gemm;
  const auto args = sched_arguments(config, c);
  if (G::can_implement(args) != cutlass::Status::kSuccess) return cudaErrorNotSupported;
  if (G::get_workspace_size(args) > bytes) return cudaErrorInvalidValue;
  G gemm;
  if (gemm.initialize(args, ws, s) != cutlass::Status::kSuccess) return cudaErrorUnknown;
  if (gemm.run(s, nullptr, /*launch_with_pdl=*/true) != cutlass::Status::kSuccess)
    return cudaErrorLaunchFailure;
  return cudaGetLastError();
}

// Every configuration, whether or not fp8::gemm's choose() returns it.
template <class G>
size_t ws_of(const f::Call& c) { return G::workspace_size(c); }
size_t workspace_of(int config, const f::Call& c) {
  if (is_cutlass(config)) return cutlass_workspace(config, c);
  if (config == kCoop128Mc) return ws_of<Coop128Mc>(c);
  if (is_sched(config)) return f::Coop128::Gemm::get_workspace_size(sched_arguments(config, c));
  switch (static_cast<f::Config>(config)) {
    case f::Config::kPingpong64: return ws_of<f::Pingpong64>(c);
    case f::Config::kSwapPingpong128x64: return ws_of<f::SwapPingpong128x64>(c);
    case f::Config::kSwapCoop128x16: return ws_of<f::SwapCoop128x16>(c);
    case f::Config::kSwapCoop128x32: return ws_of<f::SwapCoop128x32>(c);
    case f::Config::kSwapCoop128x96: return ws_of<f::SwapCoop128x96>(c);
    default: return ws_of<f::Coop128>(c);
  }
}
cudaError_t run_any(int config, const f::Call& c, void* ws, size_t bytes, cudaStream_t s) {
  if (is_cutlass(config)) return run_cutlass(config, c, ws, bytes, s);
  if (config == kCoop128Mc) return Coop128Mc::run(c, ws, bytes, s);
  if (is_sched(config)) return run_sched(config, c, ws, bytes, s);
  switch (static_cast<f::Config>(config)) {
    case f::Config::kPingpong64: return f::Pingpong64::run(c, ws, bytes, s);
    case f::Config::kSwapPingpong128x64: return f::SwapPingpong128x64::run(c, ws, bytes, s);
    case f::Config::kSwapCoop128x16: return f::SwapCoop128x16::run(c, ws, bytes, s);
    case f::Config::kSwapCoop128x32: return f::SwapCoop128x32::run(c, ws, bytes, s);
    case f::Config::kSwapCoop128x96: return f::SwapCoop128x96::run(c, ws, bytes, s);
    default: return f::Coop128::run(c, ws, bytes, s);
  }
}

// A contender: a GEMM configuration, or a weight-streaming pass (kStream: gemv at M == 1,
// gemv_tokens at M = 2..16).
constexpr int kStream = -1;
struct Contender {
  const char* name;
  int config;  // f::Config, kCoop128Mc or kStream
};
constexpr int cl(f::Config c) { return kCutlass0 + static_cast<int>(c); }
constexpr Contender kContenders[] = {
    {"cl_coop128", cl(f::Config::kCoop128)},  // the reference: first
    {"coop128", static_cast<int>(f::Config::kCoop128)},
    {"cl_pp64", cl(f::Config::kPingpong64)},
    {"cl_swap_pp128x64", cl(f::Config::kSwapPingpong128x64)},
    {"cl_swap_coop128x16", cl(f::Config::kSwapCoop128x16)},
    {"cl_swap_coop128x32", cl(f::Config::kSwapCoop128x32)},
    {"pp64", static_cast<int>(f::Config::kPingpong64)},
    {"swap_pp128x64", static_cast<int>(f::Config::kSwapPingpong128x64)},
    {"coop128mc", kCoop128Mc},
    {"swap_coop128x16", static_cast<int>(f::Config::kSwapCoop128x16)},
    {"swap_coop128x32", static_cast<int>(f::Config::kSwapCoop128x32)},
    {"swap_coop128x96", static_cast<int>(f::Config::kSwapCoop128x96)},
    {"stream", kStream},
    // `large` only (see main):
    {"coop128_dp", kSched0 + 0},
    {"coop128_sw2m", kSched0 + 1}, {"coop128_sw2n", kSched0 + 2},
    {"coop128_sw4m", kSched0 + 3}, {"coop128_sw4n", kSched0 + 4},
    {"coop128_sw8m", kSched0 + 5}, {"coop128_sw8n", kSched0 + 6},
};
constexpr int kCount = sizeof(kContenders) / sizeof(kContenders[0]);

// Inputs of one (projection, M): x and its quantization, `copies` weights with their scales.
struct Inputs {
  __nv_bfloat16* x;
  uint8_t* xq;
  float* xs;
  std::vector<uint8_t*> w;
  std::vector<float*> ws;
  int64_t stride;
};

cudaError_t run(const Contender& ct, f::Call c, const Inputs& in, int copy, void* work,
                size_t work_bytes, cudaStream_t s) {
  c.w = in.w[copy];
  c.w_scales = in.ws[copy];
  if (ct.config != kStream) return run_any(ct.config, c, work, work_bytes, s);
  if (c.m == 1) return f::gemv(c.out, in.x, c.w, c.w_scales, c.n, c.k, s);
  if (c.m <= 2 * f::kTokensPerTile)
    return f::gemv_tokens(c.out, in.xq, in.xs, in.stride, c.w, c.w_scales, c.m, c.n, c.k, s);
  return cudaErrorNotSupported;
}

// ab [rounds] [large]: `large` times Qwen3-8B's and 32B's projections at M = 2048 / 4096 / 8192
// (bench_linear_fp8.py's GEMM rows), Coop128 against itself with other scheduler arguments, and
// Pingpong64 / Coop128Mc; without it, 8B's projections at every M and every configuration but
// those scheduler variants.
int main(int argc, char** argv) {
  const int rounds = argc > 1 ? atoi(argv[1]) : 5;
  const bool large = argc > 2 && std::string(argv[2]) == "large";
  const int iters = 20;
  struct Proj { const char* name; int n, k; };
  const std::vector<Proj> projs = large ?
      std::vector<Proj>{{"8B qkv", 6144, 4096}, {"8B o", 4096, 4096}, {"8B gate_up", 24576, 4096},
                        {"8B down", 4096, 12288}, {"32B qkv", 10240, 5120}, {"32B o", 5120, 8192},
                        {"32B gate_up", 51200, 5120}, {"32B down", 5120, 25600}} :
      std::vector<Proj>{{"qkv", 6144, 4096}, {"o", 4096, 4096}, {"gate_up", 24576, 4096},
                        {"down", 4096, 12288}};
  const std::vector<int> ms = large ? std::vector<int>{2048, 4096, 8192} :
      std::vector<int>{1, 2, 4, 8, 16, 17, 32, 48, 64, 80, 96, 112, 128, 144, 160, 176, 192,
                       224, 256, 320, 384, 448, 512, 2048, 4096};
  // which contenders run: `large` the Coop128 family, else all but the scheduler variants
  auto wanted = [&](const Contender& ct) {
    if (large) return ct.config == static_cast<int>(f::Config::kCoop128) ||
                      ct.config == static_cast<int>(f::Config::kPingpong64) ||
                      ct.config == cl(f::Config::kCoop128) ||
                      ct.config == cl(f::Config::kPingpong64) ||
                      ct.config == kCoop128Mc || is_sched(ct.config);
    return !is_sched(ct.config);
  };
  cudaDeviceProp prop;
  CK(cudaGetDeviceProperties(&prop, 0));
  printf("%s, %d SMs\n", prop.name, prop.multiProcessorCount);
  cudaStream_t stream;
  CK(cudaStreamCreate(&stream));
  cudaEvent_t e0, e1;
  CK(cudaEventCreate(&e0));
  CK(cudaEventCreate(&e1));
  for (const Proj& pj : projs) {
    const int64_t n = pj.n, k = pj.k, groups = (k + 127) / 128;
    const int64_t w_bytes = n * k, ws_count = (n + 127) / 128 * groups;
    // enough copies that one pass over them reads >= 240 MB (4x the L2)
    const int copies = static_cast<int>(std::max<int64_t>(1, (240000000 + w_bytes - 1) / w_bytes));
    Inputs in;
    for (int i = 0; i < copies; ++i) {
      uint8_t* w;
      float* ws;
      CK(cudaMalloc(&w, w_bytes));
      CK(cudaMalloc(&ws, ws_count * 4));
      fill_e4m3<<<4096, 256>>>(w, w_bytes, 2, 448.f);  // every copy the same values
      fill_f32<<<64, 256>>>(ws, ws_count, 4, 1.f / 448, 0.5f);
      in.w.push_back(w);
      in.ws.push_back(ws);
    }
    for (int m : ms) {
      in.stride = (m + 3) / 4 * 4;
      __nv_bfloat16* out;
      CK(cudaMalloc(&in.x, m * k * 2));
      CK(cudaMalloc(&in.xq, m * k));
      CK(cudaMalloc(&in.xs, groups * in.stride * 4));
      CK(cudaMalloc(&out, m * n * 2));
      fill_bf16<<<1024, 256>>>(in.x, m * k, 1, 4.f);
      CK(qwen3_kernels::quantize_fp8(in.xq, in.xs, in.x, m, k, /*x_stride=*/k,
                                     /*scale_stride_t=*/1, /*scale_stride_g=*/in.stride,
                                     qwen3_kernels::DType::kBFloat16, 0));
      CK(cudaDeviceSynchronize());
      f::Call c;
      f::Config chosen;
      CK(f::make_call(m, n, k, in.stride, c, chosen));
      c.out = out; c.xq = in.xq; c.x_scales = in.xs;
      size_t ws_bytes = 0;
      for (const Contender& ct : kContenders)
        if (ct.config != kStream)
          ws_bytes = std::max(ws_bytes, workspace_of(ct.config, c));
      void* work = nullptr;
      if (ws_bytes) CK(cudaMalloc(&work, ws_bytes));
      std::vector<__nv_bfloat16> ref(m * n), got(m * n);
      std::map<int, std::vector<__nv_bfloat16>> cl_out;  // round 0's CUTLASS-mainloop outputs
      float best[kCount];
      bool ok[kCount];
      for (int i = 0; i < kCount; ++i)
        best[i] = 1e30f,
        ok[i] = wanted(kContenders[i]) && !(kContenders[i].config == kStream && m > 16);
      for (int r = 0; r < rounds; ++r) {
        for (int ci = 0; ci < kCount; ++ci) {
          if (!ok[ci]) continue;
          const Contender& ct = kContenders[ci];
          CK(cudaMemset(out, 0xff, m * n * 2));
          const cudaError_t err = run(ct, c, in, 0, work, ws_bytes, stream);
          if (err != cudaSuccess) {
            printf("  %s M=%d %s: %s\n", pj.name, m, ct.name, cudaGetErrorString(err));
            cudaGetLastError();
            ok[ci] = false;
            continue;
          }
          CK(cudaStreamSynchronize(stream));
          if (r == 0) {
            CK(cudaMemcpy(ci == 0 ? ref.data() : got.data(), out, m * n * 2,
                          cudaMemcpyDeviceToHost));
            const std::vector<__nv_bfloat16>& mine = ci == 0 ? ref : got;
            if (is_cutlass(ct.config)) cl_out[ct.config - kCutlass0] = mine;
            auto twin = cl_out.find(ct.config);  // an overlapped configuration's CUTLASS twin
            if (twin != cl_out.end()) {
              size_t differ = 0;
              for (size_t i = 0; i < mine.size(); ++i)
                differ += std::memcmp(&mine[i], &twin->second[i], 2) != 0;
              printf("  %s M=%d %s: %s%zu of %zu outputs differ from CUTLASS's mainloop\n",
                     pj.name, m, ct.name, differ ? "" : "bit-identical, ", differ, mine.size());
            }
            if (ci > 0) {
              float diff = 0.f, mag = 0.f;
              size_t bad = 0;
              // every element up to 16M outputs, a strided sample above (the host loop)
              const size_t step = std::max<size_t>(1, ref.size() / (16u << 20));
              for (size_t i = 0; i < ref.size(); i += step) {
                const float a = __bfloat162float(ref[i]), b = __bfloat162float(got[i]);
                if (!std::isfinite(a) || !std::isfinite(b)) ++bad;
                else diff = std::max(diff, std::fabs(a - b));
                mag = std::max(mag, std::fabs(a));
              }
              if (bad || diff > 1e-2f * mag)
                printf("  %s M=%d %s vs cl_coop128: max |diff| %.4g of max |out| %.4g, "
                       "non-finite %zu\n", pj.name, m, ct.name, diff, mag, bad);
            }
          }
          for (int i = 0; i < copies; ++i) CK(run(ct, c, in, i, work, ws_bytes, stream));
          CK(cudaEventRecord(e0, stream));
          for (int i = 0; i < iters; ++i)
            CK(run(ct, c, in, i % copies, work, ws_bytes, stream));
          CK(cudaEventRecord(e1, stream));
          CK(cudaEventSynchronize(e1));
          float ms_ = 0.f;
          CK(cudaEventElapsedTime(&ms_, e0, e1));
          best[ci] = std::min(best[ci], ms_ * 1000.f / iters);
        }
      }
      printf("%-11s M=%-4d", pj.name, m);
      for (int ci = 0; ci < kCount; ++ci) {
        if (!ok[ci]) continue;
        const bool is_chosen = kContenders[ci].config == static_cast<int>(chosen);
        printf(" | %s%s %.2f us %.2f TB/s %.0f TF", kContenders[ci].name, is_chosen ? "*" : "",
               best[ci], n * k / best[ci] * 1e-6, 2.0 * m * n * k / best[ci] * 1e-6);
      }
      printf("\n");
      fflush(stdout);
      CK(cudaFree(in.x)); CK(cudaFree(in.xq)); CK(cudaFree(in.xs)); CK(cudaFree(out));
      if (work) CK(cudaFree(work));
    }
    for (int i = 0; i < copies; ++i) { CK(cudaFree(in.w[i])); CK(cudaFree(in.ws[i])); }
  }
  return 0;
}
