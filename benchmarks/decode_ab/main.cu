// A / B of paged_attention_decode without torch: variants of decode.cu, each compiled into a
// namespace of its own (build.sh), run on the same inputs, alternating; each shape's best time per
// variant is printed with its K/V read rate, and every variant's output is compared with the first
// one run's (largest absolute difference; bf16 outputs, so a different summation order shows as a
// few ulps). Shapes: bench_attention_decode.py's (Qwen3-8B heads, blocks of 16), the 8B
// workload's decode step (176 sequences of 100..2047 keys) and batch 1, each with a bf16 and an
// fp8 cache, B=32 x 4k's K/V bytes and (sequence, kv head) pairs again with one or two kv heads
// (4/1, 8/2: a kv head's keys then lie 128 / 256 bytes apart in an e4m3 cache instead of 1 KB)
// and in pages of 256, and the last two again in the batch-invariant launch ("inv", the
// deterministic mode's). Timed as CUDA-graph replays of 20 calls (no host time between launches,
// as in the engine). The cache is not rotated: a batch-1 shape's K/V (a few MB) stay in the L2
// between launches, so those rows compare variants, not HBM rates.
#include <cuda_bf16.h>
#include <cuda_fp8.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <random>
#include <string>
#include <vector>

#include "ab_common.cuh"

struct Args {
  void* out;
  const void* q;
  const void* k;
  const void* v;
  const int32_t* tables;
  const int32_t* lens;
  float* ws;
  int batch, hq, hkv, bs, max_blocks, max_splits, num_sms;
  bool fp8, invariant;
  float k_scale, v_scale;
};

#define DECL(NS)                                                                              \
  namespace NS {                                                                              \
  enum class DType { kFloat16, kBFloat16 };                                                   \
  struct KvCache {                                                                            \
    bool fp8;                                                                                 \
    float k_scale, v_scale;                                                                   \
  };                                                                                          \
  cudaError_t paged_attention_decode(void*, const void*, const void*, const void*,            \
                                     const int32_t*, const int32_t*, float*, int, int, int,   \
                                     int, int, int, int, float, int, bool, DType, KvCache,    \
                                     cudaStream_t, const int32_t*, const int32_t*, int);      \
  }
#define CALL(NS)                                                                              \
  [](const Args& a, cudaStream_t s) {                                                        \
    return NS::paged_attention_decode(                                                        \
        a.out, a.q, a.k, a.v, a.tables, a.lens, a.ws, a.batch, a.hq, a.hkv, 128, a.bs,        \
        a.max_blocks, a.max_splits, 0.08838834764831845f, a.num_sms, a.invariant,             \
        NS::DType::kBFloat16, NS::KvCache{a.fp8, a.k_scale, a.v_scale}, s, nullptr, nullptr, \
        0);                                                                                   \
  }
#include "variants.h"
using Launch = cudaError_t (*)(const Args&, cudaStream_t);
static const Launch kLaunch[] = {VARIANT_CALLS_LIST};
static const char* kNames[] = {VARIANT_NAMES_LIST};
constexpr int kVariants = sizeof(kLaunch) / sizeof(kLaunch[0]);

struct Shape {
  std::string name;
  std::vector<int> lens;
  int hq, hkv, bs;
  bool fp8;
  bool invariant = false;
};

// ab [rounds] [variant ...]: the named variants only (default: all), e.g. to rerun without one
// whose launch faulted (a device fault ends the process: every later shape would be lost).
int main(int argc, char** argv) {
  const int rounds = argc > 1 ? atoi(argv[1]) : 5;
  std::vector<int> run;  // the variants to run; the first is the reference
  for (int v = 0; v < kVariants; ++v) {
    bool wanted = argc <= 2;
    for (int i = 2; i < argc; ++i) wanted = wanted || std::string(argv[i]) == kNames[v];
    if (wanted) run.push_back(v);
  }
  if (run.empty()) {
    printf("no variant named\n");
    return 1;
  }
  const int iters = 20;
  cudaDeviceProp prop;
  CK(cudaGetDeviceProperties(&prop, 0));
  std::mt19937 rng(1234);
  std::vector<Shape> shapes;
  for (bool fp8 : {true, false}) {
    const char* kv = fp8 ? " fp8" : " bf16";
    auto uni = [](int b, int l) { return std::vector<int>(b, l); };
    std::vector<int> mix(176);
    for (int& l : mix) l = 100 + static_cast<int>(rng() % 1948);
    shapes.push_back({std::string("B=32 ctx=4096") + kv, uni(32, 4096), 32, 8, 16, fp8});
    shapes.push_back({std::string("B=128 ctx=1024") + kv, uni(128, 1024), 32, 8, 16, fp8});
    shapes.push_back({std::string("B=16 ctx=2048") + kv, uni(16, 2048), 32, 8, 16, fp8});
    shapes.push_back({std::string("B=1 ctx=32768") + kv, uni(1, 32768), 32, 8, 16, fp8});
    // B=32 x 4k's bytes and pairs with 1 / 2 kv heads (a kv head's keys closer together)
    shapes.push_back({std::string("B=256 ctx=4096 4/1") + kv, uni(256, 4096), 4, 1, 16, fp8});
    shapes.push_back({std::string("B=32 ctx=4096 bs256") + kv, uni(32, 4096), 32, 8, 256, fp8});
    shapes.push_back(
        {std::string("B=256 ctx=4096 4/1 bs256") + kv, uni(256, 4096), 4, 1, 256, fp8});
    shapes.push_back({std::string("B=128 ctx=4096 8/2") + kv, uni(128, 4096), 8, 2, 16, fp8});
    shapes.push_back({std::string("B=176 ctx=100..2047") + kv, mix, 32, 8, 16, fp8});
    // the same lengths, longest first: the batch's rows in the order the CTAs are dispatched
    std::vector<int> desc = mix;
    std::sort(desc.begin(), desc.end(), [](int x, int y) { return x > y; });
    shapes.push_back({std::string("B=176 longest first") + kv, desc, 32, 8, 16, fp8});
    std::vector<int> mix256(256);
    for (int& l : mix256) l = 100 + static_cast<int>(rng() % 1948);
    std::vector<int> desc256 = mix256;
    std::sort(desc256.begin(), desc256.end(), [](int x, int y) { return x > y; });
    shapes.push_back({std::string("B=256 ctx=100..2047") + kv, mix256, 32, 8, 16, fp8});
    shapes.push_back({std::string("B=256 longest first") + kv, desc256, 32, 8, 16, fp8});
    shapes.push_back({std::string("B=1 ctx=512") + kv, uni(1, 512), 32, 8, 16, fp8});
    shapes.push_back({std::string("B=1 ctx=1024") + kv, uni(1, 1024), 32, 8, 16, fp8});
    shapes.push_back({std::string("inv B=176 ctx=100..2047") + kv, mix, 32, 8, 16, fp8, true});
    shapes.push_back({std::string("inv B=1 ctx=4000") + kv, uni(1, 4000), 32, 8, 16, fp8, true});
  }
  printf("%s, %d SMs; variants:", prop.name, prop.multiProcessorCount);
  for (int v : run) printf(" %s", kNames[v]);
  printf("\n");
  cudaStream_t stream;
  CK(cudaStreamCreate(&stream));
  cudaEvent_t e0, e1;
  CK(cudaEventCreate(&e0));
  CK(cudaEventCreate(&e1));
  for (const Shape& sh : shapes) {
    const int batch = static_cast<int>(sh.lens.size());
    const int max_ctx = *std::max_element(sh.lens.begin(), sh.lens.end());
    const int max_blocks = (max_ctx + sh.bs - 1) / sh.bs;
    const int num_blocks = batch * max_blocks;
    const size_t elem = sh.fp8 ? 1 : 2;
    const size_t cache_elems = static_cast<size_t>(num_blocks) * sh.bs * sh.hkv * 128;
    std::vector<int32_t> perm(num_blocks);
    for (int i = 0; i < num_blocks; ++i) perm[i] = i;
    std::shuffle(perm.begin(), perm.end(), rng);
    void *q, *k, *v, *out;
    int32_t *tables, *lens;
    float* ws;
    const int max_splits = 64;
    CK(cudaMalloc(&q, static_cast<size_t>(batch) * sh.hq * 128 * 2));
    CK(cudaMalloc(&k, cache_elems * elem));
    CK(cudaMalloc(&v, cache_elems * elem));
    CK(cudaMalloc(&out, static_cast<size_t>(batch) * sh.hq * 128 * 2));
    CK(cudaMalloc(&tables, perm.size() * 4));
    CK(cudaMalloc(&lens, batch * 4));
    CK(cudaMalloc(&ws, static_cast<size_t>(batch) * sh.hq * max_splits * 129 * 4));
    CK(cudaMemcpy(tables, perm.data(), perm.size() * 4, cudaMemcpyHostToDevice));
    CK(cudaMemcpy(lens, sh.lens.data(), batch * 4, cudaMemcpyHostToDevice));
    fill_bf16<<<1024, 256>>>(static_cast<__nv_bfloat16*>(q),
                              static_cast<size_t>(batch) * sh.hq * 128, 1, 2.f);
    if (sh.fp8) {
      fill_e4m3<<<4096, 256>>>(static_cast<uint8_t*>(k), cache_elems, 2, 64.f);
      fill_e4m3<<<4096, 256>>>(static_cast<uint8_t*>(v), cache_elems, 3, 64.f);
    } else {
      fill_bf16<<<4096, 256>>>(static_cast<__nv_bfloat16*>(k), cache_elems, 2, 2.f);
      fill_bf16<<<4096, 256>>>(static_cast<__nv_bfloat16*>(v), cache_elems, 3, 2.f);
    }
    CK(cudaDeviceSynchronize());
    Args a{out, q, k, v, tables, lens, ws, batch, sh.hq, sh.hkv, sh.bs, max_blocks, max_splits,
           prop.multiProcessorCount, sh.fp8, sh.invariant, sh.fp8 ? 1.f / 64 : 1.f,
           sh.fp8 ? 1.f / 32 : 1.f};
    double kv_bytes = 0;
    for (int l : sh.lens) kv_bytes += 2.0 * l * sh.hkv * 128 * elem;
    const size_t out_elems = static_cast<size_t>(batch) * sh.hq * 128;
    std::vector<__nv_bfloat16> ref(out_elems), got(out_elems);
    std::vector<float> best(kVariants, 1e30f);
    std::vector<cudaGraphExec_t> graph(kVariants, nullptr);
    std::vector<std::vector<float>> all(kVariants);
    for (int r = 0; r < rounds; ++r) {
      for (int vi : run) {
        CK(cudaMemset(out, 0xff, out_elems * 2));  // NaN: a row left unwritten shows
        CK(kLaunch[vi](a, stream));
        CK(cudaStreamSynchronize(stream));
        if (r == 0) {
          CK(cudaMemcpy(vi == run[0] ? ref.data() : got.data(), out, out_elems * 2,
                        cudaMemcpyDeviceToHost));
          if (vi != run[0]) {
            float diff = 0.f, mag = 0.f;
            size_t bad = 0;
            for (size_t i = 0; i < out_elems; ++i) {
              const float x = __bfloat162float(ref[i]), y = __bfloat162float(got[i]);
              if (!std::isfinite(y) || !std::isfinite(x)) ++bad;
              else diff = std::max(diff, std::fabs(x - y));
              mag = std::max(mag, std::fabs(x));
            }
            printf("  %-24s %s vs %s: max |diff| %.4g (max |out| %.3g), non-finite %zu\n",
                   sh.name.c_str(), kNames[vi], kNames[run[0]], diff, mag, bad);
          }
        }
        if (graph[vi] == nullptr) {  // iters calls, captured once
          cudaGraph_t g;
          CK(cudaStreamBeginCapture(stream, cudaStreamCaptureModeThreadLocal));
          cudaError_t captured = cudaSuccess;
          for (int i = 0; i < iters && captured == cudaSuccess; ++i)
            captured = kLaunch[vi](a, stream);
          CK(cudaStreamEndCapture(stream, &g));
          CK(captured);
          CK(cudaGraphInstantiate(&graph[vi], g, 0));
          CK(cudaGraphDestroy(g));
        }
        CK(cudaGraphLaunch(graph[vi], stream));  // warm-up
        CK(cudaEventRecord(e0, stream));
        CK(cudaGraphLaunch(graph[vi], stream));
        CK(cudaEventRecord(e1, stream));
        CK(cudaEventSynchronize(e1));
        float ms = 0.f;
        CK(cudaEventElapsedTime(&ms, e0, e1));
        const float us = ms * 1000.f / iters;
        best[vi] = std::min(best[vi], us);
        all[vi].push_back(us);
      }
    }
    printf("%-24s", sh.name.c_str());
    for (int vi : run)
      printf(" | %s %.2f us %.2f TB/s", kNames[vi], best[vi], kv_bytes / best[vi] * 1e-6);
    printf("\n   rounds:");
    for (int vi : run) {
      printf(" %s", kNames[vi]);
      for (float x : all[vi]) printf(" %.1f", x);
    }
    printf("\n");
    fflush(stdout);
    CK(cudaFree(q)); CK(cudaFree(k)); CK(cudaFree(v)); CK(cudaFree(out));
    CK(cudaFree(tables)); CK(cudaFree(lens)); CK(cudaFree(ws));
    for (cudaGraphExec_t g : graph)
      if (g) CK(cudaGraphExecDestroy(g));
  }
  return 0;
}
