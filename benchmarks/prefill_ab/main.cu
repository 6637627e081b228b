// A / B of paged_attention_prefill's sm_90 kernel without torch: variants of prefill_sm90_ws.cu,
// each compiled into a namespace of its own (build.sh), run on the same inputs, alternating, each
// shape's best time per variant printed with every round's time, and every variant's output
// compared bit for bit with variant 0's. Shapes: bench_attention_prefill.py's and more (varlen
// mixes, Qwen3-14B's group of 5, keys fewer than queries); causal, bf16, shuffled block tables.
//
//   git show HEAD:csrc/kernels/attention/prefill_sm90_ws.cu > /tmp/head.cu
//   bash benchmarks/prefill_ab/build.sh head:/tmp/head.cu \
//     tree:csrc/kernels/attention/prefill_sm90_ws.cu
//   benchmarks/prefill_ab/build/ab [rounds]  # on the GPU: the device call carries
//                                            # benchmarks/prefill_ab/build (git ignores it)
//   AB_SHAPES=bs,14B benchmarks/prefill_ab/build/ab  # only the shapes whose name holds a fragment
// prefill.cu's mma.sync kernel joins as a variant too: mma:benchmarks/prefill_ab/mma_kernel.cu, and
// the deterministic mode's decode (decode shapes only): dpo:benchmarks/prefill_ab/decode_kernel.cu.
// Where a variant's time goes: mkprof.py writes a clock64-instrumented copy of a kernel file (a
// variant like any other; it prints cycles a work tile per phase and shape, see its header).
#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <random>
#include <string>
#include <vector>

#include "qwen3_kernels/launchers.h"
#include "prefill_common.cuh"
#include "ab_common.cuh"

using qwen3_kernels::prefill::PrefillParams;

#define DECL(NS)                                                                              \
  namespace NS {                                                                              \
  enum class DType;                                                                           \
  namespace prefill {                                                                         \
  struct PrefillParams;                                                                       \
  cudaError_t launch_sm90_ws(const PrefillParams&, int, int, int, DType, bool, bool,         \
                             cudaStream_t);                                                  \
  }                                                                                           \
  }
#define CALL(NS)                                                                              \
  [](const PrefillParams& p, int tq, int b, int mq, bool pers, cudaStream_t s) {             \
    return NS::prefill::launch_sm90_ws(reinterpret_cast<const NS::prefill::PrefillParams&>(p), \
                                       tq, b, mq, static_cast<NS::DType>(1), false, pers, s); \
  }
#include "variants.h"
using Launch = cudaError_t (*)(const PrefillParams&, int, int, int, bool, cudaStream_t);
static const Launch kLaunch[] = {VARIANT_CALLS_LIST};
static const char* kNames[] = {VARIANT_NAMES_LIST};
constexpr int kVariants = sizeof(kLaunch) / sizeof(kLaunch[0]);

struct Shape {
  std::string name;
  std::vector<int> lq, lk;  // per sequence
  int hq, hkv, bs;
};

int main(int argc, char** argv) {
  const int rounds = argc > 1 ? atoi(argv[1]) : 5;
  const int iters = 20;
  std::vector<Shape> shapes;
  auto uni = [](int b, int l) { return std::vector<int>(b, l); };
  shapes.push_back({"4k", uni(1, 4096), uni(1, 4096), 32, 8, 256});
  shapes.push_back({"4k 16/8", uni(1, 4096), uni(1, 4096), 16, 8, 256});
  shapes.push_back({"8x2k", uni(8, 2048), uni(8, 2048), 32, 8, 256});
  shapes.push_back({"16x1k", uni(16, 1024), uni(16, 1024), 32, 8, 256});
  shapes.push_back({"64x256", uni(64, 256), uni(64, 256), 32, 8, 256});
  shapes.push_back({"4k bs16", uni(1, 4096), uni(1, 4096), 32, 8, 16});
  shapes.push_back({"8x2k bs16", uni(8, 2048), uni(8, 2048), 32, 8, 16});
  // the cache's other page sizes (the producer's gathers take longer the smaller the page)
  for (int bs : {32, 64, 128}) {
    shapes.push_back({"4k bs" + std::to_string(bs), uni(1, 4096), uni(1, 4096), 32, 8, bs});
    shapes.push_back({"16x1k bs" + std::to_string(bs), uni(16, 1024), uni(16, 1024), 32, 8, bs});
  }
  shapes.push_back({"16x1k bs16", uni(16, 1024), uni(16, 1024), 32, 8, 16});
  {
    std::mt19937 r(1);
    std::vector<int> l(24);
    for (auto& x : l) x = 100 + r() % 925;
    shapes.push_back({"mix24 100..1024", l, l, 32, 8, 256});
  }
  // more draws of the engine's prefill steps: prompts of mixed lengths, and prompt chunks over
  // cached prefixes (the persistent order's balance depends on the draw)
  auto mix = [](unsigned seed, int n, int lo, int hi) {
    std::mt19937 r(seed);
    std::vector<int> l(n);
    for (auto& x : l) x = lo + r() % (hi - lo + 1);
    return l;
  };
  for (unsigned seed : {2u, 3u}) {
    const std::vector<int> l = mix(seed, 24, 100, 1024);
    shapes.push_back({"mix24 s" + std::to_string(seed), l, l, 32, 8, 256});
  }
  {
    const std::vector<int> l16 = mix(4, 16, 100, 2048), l48 = mix(5, 48, 64, 512);
    shapes.push_back({"mix16 100..2048", l16, l16, 32, 8, 256});
    shapes.push_back({"mix48 64..512", l48, l48, 32, 8, 256});
    shapes.push_back({"mix16 bs16", l16, l16, 32, 8, 16});
    std::vector<int> lk = mix(6, 8, 512, 4096);
    shapes.push_back({"chunks 8 x 512/512..4k", uni(8, 512), lk, 32, 8, 256});
  }
  shapes.push_back({"prefix 2k/8k", uni(1, 2048), uni(1, 8192), 32, 8, 256});
  shapes.push_back({"prefix 512/16k", uni(1, 512), uni(1, 16384), 32, 8, 256});
  shapes.push_back({"14B 4x1000 40/8", uni(4, 1000), uni(4, 1000), 40, 8, 256});
  shapes.push_back({"lk<lq 3 seqs", {300, 77, 1000}, {200, 50, 1000}, 32, 8, 256});
  shapes.push_back({"16k one-tile", uni(1, 16384), uni(1, 16384), 32, 8, 256});
  // decode-shaped: one query a sequence (its rows are those of a decode step)
  shapes.push_back({"decode 64 x 1/1000", uni(64, 1), uni(64, 1000), 32, 8, 16});
  shapes.push_back({"decode 8 x 1/300..2047", uni(8, 1), {300, 2047, 128, 129, 1, 640, 1500, 77},
                    32, 8, 256});
  shapes.push_back({"decode 1 x 1/384", uni(1, 1), uni(1, 384), 32, 8, 16});
  shapes.push_back({"decode 256 x 1/1000", uni(256, 1), uni(256, 1000), 32, 8, 16});
  {
    std::mt19937 r(2);
    std::vector<int> l(256);
    for (auto& x : l) x = 100 + r() % 1948;
    shapes.push_back({"decode 256 x 1/100..2047 16/8", uni(256, 1), l, 16, 8, 16});
  }
  cudaStream_t st;
  CK(cudaStreamCreate(&st));
  int32_t* d_counter;  // the persistent grid's work counter (a variant that has one zeroes it)
  CK(cudaMalloc(&d_counter, sizeof(int32_t)));
  cudaEvent_t e0, e1;
  CK(cudaEventCreate(&e0));
  CK(cudaEventCreate(&e1));
  printf("variants:");
  for (int v = 0; v < kVariants; ++v) printf(" %s", kNames[v]);
  printf("\n");
  // AB_SHAPES: a comma-separated list of name fragments; only shapes whose name holds one run
  const char* only = getenv("AB_SHAPES");
  auto wanted = [&](const std::string& name) {
    if (only == nullptr || *only == 0) return true;
    std::string list = only;
    for (size_t at = 0; at <= list.size();) {
      const size_t end = std::min(list.find(',', at), list.size());
      if (end > at && name.find(list.substr(at, end - at)) != std::string::npos) return true;
      at = end + 1;
    }
    return false;
  };
  for (const Shape& sh : shapes) {
    if (!wanted(sh.name)) continue;
    const int B = sh.lq.size();
    std::vector<int> cu(B + 1, 0);
    int max_q = 0, max_blocks = 0, total_blocks = 0;
    double flops = 0;
    for (int b = 0; b < B; ++b) {
      cu[b + 1] = cu[b] + sh.lq[b];
      max_q = std::max(max_q, sh.lq[b]);
      const int nb = (sh.lk[b] + sh.bs - 1) / sh.bs;
      max_blocks = std::max(max_blocks, nb);
      total_blocks += nb;
      for (int i = 0; i < sh.lq[b]; ++i) flops += 4.0 * 128 * sh.hq * (sh.lk[b] - sh.lq[b] + i + 1);
    }
    const int tq = cu[B];
    std::vector<int> perm(total_blocks);
    for (int i = 0; i < total_blocks; ++i) perm[i] = i;
    std::shuffle(perm.begin(), perm.end(), std::mt19937(7));
    std::vector<int> table((size_t)B * max_blocks, 0);
    int used = 0;
    for (int b = 0; b < B; ++b) {
      const int nb = (sh.lk[b] + sh.bs - 1) / sh.bs;
      for (int i = 0; i < nb; ++i) table[(size_t)b * max_blocks + i] = perm[used++];
    }
    const size_t q_elems = (size_t)tq * sh.hq * 128;
    const size_t kv_elems = (size_t)total_blocks * sh.bs * sh.hkv * 128;
    __nv_bfloat16 *q, *k, *v;
    CK(cudaMalloc(&q, q_elems * 2));
    CK(cudaMalloc(&k, kv_elems * 2));
    CK(cudaMalloc(&v, kv_elems * 2));
    fill_bf16<<<1024, 256>>>(q, q_elems, 1, 2.f);
    fill_bf16<<<1024, 256>>>(k, kv_elems, 2, 2.f);
    fill_bf16<<<1024, 256>>>(v, kv_elems, 3, 2.f);
    std::vector<__nv_bfloat16*> outs(kVariants);
    for (auto& o : outs) {
      CK(cudaMalloc(&o, q_elems * 2));
      CK(cudaMemset(o, 0xff, q_elems * 2));  // NaN poison
    }
    int *d_cu, *d_lk, *d_table;
    CK(cudaMalloc(&d_cu, (B + 1) * 4));
    CK(cudaMalloc(&d_lk, B * 4));
    CK(cudaMalloc(&d_table, table.size() * 4));
    CK(cudaMemcpy(d_cu, cu.data(), (B + 1) * 4, cudaMemcpyHostToDevice));
    CK(cudaMemcpy(d_lk, sh.lk.data(), B * 4, cudaMemcpyHostToDevice));
    CK(cudaMemcpy(d_table, table.data(), table.size() * 4, cudaMemcpyHostToDevice));
    PrefillParams p{};
    p.q = q;
    p.k_cache = k;
    p.v_cache = v;
    p.cu_seqlens_q = d_cu;
    p.seq_lens_k = d_lk;
    p.block_tables = d_table;
    p.num_q_heads = sh.hq;
    p.num_kv_heads = sh.hkv;
    p.group = sh.hq / sh.hkv;
    p.block_size_log2 = __builtin_ctz(sh.bs);
    p.max_blocks = max_blocks;
    p.scale_log2 = 1.4426950408889634f / sqrtf(128.f);
    p.v_scale = 1.f;
    p.tile_counter = d_counter;
    const bool pers = max_q <= 8192;  // prefill.cu's choice of grid
    for (int vi = 0; vi < kVariants; ++vi) {
      p.out = outs[vi];
      CK(kLaunch[vi](p, tq, B, max_q, pers, st));
    }
    CK(cudaStreamSynchronize(st));
    std::vector<uint16_t> ref(q_elems), got(q_elems);
    CK(cudaMemcpy(ref.data(), outs[0], q_elems * 2, cudaMemcpyDeviceToHost));
    size_t nan0 = 0;
    for (size_t i = 0; i < q_elems; ++i) nan0 += (ref[i] & 0x7f80) == 0x7f80;
    std::vector<float> best(kVariants, 1e30f);
    std::vector<std::vector<float>> all(kVariants);
    for (int r = 0; r < rounds; ++r) {
      for (int vv = 0; vv < kVariants; ++vv) {
        const int vi = (r & 1) ? kVariants - 1 - vv : vv;
        p.out = outs[vi];
        CK(cudaEventRecord(e0, st));
        for (int it = 0; it < iters; ++it) CK(kLaunch[vi](p, tq, B, max_q, pers, st));
        CK(cudaEventRecord(e1, st));
        CK(cudaEventSynchronize(e1));
        float ms;
        CK(cudaEventElapsedTime(&ms, e0, e1));
        const float us = ms * 1000.f / iters;
        all[vi].push_back(us);
        best[vi] = std::min(best[vi], us);
      }
    }
    printf("%-18s tq %6d  v0 %8.1f us (%3.0f TF/s) nan %zu |", sh.name.c_str(), tq, best[0],
           flops / best[0] / 1e6, nan0);
    for (int vi = 1; vi < kVariants; ++vi) {
      CK(cudaMemcpy(got.data(), outs[vi], q_elems * 2, cudaMemcpyDeviceToHost));
      size_t diff = 0;
      for (size_t i = 0; i < q_elems; ++i) diff += ref[i] != got[i];
      printf(" %s %8.1f (%.3fx) diff %zu |", kNames[vi], best[vi], best[0] / best[vi], diff);
    }
    printf("\n");
    for (int vi = 0; vi < kVariants; ++vi) {
      printf("    %s:", kNames[vi]);
      for (float x : all[vi]) printf(" %.1f", x);
      printf("\n");
    }
    fflush(stdout);
    cudaFree(q); cudaFree(k); cudaFree(v);
    for (auto o : outs) cudaFree(o);
    cudaFree(d_cu); cudaFree(d_lk); cudaFree(d_table);
  }
  return 0;
}
