// Every configuration of the block-scaled FP8 GEMM (linear_fp8_sm90.cu, included here so each is
// reachable) on Qwen3-8B's projections at the token counts of the engine's decode and mixed steps
// and at 2048 / 4096 (bench_linear_fp8.py's GEMM rows),
// alternating rounds on the same inputs: best time, weight-read rate and TFLOP/s per
// configuration, the configuration fp8::gemm chooses marked, and every output against Coop128's
// (largest absolute difference over the largest |out|: the same sums in another order).
#include <cuda_bf16.h>
#include <cuda_fp8.h>

#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <vector>

#include "ab_common.cuh"
#include "linear_fp8_sm90.cu"

namespace f = qwen3_kernels::fp8;

// Every configuration, whether or not fp8::gemm's choose() returns it.
template <class G>
size_t ws_of(const f::Call& c) { return G::workspace_size(c); }
size_t workspace_of(f::Config config, const f::Call& c) {
  switch (config) {
    case f::Config::kPingpong64: return ws_of<f::Pingpong64>(c);
    case f::Config::kSwapCoop128x64: return ws_of<f::SwapCoop128x64>(c);
    case f::Config::kSwapPingpong128x64: return ws_of<f::SwapPingpong128x64>(c);
    case f::Config::kCoop128Mc: return ws_of<f::Coop128Mc>(c);
    default: return ws_of<f::Coop128>(c);
  }
}
cudaError_t run_any(f::Config config, const f::Call& c, void* ws, size_t bytes, cudaStream_t s) {
  switch (config) {
    case f::Config::kPingpong64: return f::Pingpong64::run(c, ws, bytes, s);
    case f::Config::kSwapCoop128x64: return f::SwapCoop128x64::run(c, ws, bytes, s);
    case f::Config::kSwapPingpong128x64: return f::SwapPingpong128x64::run(c, ws, bytes, s);
    case f::Config::kCoop128Mc: return f::Coop128Mc::run(c, ws, bytes, s);
    default: return f::Coop128::run(c, ws, bytes, s);
  }
}

int main(int argc, char** argv) {
  const int rounds = argc > 1 ? atoi(argv[1]) : 5;
  const int iters = 20;
  struct Proj { const char* name; int n, k; };
  const Proj projs[] = {{"qkv", 6144, 4096}, {"o", 4096, 4096}, {"gate_up", 24576, 4096},
                        {"down", 4096, 12288}};
  const int ms[] = {17, 32, 64, 96, 128, 176, 256, 384, 512, 2048, 4096};
  const f::Config configs[] = {f::Config::kCoop128, f::Config::kPingpong64,
                               f::Config::kSwapCoop128x64, f::Config::kSwapPingpong128x64,
                               f::Config::kCoop128Mc};
  const char* names[] = {"coop128", "pp64", "swap_coop128x64", "swap_pp128x64", "coop128mc"};
  constexpr int kConfigs = 5;
  cudaDeviceProp prop;
  CK(cudaGetDeviceProperties(&prop, 0));
  printf("%s, %d SMs\n", prop.name, prop.multiProcessorCount);
  cudaStream_t stream;
  CK(cudaStreamCreate(&stream));
  cudaEvent_t e0, e1;
  CK(cudaEventCreate(&e0));
  CK(cudaEventCreate(&e1));
  for (const Proj& pj : projs) {
    for (int m : ms) {
      const int64_t n = pj.n, k = pj.k, groups = (k + 127) / 128;
      const int64_t stride = (m + 3) / 4 * 4;
      uint8_t *xq, *w;
      float *xs, *ws;
      __nv_bfloat16* out;
      CK(cudaMalloc(&xq, m * k));
      CK(cudaMalloc(&w, n * k));
      CK(cudaMalloc(&xs, groups * stride * 4));
      CK(cudaMalloc(&ws, (n + 127) / 128 * groups * 4));
      CK(cudaMalloc(&out, m * n * 2));
      fill_e4m3<<<1024, 256>>>(xq, m * k, 1, 448.f);
      fill_e4m3<<<4096, 256>>>(w, n * k, 2, 448.f);
      fill_f32<<<64, 256>>>(xs, groups * stride, 3, 1.f / 448, 0.5f);
      fill_f32<<<64, 256>>>(ws, (n + 127) / 128 * groups, 4, 1.f / 448, 0.5f);
      CK(cudaDeviceSynchronize());
      f::Call c;
      f::Config chosen;
      CK(f::make_call(m, n, k, stride, c, chosen));
      c.out = out; c.xq = xq; c.x_scales = xs; c.w = w; c.w_scales = ws;
      size_t ws_bytes = 0;
      for (f::Config cf : configs) ws_bytes = std::max(ws_bytes, workspace_of(cf, c));
      void* work = nullptr;
      if (ws_bytes) CK(cudaMalloc(&work, ws_bytes));
      std::vector<__nv_bfloat16> ref(m * n), got(m * n);
      float best[kConfigs];
      bool ok[kConfigs];
      for (int i = 0; i < kConfigs; ++i) best[i] = 1e30f, ok[i] = true;
      for (int r = 0; r < rounds; ++r) {
        for (int ci = 0; ci < kConfigs; ++ci) {
          if (!ok[ci]) continue;
          CK(cudaMemset(out, 0xff, m * n * 2));
          const cudaError_t err = run_any(configs[ci], c, work, ws_bytes, stream);
          if (err != cudaSuccess) {
            printf("  %s M=%d %s: %s\n", pj.name, m, names[ci], cudaGetErrorString(err));
            cudaGetLastError();
            ok[ci] = false;
            continue;
          }
          CK(cudaStreamSynchronize(stream));
          if (r == 0) {
            CK(cudaMemcpy(ci == 0 ? ref.data() : got.data(), out, m * n * 2,
                          cudaMemcpyDeviceToHost));
            if (ci > 0) {
              float diff = 0.f, mag = 0.f;
              size_t bad = 0;
              for (size_t i = 0; i < ref.size(); ++i) {
                const float a = __bfloat162float(ref[i]), b = __bfloat162float(got[i]);
                if (!std::isfinite(a) || !std::isfinite(b)) ++bad;
                else diff = std::max(diff, std::fabs(a - b));
                mag = std::max(mag, std::fabs(a));
              }
              if (bad || diff > 1e-2f * mag)
                printf("  %s M=%d %s vs coop128: max |diff| %.4g of max |out| %.4g, "
                       "non-finite %zu\n", pj.name, m, names[ci], diff, mag, bad);
            }
          }
          for (int i = 0; i < 2; ++i) CK(run_any(configs[ci], c, work, ws_bytes, stream));
          CK(cudaEventRecord(e0, stream));
          for (int i = 0; i < iters; ++i)
            CK(run_any(configs[ci], c, work, ws_bytes, stream));
          CK(cudaEventRecord(e1, stream));
          CK(cudaEventSynchronize(e1));
          float ms_ = 0.f;
          CK(cudaEventElapsedTime(&ms_, e0, e1));
          best[ci] = std::min(best[ci], ms_ * 1000.f / iters);
        }
      }
      printf("%-8s M=%-4d", pj.name, m);
      for (int ci = 0; ci < kConfigs; ++ci) {
        if (!ok[ci]) { printf(" | %s -", names[ci]); continue; }
        printf(" | %s%s %.2f us %.2f TB/s %.0f TF", names[ci], configs[ci] == chosen ? "*" : "",
               best[ci], n * k / best[ci] * 1e-6, 2.0 * m * n * k / best[ci] * 1e-6);
      }
      printf("\n");
      fflush(stdout);
      CK(cudaFree(xq)); CK(cudaFree(w)); CK(cudaFree(xs)); CK(cudaFree(ws)); CK(cudaFree(out));
      if (work) CK(cudaFree(work));
    }
  }
  return 0;
}
