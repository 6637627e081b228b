// How fast can a kernel read a decode weight, by the order it reads it in? A standalone probe (no
// torch): the GEMV's access pattern (linear_gemv.cu: a warp streams R rows, L 16-byte loads a
// lane per stage, the next stage in flight; "pairs": linear_silu_and_mul's gate + up rows) with
// and without its arithmetic, a CTA reading whole rows in order ("rows"), and plain linear reads
// of the same bytes ("linear": CTAs read contiguous chunks, grid-strided or one chunk a CTA).
// Load flavours: the L2 hint of 256-byte lines, none ("nc"), plain, streaming (.cs).
//
// Build here, run on the H200 (the binary needs only the driver):
//   nvcc -O3 -std=c++17 -gencode=arch=compute_90a,code=sm_90a -I csrc/include \
//        benchmarks/read_probe.cu -o read_probe
//   ./read_probe 3          # every variant, every Qwen3-8B projection size, three rounds
// Prints us a call and TB/s of weight read (8 buffers of 201 MB rotated past the 60 MB L2; events
// around 40 back-to-back plain launches). RESULTS.md (2026-12-02) has what it showed; note that a
// pattern's gain here need not survive in the real kernel under PDL (one row a warp did not).
#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include <cstdio>
#include <cstdlib>
#include <functional>
#include <string>
#include <vector>

#include "qwen3_kernels/common.cuh"
#include "qwen3_kernels/tuning.cuh"

using qwen3_kernels::load_stream;
using qwen3_kernels::to_float8;
using qwen3_kernels::warp_sum;
using bf16 = __nv_bfloat16;

#define CHECK(x)                                                                  \
  do {                                                                            \
    cudaError_t e_ = (x);                                                         \
    if (e_ != cudaSuccess) {                                                      \
      std::fprintf(stderr, "%s:%d %s\n", __FILE__, __LINE__, cudaGetErrorString(e_)); \
      std::exit(1);                                                               \
    }                                                                             \
  } while (0)

// Load flavours: 0 the GEMV's (L1 bypassed, 256-byte L2 lines), 1 nc without the L2 size hint,
// 2 a plain global load, 3 streaming (.cs, evict first).
template <int H>
__device__ __forceinline__ uint4 ld16(const void* p) {
  uint4 r;
  if constexpr (H == 0) {
    r = load_stream<true>(p);
  } else if constexpr (H == 1) {
    r = load_stream<false>(p);
  } else if constexpr (H == 2) {
    asm volatile("ld.global.v4.u32 {%0, %1, %2, %3}, [%4];"
                 : "=r"(r.x), "=r"(r.y), "=r"(r.z), "=r"(r.w) : "l"(p));
  } else {
    asm volatile("ld.global.cs.v4.u32 {%0, %1, %2, %3}, [%4];"
                 : "=r"(r.x), "=r"(r.y), "=r"(r.z), "=r"(r.w) : "l"(p));
  }
  return r;
}

// The GEMV's pattern at one token: warp (4 b + w) owns rows R (4 b + w) .. + R - 1 over all of k;
// a stage is L loads a lane (L / R 256-column slices of each row), the next stage issued before
// this one is consumed. kMath: the GEMV's converts and FMAs against x; otherwise an xor.
// kPairs: linear_silu_and_mul's rows (w is [gate; up]: a warp streams gate rows j0 .. j0 + R/2 - 1
// and the up rows n/2 + j0 ..), not R adjacent rows.
// kPdl (both probes): launched with PDL as the engine's graphs launch the GEMV (pdl_early_late):
// the first stage of weight loads before griddepcontrol.wait, launch_dependents after the stores.
template <int R, int L, int H, bool kMath, bool kPairs = false, bool kPdl = false>
__global__ void __launch_bounds__(128) gemv_pattern(float* out, const bf16* x, const bf16* w,
                                                    int n, int k) {
  constexpr int U = L / R, kStep = U * 256;
  constexpr int P = kPairs ? R / 2 : R;
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  const int j0 = (blockIdx.x * 4 + warp) * P;
  if (j0 >= (kPairs ? n / 2 : n)) return;
  auto row = [&](int r) { return kPairs && r >= P ? n / 2 + j0 + (r - P) : j0 + r; };
  const int lc = 8 * lane;
  float acc[R] = {};
  uint32_t h = 0;
  uint4 cur[R][U];
#pragma unroll
  for (int u = 0; u < U; ++u)
#pragma unroll
    for (int r = 0; r < R; ++r) cur[r][u] = ld16<H>(w + static_cast<int64_t>(row(r)) * k + u * 256 + lc);
  if constexpr (kPdl) qwen3_kernels::pdl_wait();
  for (int kk = 0; kk < k; kk += kStep) {
    uint4 nxt[R][U];
#pragma unroll
    for (int u = 0; u < U; ++u)
#pragma unroll
      for (int r = 0; r < R; ++r) {
        const int c = kk + kStep + u * 256 + lc;
        nxt[r][u] = c < k ? ld16<H>(w + static_cast<int64_t>(row(r)) * k + c) : make_uint4(0, 0, 0, 0);
      }
#pragma unroll
    for (int u = 0; u < U; ++u) {
      if constexpr (kMath) {
        float xf[8];
        to_float8<bf16>(__ldg(reinterpret_cast<const uint4*>(x + kk + u * 256 + lc)), xf);
#pragma unroll
        for (int r = 0; r < R; ++r) {
          float wf[8];
          to_float8<bf16>(cur[r][u], wf);
#pragma unroll
          for (int e = 0; e < 8; ++e) acc[r] = fmaf(wf[e], xf[e], acc[r]);
        }
      } else {
#pragma unroll
        for (int r = 0; r < R; ++r) h ^= cur[r][u].x ^ cur[r][u].y ^ cur[r][u].z ^ cur[r][u].w;
      }
    }
#pragma unroll
    for (int u = 0; u < U; ++u)
#pragma unroll
      for (int r = 0; r < R; ++r) cur[r][u] = nxt[r][u];
  }
#pragma unroll
  for (int r = 0; r < R; ++r) {
    const float s = warp_sum(acc[r] + static_cast<float>(h & 1u));
    if (lane == r) out[j0 + r] = s;
  }
  if constexpr (kPdl) qwen3_kernels::pdl_launch_dependents();
}

// Linear reads: CTA b reads chunks b, b + G, b + 2G, ... of `chunk` bytes (G = gridDim.x); within
// a chunk, stages of L coalesced loads a thread (L * 2 KB contiguous a CTA), the next stage in
// flight. G = bytes / chunk: one chunk a CTA (the GEMV's CTA count at chunk = its 64 KB).
template <int L, int H>
__global__ void __launch_bounds__(128) linear_read(float* out, const uint4* w, int64_t n16,
                                                   int chunk16) {
  constexpr int kStage = L * 128;  // 16-byte words a CTA reads per stage
  uint32_t h = 0;
  const int64_t stages_per_chunk = chunk16 / kStage;
  const int64_t total_stages = n16 / kStage;
  // the CTA's s-th stage is word offset of stage (chunk, i)
  auto offset = [&](int64_t s) -> int64_t {
    const int64_t c = blockIdx.x + (s / stages_per_chunk) * gridDim.x;
    return (c * stages_per_chunk + s % stages_per_chunk) * kStage;
  };
  const int64_t my_stages =
      (n16 / chunk16 - blockIdx.x + gridDim.x - 1) / gridDim.x * stages_per_chunk;
  (void)total_stages;
  if (my_stages <= 0) return;
  uint4 cur[L];
  int64_t o = offset(0);
#pragma unroll
  for (int l = 0; l < L; ++l) cur[l] = ld16<H>(w + o + l * 128 + threadIdx.x);
  for (int64_t s = 0; s < my_stages; ++s) {
    uint4 nxt[L];
    if (s + 1 < my_stages) {
      o = offset(s + 1);
#pragma unroll
      for (int l = 0; l < L; ++l) nxt[l] = ld16<H>(w + o + l * 128 + threadIdx.x);
    } else {
#pragma unroll
      for (int l = 0; l < L; ++l) nxt[l] = make_uint4(0, 0, 0, 0);
    }
#pragma unroll
    for (int l = 0; l < L; ++l) h ^= cur[l].x ^ cur[l].y ^ cur[l].z ^ cur[l].w;
#pragma unroll
    for (int l = 0; l < L; ++l) cur[l] = nxt[l];
  }
  if (h == 0x12345678u) out[blockIdx.x] = 1.f;  // keeps the loads
}

// The CTA reads whole rows in order: a CTA of 128 threads owns RB consecutive weight rows (kPairs:
// gate rows j0 .. j0 + RB/2 - 1 and up rows n/2 + j0 ..); load l of stage s of thread t is the
// row's 16 bytes at column 8 (s L 128 + l 128 + t), so a stage is L * 2 KB contiguous of one row,
// the next stage in flight across row boundaries too. Per-thread sums per row, one CTA reduction.
template <int RB, int L, int H, bool kPairs, bool kPdl = false>
__global__ void __launch_bounds__(128) row_linear(float* out, const bf16* x, const bf16* w, int n,
                                                  int k) {
  constexpr int P = kPairs ? RB / 2 : RB;
  const int j0 = blockIdx.x * P;
  const int t = threadIdx.x, warp = t / 32, lane = t % 32;
  const int kc = k / 8;                                 // 16-byte words a row
  const int spr = (kc + L * 128 - 1) / (L * 128);       // stages a row
  auto row = [&](int r) { return kPairs && r >= P ? n / 2 + j0 + (r - P) : j0 + r; };
  const uint4* xv = reinterpret_cast<const uint4*>(x);
  float acc[RB] = {};
  uint4 cur[L];
  auto load = [&](uint4(&b)[L], int r, int st) {
    const uint4* base = reinterpret_cast<const uint4*>(w + static_cast<int64_t>(row(r)) * k);
#pragma unroll
    for (int l = 0; l < L; ++l) {
      const int c = st * L * 128 + l * 128 + t;
      b[l] = c < kc ? ld16<H>(base + c) : make_uint4(0, 0, 0, 0);
    }
  };
  load(cur, 0, 0);
  if constexpr (kPdl) qwen3_kernels::pdl_wait();
#pragma unroll
  for (int r = 0; r < RB; ++r) {
    for (int st = 0; st < spr; ++st) {
      uint4 nxt[L];
      if (st + 1 < spr) {
        load(nxt, r, st + 1);
      } else if (r + 1 < RB) {
        load(nxt, r + 1, 0);
      } else {
#pragma unroll
        for (int l = 0; l < L; ++l) nxt[l] = make_uint4(0, 0, 0, 0);
      }
#pragma unroll
      for (int l = 0; l < L; ++l) {
        const int c = st * L * 128 + l * 128 + t;
        if (c < kc) {
          float xf[8], wf[8];
          to_float8<bf16>(__ldg(xv + c), xf);
          to_float8<bf16>(cur[l], wf);
#pragma unroll
          for (int e = 0; e < 8; ++e) acc[r] = fmaf(wf[e], xf[e], acc[r]);
        }
      }
#pragma unroll
      for (int l = 0; l < L; ++l) cur[l] = nxt[l];
    }
  }
  __shared__ float part[4][RB];
#pragma unroll
  for (int r = 0; r < RB; ++r) {
    const float v = warp_sum(acc[r]);
    if (lane == 0) part[warp][r] = v;
  }
  __syncthreads();
  if (t < RB) out[row(t)] = part[0][t] + part[1][t] + part[2][t] + part[3][t];
  if constexpr (kPdl) qwen3_kernels::pdl_launch_dependents();
}

struct Shape {
  const char* name;
  int n, k;
};

int main(int argc, char** argv) {
  const int rounds = argc > 1 ? std::atoi(argv[1]) : 2;
  const std::vector<Shape> shapes = {
      {"gate_up", 24576, 4096}, {"down", 4096, 12288}, {"qkv", 6144, 4096}, {"o_proj", 4096, 4096}};
  const int64_t max_bytes = int64_t{24576} * 4096 * 2;
  const int nbuf = 8;  // 8 x 201 MB: every call reads a buffer not in L2
  std::vector<void*> bufs(nbuf);
  for (auto& b : bufs) {
    CHECK(cudaMalloc(&b, max_bytes));
    CHECK(cudaMemset(b, 0x3c, max_bytes));
  }
  bf16* x;
  float* out;
  CHECK(cudaMalloc(&x, 12288 * 2));
  CHECK(cudaMemset(x, 0x3c, 12288 * 2));
  CHECK(cudaMalloc(&out, 1 << 22));
  cudaDeviceProp prop;
  CHECK(cudaGetDeviceProperties(&prop, 0));
  const int sms = prop.multiProcessorCount;
  std::printf("device %s, %d SMs, L2 %d MB\n", prop.name, sms, prop.l2CacheSize >> 20);

  using Launch = std::function<void(const void*, const Shape&)>;
  struct Variant {
    std::string name;
    Launch launch;
  };
  std::vector<Variant> variants;
  // pdl: cudaLaunchKernelEx with programmatic stream serialization (the kernel must be a kPdl one)
  auto go = [&](auto kernel, unsigned grid, bool pdl, const void* w, const Shape& s) {
    if (pdl) {
      CHECK(qwen3_kernels::launch_ex(kernel, dim3(grid), dim3(128), cudaStream_t{}, true, 1, out, x,
                                     static_cast<const bf16*>(w), s.n, s.k));
    } else {
      kernel<<<grid, 128>>>(out, x, static_cast<const bf16*>(w), s.n, s.k);
    }
  };
  auto gemv = [&](auto kernel, int r, bool pdl = false) {
    return [=](const void* w, const Shape& s) { go(kernel, (s.n / r + 3) / 4, pdl, w, s); };
  };
  auto pairs = [&](auto kernel, int r, bool pdl = false) {  // (n / 2) / (r / 2) warps
    return [=](const void* w, const Shape& s) { go(kernel, (s.n / r + 3) / 4, pdl, w, s); };
  };
  auto rows = [&](auto kernel, int p, bool pdl = false) {  // n / p CTAs (kPairs: p = RB)
    return [=](const void* w, const Shape& s) { go(kernel, s.n / p, pdl, w, s); };
  };
  // gate_up as linear_silu_and_mul streams it (gate and up rows in one warp; the other shapes'
  // rows read the same way: timing only), then a CTA reading whole gate and up rows
  variants.push_back({"pairs R2 L4 nc", pairs(gemv_pattern<2, 4, 1, true, true>, 2)});
  variants.push_back({"pairs R2 L4 nc pdl", pairs(gemv_pattern<2, 4, 1, true, true, true>, 2, true)});
  variants.push_back({"rows pairs RB8 L4 nc", rows(row_linear<8, 4, 1, true>, 8)});
  variants.push_back({"rows pairs RB8 L4 nc pdl", rows(row_linear<8, 4, 1, true, true>, 8, true)});
  variants.push_back({"rows pairs RB4 L4 nc pdl", rows(row_linear<4, 4, 1, true, true>, 4, true)});
  variants.push_back({"rows pairs RB16 L4 nc pdl", rows(row_linear<16, 4, 1, true, true>, 16, true)});
  // the other projections' rows
  variants.push_back({"gemv R2 L4 nc", gemv(gemv_pattern<2, 4, 1, true>, 2)});
  variants.push_back({"gemv R2 L4 nc pdl", gemv(gemv_pattern<2, 4, 1, true, false, true>, 2, true)});
  variants.push_back({"gemv R1 L8 nc", gemv(gemv_pattern<1, 8, 1, true>, 1)});
  variants.push_back({"gemv R1 L8 nc pdl", gemv(gemv_pattern<1, 8, 1, true, false, true>, 1, true)});
  variants.push_back({"gemv R1 L4 nc pdl", gemv(gemv_pattern<1, 4, 1, true, false, true>, 1, true)});
  variants.push_back({"rows RB1 L4 nc pdl", rows(row_linear<1, 4, 1, false, true>, 1, true)});
  variants.push_back({"rows RB4 L4 nc pdl", rows(row_linear<4, 4, 1, false, true>, 4, true)});
  variants.push_back({"rows RB8 L4 nc pdl", rows(row_linear<8, 4, 1, false, true>, 8, true)});
  auto linear = [&](auto kernel, int l, int64_t chunk, int grid_per_sm) {
    return [=](const void* w, const Shape& s) {
      const int64_t bytes = int64_t{s.n} * s.k * 2;
      const int64_t ch = chunk > 0 ? chunk : int64_t{l} * 2048;
      const int64_t chunks = bytes / ch;
      const int64_t grid = grid_per_sm > 0 ? std::min<int64_t>(chunks, int64_t{sms} * grid_per_sm) : chunks;
      kernel<<<static_cast<unsigned>(grid), 128>>>(out, static_cast<const uint4*>(w), bytes / 16,
                                                   static_cast<int>(ch / 16));
    };
  };
  variants.push_back({"linear L4 16KB chunk a CTA nc", linear(linear_read<4, 1>, 4, 16384, 0)});

  cudaEvent_t e0, e1;
  CHECK(cudaEventCreate(&e0));
  CHECK(cudaEventCreate(&e1));
  const int iters = 40;
  for (int round = 0; round < rounds; ++round) {
    for (const Shape& s : shapes) {
      const double bytes = double(s.n) * s.k * 2;
      std::printf("\n[round %d] %s N %d K %d (%.1f MB)\n", round, s.name, s.n, s.k, bytes / 1e6);
      for (const Variant& v : variants) {
        for (int i = 0; i < 2 * nbuf; ++i) v.launch(bufs[i % nbuf], s);
        CHECK(cudaGetLastError());
        CHECK(cudaEventRecord(e0));
        for (int i = 0; i < iters; ++i) v.launch(bufs[i % nbuf], s);
        CHECK(cudaEventRecord(e1));
        CHECK(cudaEventSynchronize(e1));
        float ms;
        CHECK(cudaEventElapsedTime(&ms, e0, e1));
        const double us = 1e3 * ms / iters;
        std::printf("  %-36s %8.2f us  %5.2f TB/s\n", v.name.c_str(), us, bytes / us / 1e6);
      }
    }
  }
  return 0;
}
