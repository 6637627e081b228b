// A / B of the FP8 weight-streaming GEMVs (fp8::gemv and fp8::gemv_tokens, linear_fp8_gemv.cu)
// without torch: variants of that file, each compiled into a namespace of its own (build.sh), on
// the same inputs, alternating. Three timings, all CUDA-graph replays with the launches' PDL as
// the engine's graphs have it:
//   each:  one projection called back to back, the weight rotated through enough copies to pass
//          the 60 MB L2 (bench_linear_fp8.py's T = 1 rows);
//   layer: a decode step's projections in the engine's order (qkv, o, gate_up, down) over every
//          layer's own weights (Qwen3-8B: 36 layers, 7 GB; Qwen3-32B: its first 16);
//   tokens: fp8::gemv_tokens at T = 2, 8, 16 on the projections linear_fp8 gives it (N < 16384),
//          x already quantized (random e4m3 and scales), as "each".
// Printed per variant: the best of the rounds' medians, the weight-read rate (e4m3 bytes and
// scales), and its output against the first variant's (largest |difference| / largest |out|: the
// same dot products summed in another order shows as ~1e-3).
#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <vector>

#include "ab_common.cuh"

#define DECL(NS)                                                                       \
  namespace NS::fp8 {                                                                  \
  cudaError_t gemv(void*, const void*, const void*, const float*, int64_t, int64_t,    \
                   cudaStream_t);                                                      \
  cudaError_t gemv_tokens(void*, const void*, const float*, int64_t, const void*,      \
                          const float*, int64_t, int64_t, int64_t, cudaStream_t);      \
  }
#define CALL(NS) NS::fp8::gemv
#include "variants.h"
using Gemv = cudaError_t (*)(void*, const void*, const void*, const float*, int64_t, int64_t,
                             cudaStream_t);
static const Gemv kGemv[] = {VARIANT_CALLS_LIST};
#undef CALL
#define CALL(NS) NS::fp8::gemv_tokens
using GemvTokens = cudaError_t (*)(void*, const void*, const float*, int64_t, const void*,
                                   const float*, int64_t, int64_t, int64_t, cudaStream_t);
static const GemvTokens kTokens[] = {VARIANT_CALLS_LIST};
static const char* kNames[] = {VARIANT_NAMES_LIST};
constexpr int kVariants = sizeof(kGemv) / sizeof(kGemv[0]);

struct Proj {
  const char* name;
  int64_t n, k;
};
struct Weight {  // one copy of a projection's weight
  uint8_t* w;
  float* s;
};
static size_t weight_bytes(const Proj& p) {
  return p.n * p.k + ((p.n + 127) / 128) * ((p.k + 127) / 128) * 4;
}
static Weight make_weight(const Proj& p, uint32_t seed) {
  Weight w;
  const size_t scales = ((p.n + 127) / 128) * ((p.k + 127) / 128);
  CK(cudaMalloc(&w.w, p.n * p.k));
  CK(cudaMalloc(&w.s, scales * 4));
  fill_e4m3<<<1024, 256>>>(w.w, p.n * p.k, seed, 300.f);
  fill_f32<<<64, 256>>>(w.s, scales, seed + 1, 1e-3f, 0.5f);
  return w;
}

struct Call {
  int proj;  // index into the projections
  Weight w;
};

// Median time of one replay of the graph `capture(st)` records, over `reps` replays, in us.
template <class Capture>
static float time_graph(Capture capture, cudaStream_t st, int reps) {
  cudaGraph_t graph;
  cudaGraphExec_t exec;
  CK(cudaStreamBeginCapture(st, cudaStreamCaptureModeThreadLocal));
  capture(st);
  CK(cudaStreamEndCapture(st, &graph));
  CK(cudaGraphInstantiate(&exec, graph, 0));
  cudaEvent_t e0, e1;
  CK(cudaEventCreate(&e0));
  CK(cudaEventCreate(&e1));
  for (int i = 0; i < 3; ++i) CK(cudaGraphLaunch(exec, st));  // warm-up
  std::vector<float> ms(reps);
  for (int i = 0; i < reps; ++i) {
    CK(cudaEventRecord(e0, st));
    CK(cudaGraphLaunch(exec, st));
    CK(cudaEventRecord(e1, st));
    CK(cudaEventSynchronize(e1));
    CK(cudaEventElapsedTime(&ms[i], e0, e1));
  }
  std::sort(ms.begin(), ms.end());
  CK(cudaGraphExecDestroy(exec));
  CK(cudaGraphDestroy(graph));
  CK(cudaEventDestroy(e0));
  CK(cudaEventDestroy(e1));
  return ms[reps / 2] * 1000.f;
}

// One replay of `calls`, each a gemv of variant v, in us.
static float time_gemv(int v, const std::vector<Call>& calls, const std::vector<Proj>& projs,
                       const std::vector<__nv_bfloat16*>& xs, const std::vector<void*>& outs,
                       cudaStream_t st, int reps) {
  return time_graph(
      [&](cudaStream_t s) {
        for (const Call& c : calls) {
          const Proj& p = projs[c.proj];
          CK(kGemv[v](outs[c.proj], xs[c.proj], c.w.w, c.w.s, p.n, p.k, s));
        }
      },
      st, reps);
}

// One replay of `calls`, each a gemv_tokens of variant v on T tokens of xq, in us.
static float time_tokens(int v, const std::vector<Call>& calls, const std::vector<Proj>& projs,
                         int64_t t, const uint8_t* xq, const float* xs, int64_t scale_stride,
                         void* out, cudaStream_t st, int reps) {
  return time_graph(
      [&](cudaStream_t s) {
        for (const Call& c : calls) {
          const Proj& p = projs[c.proj];
          CK(kTokens[v](out, xq, xs, scale_stride, c.w.w, c.w.s, t, p.n, p.k, s));
        }
      },
      st, reps);
}

// out of variant v on (x, w) against ref (the first variant's): max |diff| / max |ref|
static double compare(const std::vector<__nv_bfloat16>& ref, const std::vector<__nv_bfloat16>& o) {
  double md = 0, mr = 0;
  for (size_t i = 0; i < ref.size(); ++i) {
    const double a = __bfloat162float(ref[i]), b = __bfloat162float(o[i]);
    md = std::max(md, std::fabs(a - b));
    mr = std::max(mr, std::fabs(a));
  }
  return std::isfinite(md) ? md / std::max(mr, 1e-30) : INFINITY;
}

int main(int argc, char** argv) {
  const int rounds = argc > 1 ? atoi(argv[1]) : 3;
  cudaStream_t st;
  CK(cudaStreamCreate(&st));
  int dev = 0;
  cudaDeviceProp prop;
  CK(cudaGetDeviceProperties(&prop, dev));
  printf("device %s, %d SMs; variants:", prop.name, prop.multiProcessorCount);
  for (int v = 0; v < kVariants; ++v) printf(" %s", kNames[v]);
  printf("\n");
  struct Model {
    const char* name;
    std::vector<Proj> projs;
    int layers;
  };
  const std::vector<Model> models = {
      {"8B", {{"qkv", 6144, 4096}, {"o", 4096, 4096}, {"gate_up", 24576, 4096},
              {"down", 4096, 12288}}, 36},
      {"32B", {{"qkv", 10240, 5120}, {"o", 5120, 8192}, {"gate_up", 51200, 5120},
               {"down", 5120, 25600}}, 16},
  };
  for (const Model& m : models) {
    const int np = m.projs.size();
    std::vector<__nv_bfloat16*> xs(np);
    std::vector<std::vector<void*>> outs(kVariants, std::vector<void*>(np));
    for (int i = 0; i < np; ++i) {
      const Proj& p = m.projs[i];
      CK(cudaMalloc(&xs[i], p.k * 2));
      fill_bf16<<<64, 256>>>(xs[i], p.k, 100 + i, 3.f);
      for (int v = 0; v < kVariants; ++v) {
        CK(cudaMalloc(&outs[v][i], p.n * 2));
        CK(cudaMemset(outs[v][i], 0xff, p.n * 2));  // NaN poison
      }
    }
    // every layer's own weights (the "layer" timing); the "each" timing rotates through them
    std::vector<std::vector<Weight>> w(m.layers, std::vector<Weight>(np));
    for (int l = 0; l < m.layers; ++l)
      for (int i = 0; i < np; ++i) w[l][i] = make_weight(m.projs[i], 1000 * l + 10 * i);
    CK(cudaDeviceSynchronize());
    // correctness on layer 0 (outs of the "each" graphs are overwritten by later layers: check
    // before timing, on one plain call a variant)
    for (int i = 0; i < np; ++i) {
      const Proj& p = m.projs[i];
      std::vector<__nv_bfloat16> ref(p.n), o(p.n);
      for (int v = 0; v < kVariants; ++v) {
        CK(kGemv[v](outs[v][i], xs[i], w[0][i].w, w[0][i].s, p.n, p.k, st));
        CK(cudaStreamSynchronize(st));
        CK(cudaMemcpy(v == 0 ? ref.data() : o.data(), outs[v][i], p.n * 2,
                      cudaMemcpyDeviceToHost));
        if (v > 0) printf("  %s %s: %s vs %s max|d|/max|ref| %.2e\n", m.name, p.name, kNames[v],
                          kNames[0], compare(ref, o));
      }
    }
    // each: 24 calls of one projection, each on the next layer's copy (over 16 layers a copy
    // comes back after 15 others: far past the L2)
    for (int i = 0; i < np; ++i) {
      const Proj& p = m.projs[i];
      std::vector<Call> calls;
      for (int c = 0; c < 24; ++c) calls.push_back({i, w[c % m.layers][i]});
      std::vector<float> best(kVariants, 1e30f);
      for (int r = 0; r < rounds; ++r)
        for (int v = 0; v < kVariants; ++v)
          best[v] = std::min(best[v],
                             time_gemv(v, calls, m.projs, xs, outs[v], st, 20) / calls.size());
      printf("%s %-8s N=%-6lld K=%-6lld each:", m.name, p.name, (long long)p.n, (long long)p.k);
      for (int v = 0; v < kVariants; ++v)
        printf("  %s %.2f us %.2f TB/s (%.3fx)", kNames[v], best[v],
               weight_bytes(p) / (best[v] * 1e6), best[0] / best[v]);
      printf("\n");
    }
    // layer: a step's projections over every layer
    std::vector<Call> calls;
    size_t bytes = 0;
    for (int l = 0; l < m.layers; ++l)
      for (int i = 0; i < np; ++i) {
        calls.push_back({i, w[l][i]});
        bytes += weight_bytes(m.projs[i]);
      }
    std::vector<float> best(kVariants, 1e30f);
    for (int r = 0; r < rounds; ++r)
      for (int v = 0; v < kVariants; ++v)
        best[v] = std::min(best[v], time_gemv(v, calls, m.projs, xs, outs[v], st, 10));
    printf("%s layers x%d qkv,o,gate_up,down:", m.name, m.layers);
    for (int v = 0; v < kVariants; ++v)
      printf("  %s %.1f us/layer %.2f TB/s (%.3fx)", kNames[v], best[v] / m.layers,
             bytes / (best[v] * 1e6), best[0] / best[v]);
    printf("\n");
    // tokens: gemv_tokens at T = 2, 8, 16 where linear_fp8 takes it (N < 16384), on random
    // e4m3 x and scales, each projection back to back over the rotated weights
    for (const int64_t t : {2, 8, 16}) {
      for (int i = 0; i < np; ++i) {
        const Proj& p = m.projs[i];
        if (p.n >= 16384) continue;
        const int64_t groups = (p.k + 127) / 128, stride = (t + 3) / 4 * 4;
        uint8_t* xq;
        float* xs;
        CK(cudaMalloc(&xq, t * p.k));
        CK(cudaMalloc(&xs, groups * stride * 4));
        fill_e4m3<<<256, 256>>>(xq, t * p.k, 500 + i, 300.f);
        fill_f32<<<64, 256>>>(xs, groups * stride, 600 + i, 1e-3f, 0.5f);
        std::vector<void*> tout(kVariants);
        std::vector<__nv_bfloat16> ref(t * p.n), o(t * p.n);
        for (int v = 0; v < kVariants; ++v) {
          CK(cudaMalloc(&tout[v], t * p.n * 2));
          CK(cudaMemset(tout[v], 0xff, t * p.n * 2));  // NaN poison
          CK(kTokens[v](tout[v], xq, xs, stride, w[0][i].w, w[0][i].s, t, p.n, p.k, st));
          CK(cudaStreamSynchronize(st));
          CK(cudaMemcpy(v == 0 ? ref.data() : o.data(), tout[v], t * p.n * 2,
                        cudaMemcpyDeviceToHost));
          if (v > 0) printf("  %s %s T=%lld: %s vs %s max|d|/max|ref| %.2e\n", m.name, p.name,
                            (long long)t, kNames[v], kNames[0], compare(ref, o));
        }
        std::vector<Call> calls;
        for (int c = 0; c < 24; ++c) calls.push_back({i, w[c % m.layers][i]});
        std::vector<float> best(kVariants, 1e30f);
        for (int r = 0; r < rounds; ++r)
          for (int v = 0; v < kVariants; ++v)
            best[v] = std::min(best[v], time_tokens(v, calls, m.projs, t, xq, xs, stride, tout[v],
                                                    st, 20) / calls.size());
        printf("%s %-8s N=%-6lld K=%-6lld T=%-2lld:", m.name, p.name, (long long)p.n,
               (long long)p.k, (long long)t);
        for (int v = 0; v < kVariants; ++v)
          printf("  %s %.2f us %.2f TB/s (%.3fx)", kNames[v], best[v],
                 weight_bytes(p) / (best[v] * 1e6), best[0] / best[v]);
        printf("\n");
        for (auto* x : tout) CK(cudaFree(x));
        CK(cudaFree(xq));
        CK(cudaFree(xs));
      }
    }
    for (auto& lw : w)
      for (auto& x : lw) {
        CK(cudaFree(x.w));
        CK(cudaFree(x.s));
      }
    for (auto& x : xs) CK(cudaFree(x));
    for (auto& vo : outs)
      for (auto& o : vo) CK(cudaFree(o));
  }
  return 0;
}
