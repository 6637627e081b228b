// fp8::gemv: linear_fp8 at one token, a weight-streaming pass over the e4m3 weight [N, K] with
// its block scales; x [1, K] bf16 is quantized per 128-group inside every CTA (the values
// quantize_fp8 gives), so it is one launch with no workspace.
//
// Per weight byte it does half the FMAs of the bf16 GEMV (linear_gemv.cu), but on the CUDA cores
// each e4m3 pair would still cost a cvt to f16x2, two f16 -> f32 conversions and two FFMAs: about
// 2.5 instructions a byte against the bf16 GEMV's 1.5. The products go to the tensor cores
// instead (mma.sync m16n8k16, f16 in, f32 accumulation; e4m3 values and their products are exact
// in f16 and f32): a lane's 16-byte load is one cvt per byte pair and two mma, and x is the B
// operand, broadcast to all 8 columns (7 of them wasted, which costs nothing the memory would
// notice). Sm_90 has no fp8 mma.sync of its own (ptxas lowers the e4m3 one to cvt + f16 mma),
// so f16 mma after our own cvt is the same work, and it builds for sm_80 as well.
//
//   - A CTA owns 16 weight rows (the M of one mma) over all of K: N / 16 CTAs (256 for N = 4096,
//     1536 for 24576), several per SM, scheduled dynamically as in the bf16 GEMV; 8 warps.
//   - The weight goes through shared memory, 8 KB a warp: warp w copies the units w, w + 8, ...
//     of the CTA's 16 rows with cp.async. Where K <= 4096 a warp's share is at most one unit of
//     512 columns (16 x 512 bytes, a warp instruction covering 512 contiguous bytes of one row),
//     all of it issued at the start; past that a ring of two units of 256 columns (a warp
//     instruction: 256 bytes of each of two rows), so the warp's next unit is in flight while it
//     multiplies this one. With one 512-column unit in flight a warp, the whole grid issued its
//     copies together, waited and multiplied together, and the memory idled between rounds.
//     Measured (benchmarks/linear_fp8_gemv_ab, H100, 3 rounds, the ring of 256 at every K against
//     one unit of 512, us): Qwen3-8B's four projections over its 36 layers 74.2 / 74.2 a layer,
//     Qwen3-32B's over 16 layers 190.5 / 198.3; one projection back to back 8B down 20.77 / 21.30,
//     32B down 63.41 / 68.09, 32B qkv 20.33 / 21.37, but at K = 4096 8B qkv 11.16 / 11.05, o
//     6.43 / 6.35, gate_up 35.52 / 35.43: hence units of 512 there (the same SASS as one unit a
//     warp at every K). Engine, batch 1 (H100, alternating, one call each): Qwen3-32B-FP8 73.7 /
//     73.8 decode tok/s against 70.8 / 70.8; Qwen3-8B-FP8, where only down (K = 12288) takes the
//     ring, 272.4 / 272.3 against 273.3 / 273.3 (-0.3%: down's 2.6% alone does not show end to
//     end). Half the shared memory a warp (4 KB: units of 128 in a ring, or one of 256), which
//     lets the next kernel's CTAs in: 8B qkv 1.16x, but o 0.78x, down 0.94x, 8B layers 1.00x,
//     32B layers 1.06x. Lost: x quantized before the first weight copies (the copies after the
//     wait), 0.66-0.97x; the ring with the first units prefetched to L2 before the wait and
//     copied after x, 0.99x (8B layers) and 1.03x (32B layers).
//     Loading the mma fragments straight from global memory instead (a load instruction then
//     covers 64 bytes of each of 8 rows; two 256-column stages of registers a warp, 4 or 8 warps)
//     streamed slower on every 8B shape (bench_linear_fp8.py -k "decode and T1", H100, us, the
//     512-column kernel against that one: qkv 12.71 / 13.78, o 9.86 / 10.43, gate_up 36.71 /
//     41.05, down 22.60 / 24.47; Qwen3-8B-FP8 batch 1 267.5 / 248.7 decode tok/s). 4 warps a CTA
//     lost 3.2 us over the four (a standalone harness, H100).
//   - The mma fixes which lane holds what: lane (g, t) = (lane / 4, lane % 4) holds rows g and
//     g + 8 at k = 2t, 2t + 1, 2t + 8, 2t + 9 of each k16 step. Any permutation of k that is the
//     same for every row and for x gives the same dot product, so a lane reads 16 contiguous
//     bytes of rows g and g + 8 at chunk 4 j + t of a 64-column span of the unit (columns 64 j +
//     16 t ..) and feeds them as four k16 steps; x is read from shared memory at the same
//     columns. Chunks are swizzled (unit_offset) so these reads meet no bank conflict.
//   - Scales: a unit is four or two 128-groups. Each group's 8 mma accumulate from zero, then
//     the sum is scaled once: acc += d * (weight_scale_inv[n / 128, g] * x_scale[g]) (one
//     shared-memory word per group, computed while quantizing x). Only the summation order and
//     the point at which the two scales multiply differ from reference.linear_fp8. The 8 warps'
//     partial sums meet in shared memory at the end; every output is written once.
//   - The early warps' first units (see x below) are issued before griddepcontrol.wait and stay
//     in flight while the CTA quantizes x (PDL launch on sm_90). Each CTA lets the next kernel
//     launch right after its wait (griddepcontrol.launch_dependents; the next kernel's own wait
//     still waits for this whole grid), so that kernel's launch and prologue overlap this one's
//     stream: Qwen3-8B-FP8 batch 1 274.6 / 274.3 decode tok/s against 269.9 / 269.9 with the
//     trigger after the last store (H100, one call; bench_linear_fp8 T = 1, us: qkv 11.61 /
//     12.41, o 6.68 / 9.34, gate_up 35.73 / 36.18, down 21.61 / 22.23, where the next call's
//     weight copies overlap).
//   - x: each CTA copies x [1, K] (2 K bytes, from L2) into shared memory with cp.async after the
//     wait, quantizes it there in place (quantize_fp8.cuh: half a warp a group) and keeps the
//     e4m3 values as f16 (2 K bytes; 51 KB at K = 25600, beside the 64 KB of units), zero-padded
//     to whole units so the partial last group needs no branch; the weight scales of its rows
//     come by cp.async before everything else. An SM's copies go out in the order issued, so x
//     queues behind every weight copy issued before it: with all the first units issued before
//     the wait, x arrived about when the weight had, and the CTA multiplied after its stream
//     instead of during it. So only the first early_warps warps of a CTA issue their first units
//     before the wait (about 96 KB of weight a SM, 2 warps where x is over 16 KB), the others
//     after x's copies (early_warps() has the figures). benchmarks/linear_fp8_gemv_ab, H100, 3
//     rounds, against the kernel that loaded x with plain loads after all the first units (us):
//     Qwen3-8B qkv 8.73 / 11.03, o 6.13 / 6.31, gate_up 33.75 / 35.16, down 18.13 / 20.50, a
//     layer's four 67.2 / 73.0 (no quantization at all, wrong output, bounds it at 65.4); Qwen3-
//     32B's four 182.2 / 188.2 (bound 161.4: at K = 25600 x is 51 KB a CTA); the same output
//     bits. Qwen3-8B-FP8 batch 1 311.8 / 311.8 decode tok/s against 291.3 / 291.2 (H100,
//     alternating, one call). Lost, same harness: x by one bulk (TMA) copy after the wait and
//     the scales before it, 0.894x a layer (engine 259.4 against 288.2); every warp's units
//     after x, 8B qkv 10.43, o 8.07. Without any multiply (wrong output) the kernel before was
//     only 6% faster a layer, and two accumulator chains a group instead of one 0.3% (branch
//     experiment/fp8-gemv-x-first).
//
// fp8::gemv_silu_and_mul (linear_fp8_silu_and_mul at one token): the same kernel over the gate |
// up weight [2I, K], a CTA's 16 rows being 8 gate rows and the 8 up rows of the same outputs (the
// mma's rows g and g + 8, so one lane ends with both sums of an output): it writes silu(gate) * up
// [1, I], and the [1, 2I] product and silu_and_mul's launch are gone: Qwen3-8B-FP8 batch 1
// 282.7 / 282.8 decode tok/s against 273.3 / 273.3 with linear_fp8 then silu_and_mul (H100, one
// call, alternating); Qwen3-32B-FP8 73.5 against 73.4.
//
// fp8::gemv_tokens (T = 2..16, linear_fp8.cu picks it): the same pass with x [T, K] quantized
// beforehand (quantize_fp8), the weight's mma fragments loaded straight from global memory
// (ld.global.nc.L1::no_allocate, 16 bytes; 256-column stages in registers): the mma's 8 columns
// are 8 tokens, lane (g, t) reading token g's 16 e4m3 bytes at its own 16 columns (the
// permutation of k above, now on both operands) through L1, where every CTA of an SM finds them.
// Each group's sum is scaled by w_scale * x_scale of its token column. 4 warps and 2 stages a warp
// for one tile of 8 tokens; 8 warps and 1 stage for two (the registers of a second x tile). The
// one-token kernel's shared-memory stages lost here (H100, T = 16, us: o 14.31 against 13.46,
// down 31.80 / 27.23, qkv 18.81 / 19.27; branch experiment/fp8-gemv-tokens-rows).
// Registers bound its bytes in flight (~96 KB a SM; more stages or warps leave fewer CTAs a SM).
// Asking L2 for the weight a few stages ahead of the loads (prefetch.global.L2) did not add
// them: 0.94-0.97x on 8B qkv / o at T = 2..16; in the one-token kernel's ring past K = 4096,
// 8B down 0.91x and 32B qkv / o 0.96 / 0.98x two units ahead (H100; branch
// experiment/fp8-gemv-l2-prefetch).
#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <algorithm>
#include <atomic>

#include "linear_fp8.h"
#include "qwen3_kernels/common.cuh"
#include "qwen3_kernels/launch.cuh"
#include "qwen3_kernels/mma.cuh"
#include "qwen3_kernels/silu.cuh"
#include "quantize_fp8.cuh"

namespace qwen3_kernels::fp8 {
namespace {

constexpr int kRows = 16;                   // weight rows a CTA: the M of one m16n8k16
constexpr int kChunks = 4;                  // 64-column chunks a stage (16 bytes a lane each)
constexpr int kStageCols = 64 * kChunks;    // 256: two groups
constexpr int kGroupsPerStage = kStageCols / kGroup;
constexpr int kQuantUnroll = 4;             // x loads a lane has in flight while quantizing
constexpr int kMaxDevices = 64;
static_assert(kRows <= kGroup && kGroup % kRows == 0, "a CTA's rows share one weight block row");
// The one-token kernel's shared memory: 8 KB a warp (16 rows x 512 columns), as one unit of 512
// columns or a ring of two of 256 (gemv chooses by K).
constexpr int kGemvWarps = 8;
constexpr int kWarpStageBytes = 8192;

// Rows g and g + 8 of one stage: chunk j is columns kb + 64 j + 16 t .. + 15.
struct Stage {
  uint4 lo[kChunks], hi[kChunks];
};

// A stage's loads; columns at or past k (k % 16 == 0: a lane's 16 are all in or all out) and rows
// past n read nothing and hold zeros.
__device__ __forceinline__ void load_stage(Stage& s, const uint8_t* row_lo, const uint8_t* row_hi,
                                           bool lo_ok, bool hi_ok, int kb, int lane_col, int k) {
#pragma unroll
  for (int j = 0; j < kChunks; ++j) {
    const int col = kb + 64 * j + lane_col;
    s.lo[j] = lo_ok && col < k ? load_stream<false>(row_lo + col) : make_uint4(0, 0, 0, 0);
    s.hi[j] = hi_ok && col < k ? load_stream<false>(row_hi + col) : make_uint4(0, 0, 0, 0);
  }
}

// d += a (16 x 16, row) * b (16 x 8, col), f16 in, f32 accumulate.
__device__ __forceinline__ void mma_m16n8k16(float (&d)[4], const uint32_t (&a)[4],
                                             const uint32_t (&b)[2]) {
  asm("mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0, %1, %2, %3}, {%4, %5, %6, %7}, "
      "{%8, %9}, {%0, %1, %2, %3};\n"
      : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b[0]), "r"(b[1]));
}

// The 16 weights a lane holds of one row at chunk j, as 8 f16x2 words: word i = columns 2 i,
// 2 i + 1 of the lane's 16.
__device__ __forceinline__ void to_half2x8(const uint4& w, uint32_t (&h)[8]) {
  e4m3x4_to_half2x2(w.x, h[0], h[1]);
  e4m3x4_to_half2x2(w.y, h[2], h[3]);
  e4m3x4_to_half2x2(w.z, h[4], h[5]);
  e4m3x4_to_half2x2(w.w, h[6], h[7]);
}

// d += one 16-column chunk of rows g (lo) and g + 8 (hi) times x at the same columns (xb), as
// four k16 steps: step m takes a lane's columns 4 m .. 4 m + 3 as the fragment's k 2t, 2t+1
// (a0, a1) and 2t+8, 2t+9 (a2, a3), x at the same columns as b0, b1.
__device__ __forceinline__ void mma_chunk(float (&d)[4], const uint32_t (&lo)[8],
                                          const uint32_t (&hi)[8], const uint32_t (&xb)[8]) {
#pragma unroll
  for (int m = 0; m < 4; ++m) {
    const uint32_t a[4] = {lo[2 * m], hi[2 * m], lo[2 * m + 1], hi[2 * m + 1]};
    const uint32_t b[2] = {xb[2 * m], xb[2 * m + 1]};
    mma_m16n8k16(d, a, b);
  }
}

// x, already copied into xh as bf16 [k], -> its quantize_fp8 values as f16 in place, and sc[g] =
// (the weight scale already in sc[g]) * x_scale[g], for every group up to the padded end (past k
// the values are zeros, and the weight scales copied there are 0). Half a warp a group, the CTA's
// 8 half-warps kQuantUnroll groups apart: a lane reads its 8 values, the half-warp finds the
// group's max, and the lane writes its 8 quantized values back where it read them.
// kTwoRows: sc2 (the weight scales of the CTA's rows 8..15 where they are not the 8 rows after
// its first 8) is scaled the same way.
template <int kThreads, bool kTwoRows = false>
__device__ __forceinline__ void quantize_x_in_place(uint16_t* xh, int k, int padded_groups,
                                                    float* sc, float* sc2) {
  constexpr int kHalfWarps = kThreads / kGroupLanes;
  const int half_warp = threadIdx.x / kGroupLanes;
  const int col_in_group = 8 * (threadIdx.x % kGroupLanes);
  for (int g0 = 0; g0 < padded_groups; g0 += kHalfWarps * kQuantUnroll) {
    uint4 v[kQuantUnroll];
#pragma unroll
    for (int u = 0; u < kQuantUnroll; ++u) {
      const int col = (g0 + u * kHalfWarps + half_warp) * kGroup + col_in_group;
      v[u] = col < k ? *reinterpret_cast<const uint4*>(xh + col) : make_uint4(0, 0, 0, 0);
    }
#pragma unroll
    for (int u = 0; u < kQuantUnroll; ++u) {
      const int group = g0 + u * kHalfWarps + half_warp;
      const float scale =
          group_scale(bits_to_float<__nv_bfloat16>(group_max_bits(abs_max_bits8(v[u]))));
      if (group < padded_groups) {
        const uint2 q = quantize8<__nv_bfloat16>(v[u], scale);
        uint4 h;
        e4m3x4_to_half2x2(q.x, h.x, h.y);
        e4m3x4_to_half2x2(q.y, h.z, h.w);
        *reinterpret_cast<uint4*>(xh + group * kGroup + col_in_group) = h;
        if (col_in_group == 0) {
          sc[group] *= scale;
          if constexpr (kTwoRows) sc2[group] *= scale;
        }
      }
    }
  }
}

// ---- one token: fp8::gemv ---------------------------------------------------------------------

// A unit of kUnitCols columns of the CTA's 16 rows: row r at r * kUnitCols; its chunk c (16
// bytes) sits at chunk c ^ 4 (r & 1), so rows g and g + 1 fill opposite halves of each 128-byte
// line of banks: each 8-lane phase of the fragment loads (2 rows x 4 chunks) hits 8 different
// bank groups, as does each phase of the copies (8 consecutive chunks of one row).
template <int kUnitCols>
__device__ __forceinline__ int unit_offset(int r, int c) {
  return r * kUnitCols + 16 * (c ^ ((r & 1) << 2));
}

// A warp's copy of rows row0 .. row0 + 15, columns kb .. kb + kUnitCols - 1 of the weight into a
// unit: a warp instruction copies 512 contiguous bytes of one row (units of 512) or 256 of each of
// two rows (units of 256), 16 bytes a lane. Columns at or past k (k % 16 == 0: a chunk is all in or
// all out) and rows past n are zeros. One commit group a unit. hi_shift: the unit's rows 8..15 are
// the weight's rows row0 + hi_shift + 8 .. + 15 (linear_fp8_silu_and_mul's up rows; 0 elsewhere).
template <int kUnitCols>
__device__ __forceinline__ void copy_unit(uint32_t unit, const uint8_t* w, int row0, int n, int k,
                                          int kb, int lane, int hi_shift = 0) {
  constexpr int kChunksPerRow = kUnitCols / 16;
  constexpr int kRowsPerCopy = 32 / kChunksPerRow;
  const int c = lane % kChunksPerRow;
  const int col = kb + 16 * c;
  const uint8_t* src = w + static_cast<int64_t>(row0) * k + col;
#pragma unroll
  for (int i = 0; i < kRows; i += kRowsPerCopy) {
    const int r = i + lane / kChunksPerRow;
    const int wr = r + (i >= kRows / 2 ? hi_shift : 0);  // kRowsPerCopy divides 8: i decides
    const bool ok = col < k && row0 + wr < n;
    cp_async_16(unit + unit_offset<kUnitCols>(r, c), ok ? src + static_cast<int64_t>(wr) * k : w,
                ok);
  }
  cp_async_commit();
}

// acc[0] (row g) and acc[1] (row g + 8) += the unit's dot products, group by group; lane (g, t)
// takes chunks 8 h + 4 jj + t of group h (the column permutation the top of the file describes).
// xh: x as f16 [k padded to units]; sc: [groups] weight scale * x scale (sc_hi: of rows 8..15).
template <int kUnitCols>
__device__ __forceinline__ void compute_unit(const uint8_t* unit, int kb, int g, int t, int k,
                                             const uint16_t* xh, const float* sc,
                                             const float* sc_hi, float (&acc)[2]) {
#pragma unroll
  for (int h = 0; h < kUnitCols / kGroup; ++h) {
    const int group = kb / kGroup + h;
    if (group * kGroup >= k) break;  // uniform: past the last group
    float d[4] = {0.f, 0.f, 0.f, 0.f};
#pragma unroll
    for (int jj = 0; jj < kGroup / 64; ++jj) {
      const int c = 8 * h + 4 * jj + t;
      const uint4 w_lo = *reinterpret_cast<const uint4*>(unit + unit_offset<kUnitCols>(g, c));
      const uint4 w_hi = *reinterpret_cast<const uint4*>(unit + unit_offset<kUnitCols>(g + 8, c));
      const uint4 x0 = *reinterpret_cast<const uint4*>(xh + kb + 16 * c);
      const uint4 x1 = *reinterpret_cast<const uint4*>(xh + kb + 16 * c + 8);
      const uint32_t xb[8] = {x0.x, x0.y, x0.z, x0.w, x1.x, x1.y, x1.z, x1.w};
      uint32_t lo[8], hi[8];
      to_half2x8(w_lo, lo);
      to_half2x8(w_hi, hi);
      mma_chunk(d, lo, hi, xb);
    }
    // d[0] = D[g][2t], d[2] = D[g + 8][2t]: every column of D is the same dot product
    acc[0] = fmaf(d[0], sc[group], acc[0]);
    acc[1] = fmaf(d[2], sc_hi[group], acc[1]);
  }
}

// Grid ceil(n / 16) CTAs of kGemvWarps warps; CTA b owns rows 16 b .. 16 b + 15, warp w the units
// w, w + kGemvWarps, ..., kRing of them in flight in its 8 KB. Dynamic shared memory:
// [kGemvWarps x 8 KB of units][xh: units * kUnitCols f16][sc: units * kUnitCols / 128 fp32]
// [kSilu: sc of the up rows, as many].
// kSilu (linear_fp8_silu_and_mul; n = 2I, I % 8 == 0): grid I / 8; CTA b owns the gate rows 8 b ..
// 8 b + 7 (its rows 0..7) and the up rows I + 8 b .. (8..15: lane (g, t) holds gate row g and up
// row g, the mma's rows g and g + 8) and writes out[8 b .. 8 b + 7] = silu(gate) * up, each
// rounded to bf16 first as the unfused GEMV's output would be.
template <int kUnitCols, bool kPdl, bool kSilu = false>
__global__ void __launch_bounds__(32 * kGemvWarps)
    gemv_kernel(__nv_bfloat16* __restrict__ out,      // [1, n] ([1, n / 2] with kSilu)
                const __nv_bfloat16* __restrict__ x,  // [1, k]
                const uint8_t* __restrict__ w,        // [n, k] e4m3
                const float* __restrict__ w_scales,   // [ceil(n / 128), ceil(k / 128)]
                int n, int k,
                int early_warps) {  // warps whose first units go out before the wait
  constexpr int kUnitBytes = kRows * kUnitCols;
  constexpr int kRing = kWarpStageBytes / kUnitBytes;
  static_assert(kRing == 1 || kRing == 2, "cp_async_wait below counts one or two groups");
  extern __shared__ uint4 smem[];
  __shared__ float partial[kGemvWarps][kRows];
  const int units = (k + kUnitCols - 1) / kUnitCols;
  const int groups = (k + kGroup - 1) / kGroup;
  auto* unit_bufs = reinterpret_cast<uint8_t*>(smem);
  auto* xh = reinterpret_cast<uint16_t*>(unit_bufs + kGemvWarps * kWarpStageBytes);
  auto* sc = reinterpret_cast<float*>(xh + units * kUnitCols);
  float* sc_hi = kSilu ? sc + units * (kUnitCols / kGroup) : sc;

  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  const int g = lane / 4, t = lane % 4;
  const int row0 = blockIdx.x * (kSilu ? kRows / 2 : kRows);
  const int hi_shift = kSilu ? n / 2 - kRows / 2 : 0;  // up row I + 8 b + r is unit row 8 + r
  const uint8_t* ring = unit_bufs + warp * kWarpStageBytes;
  const uint32_t ring_addr = smem_addr(ring);

  // Unit u into ring slot s; in a ring, past the warp's last unit an empty group keeps the count
  // of groups the waits below rely on (a ring of one waits for all).
  const auto copy_or_commit = [&](int u, int s) {
    if (u < units)
      copy_unit<kUnitCols>(ring_addr + s * kUnitBytes, w, row0, n, k, u * kUnitCols, lane,
                           hi_shift);
    else if constexpr (kRing > 1)
      cp_async_commit();
  };
  // The weight and its scales are no kernel's output: the scales (every thread's oldest group)
  // and the early warps' first units stream in while the kernel before finishes. x, that
  // kernel's output, is copied after the wait, ahead of the other warps' first units, so that it
  // queues behind only the early warps' copies (see the top of the file).
  const int padded_groups = units * (kUnitCols / kGroup);
  const float* w_scale_row = w_scales + static_cast<int64_t>(row0 / kGroup) * groups;
  const float* w_scale_row2 =
      w_scales + static_cast<int64_t>((row0 + hi_shift + kRows / 2) / kGroup) * groups;
  for (int i = threadIdx.x; i < padded_groups; i += 32 * kGemvWarps) {
    const bool ok = i < groups;
    cp_async_4(smem_addr(sc + i), w_scale_row + (ok ? i : 0), ok);
    if constexpr (kSilu) cp_async_4(smem_addr(sc_hi + i), w_scale_row2 + (ok ? i : 0), ok);
  }
  cp_async_commit();
  const bool early = warp < early_warps;
  if (early) {
#pragma unroll
    for (int j = 0; j < kRing; ++j) copy_or_commit(warp + j * kGemvWarps, j);
  }
  if constexpr (kPdl) {
    pdl_wait();  // x may be the previous kernel's output, out its input
    // The next kernel may launch now: its griddepcontrol.wait still waits for this whole grid,
    // and its launch and prologue overlap this one's stream.
    pdl_launch_dependents();
  }
  const uint32_t xh_addr = smem_addr(xh);
  for (int c = threadIdx.x; c < k / 8; c += 32 * kGemvWarps)
    cp_async_16(xh_addr + 16 * c, x + 8 * c, true);
  cp_async_commit();
  if (early) {
    cp_async_wait<0>();  // x (its first units, issued before it, have landed as well)
  } else {
#pragma unroll
    for (int j = 0; j < kRing; ++j) copy_or_commit(warp + j * kGemvWarps, j);
    cp_async_wait<kRing>();  // the scales and x
  }
  __syncthreads();  // everyone's x and scales
  quantize_x_in_place<32 * kGemvWarps, kSilu>(xh, k, padded_groups, sc, sc_hi);
  __syncthreads();

  float acc[2] = {0.f, 0.f};
  int slot = 0;
  for (int u = warp; u < units; u += kGemvWarps) {
    cp_async_wait<kRing - 1>();  // unit u has landed (the one after it may be in flight)
    __syncwarp();                // every lane's copies of it
    compute_unit<kUnitCols>(ring + slot * kUnitBytes, u * kUnitCols, g, t, k, xh, sc, sc_hi, acc);
    __syncwarp();  // every lane is done reading before the next copy overwrites
    copy_or_commit(u + kRing * kGemvWarps, slot);
    slot = (slot + 1) % kRing;
  }

  if (t == 0) {
    partial[warp][g] = acc[0];
    partial[warp][g + 8] = acc[1];
  }
  __syncthreads();
  if constexpr (kSilu) {
    if (threadIdx.x < kRows / 2) {
      float gate = 0.f, up = 0.f;
#pragma unroll
      for (int i = 0; i < kGemvWarps; ++i) {
        gate += partial[i][threadIdx.x];
        up += partial[i][threadIdx.x + kRows / 2];
      }
      out[row0 + threadIdx.x] = __float2bfloat16_rn(
          silu_mul(__bfloat162float(__float2bfloat16_rn(gate)),
                   __bfloat162float(__float2bfloat16_rn(up))));
    }
  } else if (threadIdx.x < kRows && row0 + static_cast<int>(threadIdx.x) < n) {
    float sum = 0.f;
#pragma unroll
    for (int i = 0; i < kGemvWarps; ++i) sum += partial[i][threadIdx.x];
    out[row0 + threadIdx.x] = __float2bfloat16_rn(sum);
  }
}

// ---- a few tokens: fp8::gemv_tokens ----------------------------------------------------------

// A stage of the tokens kernel: the weight chunks as in Stage, and token nt * 8 + g's e4m3 x at
// the lane's own columns (chunk j: the 16 bytes at kb + 64 j + 16 t), the mma's B operand.
template <int NT>
struct TokenStage {
  Stage w;
  uint4 x[NT][kChunks];
};
// x through L1 (every CTA of an SM reads the same [T, K]); tokens past T read nothing, hold 0.
template <int NT>
__device__ __forceinline__ void load_token_x(TokenStage<NT>& s, const uint8_t* const (&x_row)[NT],
                                             const bool (&x_ok)[NT], int kb, int lane_col, int k) {
#pragma unroll
  for (int j = 0; j < kChunks; ++j) {
    const int col = kb + 64 * j + lane_col;
#pragma unroll
    for (int nt = 0; nt < NT; ++nt)
      s.x[nt][j] = x_ok[nt] && col < k ? __ldg(reinterpret_cast<const uint4*>(x_row[nt] + col))
                                       : make_uint4(0, 0, 0, 0);
  }
}

// acc[nt] (D's fragment: rows g, g + 8 x tokens nt * 8 + 2 t, + 1) += this stage's products,
// group by group, each group's sum scaled once by w_scale * x_scale as in compute_stage.
template <int NT>
__device__ __forceinline__ void compute_token_stage(const TokenStage<NT>& s, int kb, int k, int t4,
                                                    const float* __restrict__ w_scale_row,
                                                    const float* __restrict__ x_scales,
                                                    int scale_stride, int ntok,
                                                    float (&acc)[NT][4]) {
#pragma unroll
  for (int h = 0; h < kGroupsPerStage; ++h) {
    const int group = kb / kGroup + h;
    if (group * kGroup >= k) break;  // uniform: past the last group
    float d[NT][4] = {};
#pragma unroll
    for (int jj = 0; jj < kChunks / kGroupsPerStage; ++jj) {
      const int j = h * (kChunks / kGroupsPerStage) + jj;
      uint32_t lo[8], hi[8];
      to_half2x8(s.w.lo[j], lo);
      to_half2x8(s.w.hi[j], hi);
#pragma unroll
      for (int nt = 0; nt < NT; ++nt) {
        uint32_t xb[8];
        to_half2x8(s.x[nt][j], xb);
        mma_chunk(d[nt], lo, hi, xb);
      }
    }
    const float ws = __ldg(w_scale_row + group);
    const float* xs = x_scales + static_cast<int64_t>(group) * scale_stride;
#pragma unroll
    for (int nt = 0; nt < NT; ++nt) {
      const int c0 = nt * 8 + 2 * t4;  // d[nt][0], [2]: token c0; [1], [3]: token c0 + 1
      const float s0 = c0 < ntok ? ws * __ldg(xs + c0) : 0.f;
      const float s1 = c0 + 1 < ntok ? ws * __ldg(xs + c0 + 1) : 0.f;
      acc[nt][0] = fmaf(d[nt][0], s0, acc[nt][0]);
      acc[nt][1] = fmaf(d[nt][1], s1, acc[nt][1]);
      acc[nt][2] = fmaf(d[nt][2], s0, acc[nt][2]);
      acc[nt][3] = fmaf(d[nt][3], s1, acc[nt][3]);
    }
  }
}

// Grid ceil(n / 16) CTAs of kWarps warps; CTA b owns rows 16 b .. 16 b + 15 for every token, warp
// w the stages w, w + kWarps, ..., kStagesInFlight of them in registers at a time. NT mma tiles
// of 8 tokens.
template <int kWarps, int kStagesInFlight, int NT, bool kPdl>
__global__ void __launch_bounds__(32 * kWarps)
    tokens_kernel(__nv_bfloat16* __restrict__ out,    // [ntok, n]
                  const uint8_t* __restrict__ xq,      // [ntok, k] e4m3
                  const float* __restrict__ x_scales,  // [ceil(k / 128), scale_stride]
                  int scale_stride,
                  const uint8_t* __restrict__ w,       // [n, k] e4m3
                  const float* __restrict__ w_scales,  // [ceil(n / 128), ceil(k / 128)]
                  int n, int k, int ntok) {
  constexpr int S = kStagesInFlight;
  __shared__ float partial[kWarps][kRows][NT * 8 + 1];
  const int stages = (k + kStageCols - 1) / kStageCols;
  const int groups = (k + kGroup - 1) / kGroup;
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  const int g = lane / 4, t4 = lane % 4, lane_col = 16 * t4;
  const int row0 = blockIdx.x * kRows;
  const bool lo_ok = row0 + g < n, hi_ok = row0 + g + 8 < n;
  const uint8_t* row_lo = w + static_cast<int64_t>(lo_ok ? row0 + g : 0) * k;
  const uint8_t* row_hi = w + static_cast<int64_t>(hi_ok ? row0 + g + 8 : 0) * k;
  const uint8_t* x_row[NT];
  bool x_ok[NT];
#pragma unroll
  for (int nt = 0; nt < NT; ++nt) {
    x_ok[nt] = nt * 8 + g < ntok;
    x_row[nt] = xq + static_cast<int64_t>(x_ok[nt] ? nt * 8 + g : 0) * k;
  }
  // The weight streams in before the wait (no kernel's output); x, the previous kernel's, after.
  TokenStage<NT> buf[S];
#pragma unroll
  for (int j = 0; j < S; ++j)
    load_stage(buf[j].w, row_lo, row_hi, lo_ok, hi_ok, (warp + j * kWarps) * kStageCols, lane_col,
               k);
  if constexpr (kPdl) pdl_wait();
#pragma unroll
  for (int j = 0; j < S; ++j)
    load_token_x(buf[j], x_row, x_ok, (warp + j * kWarps) * kStageCols, lane_col, k);
  const float* w_scale_row = w_scales + static_cast<int64_t>(row0 / kGroup) * groups;
  float acc[NT][4] = {};
  for (int s = warp; s < stages; s += S * kWarps) {
#pragma unroll
    for (int j = 0; j < S; ++j) {
      const int st = s + j * kWarps;
      if (st < stages)
        compute_token_stage(buf[j], st * kStageCols, k, t4, w_scale_row, x_scales, scale_stride,
                            ntok, acc);
      const int next = (st + S * kWarps) * kStageCols;
      // x first: an SM's copies go out in issue order, and x queued behind the weight would
      // hold up the stage's multiply (1.02-1.035x at T = 2..16, benchmarks/linear_fp8_gemv_ab)
      load_token_x(buf[j], x_row, x_ok, next, lane_col, k);
      load_stage(buf[j].w, row_lo, row_hi, lo_ok, hi_ok, next, lane_col, k);
    }
  }
#pragma unroll
  for (int nt = 0; nt < NT; ++nt) {
    const int c0 = nt * 8 + 2 * t4;
    partial[warp][g][c0] = acc[nt][0];
    partial[warp][g][c0 + 1] = acc[nt][1];
    partial[warp][g + 8][c0] = acc[nt][2];
    partial[warp][g + 8][c0 + 1] = acc[nt][3];
  }
  __syncthreads();
  for (int i = threadIdx.x; i < kRows * NT * 8; i += 32 * kWarps) {
    const int r = i % kRows, c = i / kRows;  // consecutive threads: consecutive rows of a token
    if (c < ntok && row0 + r < n) {
      float sum = 0.f;
#pragma unroll
      for (int ww = 0; ww < kWarps; ++ww) sum += partial[ww][r][c];
      out[static_cast<int64_t>(c) * n + row0 + r] = __float2bfloat16_rn(sum);
    }
  }
  if constexpr (kPdl) pdl_launch_dependents();
}

size_t smem_bytes(int64_t k, int unit_cols, bool silu) {
  const int64_t units = (k + unit_cols - 1) / unit_cols;
  return static_cast<size_t>(kGemvWarps * kWarpStageBytes + units * unit_cols * 2 +
                             (silu ? 2 : 1) * units * (unit_cols / kGroup) * 4);
}

// Above 48 KB of shared memory (the one-token kernel's units alone are 64 KB) a kernel must opt
// in, per device: once per device each kernel is allowed all the device offers (setting the same
// value twice is harmless); a K beyond that (~80000) then fails at the launch.
cudaError_t allow_all_smem(const void* kernel, std::atomic<bool> (&done)[kMaxDevices]) {
  int dev = 0;
  cudaError_t err = cudaGetDevice(&dev);
  if (err != cudaSuccess) return err;
  if (dev >= 0 && dev < kMaxDevices && done[dev].load(std::memory_order_relaxed))
    return cudaSuccess;
  int optin = 0;
  cudaFuncAttributes attr{};
  err = cudaDeviceGetAttribute(&optin, cudaDevAttrMaxSharedMemoryPerBlockOptin, dev);
  if (err == cudaSuccess) err = cudaFuncGetAttributes(&attr, kernel);
  if (err == cudaSuccess)
    err = cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize,
                               optin - static_cast<int>(attr.sharedSizeBytes));
  if (err != cudaSuccess) return err;
  if (dev >= 0 && dev < kMaxDevices) done[dev].store(true, std::memory_order_relaxed);
  return cudaSuccess;
}

// How many of a CTA's warps issue their first units before the wait (gemv_kernel's early_warps):
// about kPreWaitBytesPerSm of weight a SM ahead of x (the CTAs a SM runs at once x early warps x
// 8 KB), but 2 where x is over 16 KB a CTA (K > 8192), whose copies then wait behind less.
// Measured (benchmarks/linear_fp8_gemv_ab, H100, 3 rounds, us, 2 / 4 / 6 / 8 early warps, the
// last being the kernel before, which loaded x with plain loads after all the first units):
// Qwen3-8B qkv 9.23 / 8.73 / 10.02 / 10.99, o 7.59 / 7.09 / 6.10 / 6.29, gate_up 34.78 / 33.80 /
// 34.34 / 35.27, down 18.12 / 18.65 / 19.72 / 20.51; Qwen3-32B qkv 21.22 / 20.34 / 20.11 /
// 20.17, o 18.02 / 17.40 / 17.25 / 18.01, gate_up 85.47 / 84.67 / 84.64 / 85.70, down 62.47 /
// 62.91 / 63.37 / 62.27 (all units after x: 8B qkv 10.43, o 8.07). Around the choice (same
// harness, against it): 64 / 128 KB a SM 0.988x / 0.967x a Qwen3-8B layer, 0.995x / 0.980x a
// 32B one; 1 or 3 warps past K = 8192 0.999-1.000x.
constexpr int kPreWaitBytesPerSm = 96 * 1024;
constexpr int kCtaSmemOverhead = 2048;  // the runtime's 1 KB a CTA and our static shared memory
int early_warps(int64_t grid, size_t smem, int64_t k) {
  if (k > 8192) return 2;
  const DeviceInfo d = current_device_info();
  const int num_sms = d.num_sms, per_sm_smem = d.smem_per_sm;
  if (num_sms <= 0 || per_sm_smem <= 0) return kGemvWarps;
  const int64_t fit =
      std::max<int64_t>(1, per_sm_smem / static_cast<int64_t>(smem + kCtaSmemOverhead));
  const int64_t ctas = std::min<int64_t>(fit, (grid + num_sms - 1) / num_sms);
  return static_cast<int>(std::clamp<int64_t>(kPreWaitBytesPerSm / (ctas * kWarpStageBytes), 1,
                                              kGemvWarps));
}

// The one-token launch, plain or with silu_and_mul (n = 2I rows in; grid I / 8 then).
template <bool kSilu>
cudaError_t launch_gemv(void* out, const void* x, const void* w, const float* w_scales, int64_t n,
                        int64_t k, cudaStream_t stream) {
  // Units of 512 columns where each warp's share of K is at most one (K <= 4096: nothing to
  // pipeline), else a ring of two units of 256 so that a warp's next copy is in flight while it
  // multiplies (see the top of the file).
  const bool wide = k <= kGemvWarps * 512;
  const size_t smem = smem_bytes(k, wide ? 512 : 256, kSilu);
  const int64_t rows_per_cta = kSilu ? kRows / 2 : kRows;
  const dim3 grid(static_cast<unsigned>(((kSilu ? n / 2 : n) + rows_per_cta - 1) / rows_per_cta));
  auto* o = static_cast<__nv_bfloat16*>(out);
  auto* xb = static_cast<const __nv_bfloat16*>(x);
  auto* wb = static_cast<const uint8_t*>(w);
  const int ni = static_cast<int>(n), ki = static_cast<int>(k);
  const bool pdl = current_device_info().cc_major >= 9;
  auto kernel = wide ? (pdl ? gemv_kernel<512, true, kSilu> : gemv_kernel<512, false, kSilu>)
                     : (pdl ? gemv_kernel<256, true, kSilu> : gemv_kernel<256, false, kSilu>);
  static std::atomic<bool> allowed[2][2][kMaxDevices];
  const cudaError_t err =
      allow_all_smem(reinterpret_cast<const void*>(kernel), allowed[wide][pdl]);
  if (err != cudaSuccess) return err;
  return launch_ex(kernel, LaunchConfig(grid, dim3(32 * kGemvWarps), smem, stream, pdl, 1), o, xb,
                   wb, w_scales, ni, ki, early_warps(grid.x, smem, k));
}

// k == 0 would leave out unwritten (an empty sum is 0, but nothing here writes it)
bool gemv_args_ok(const void* x, const void* w, const float* w_scales, int64_t n, int64_t k) {
  return n >= 0 && k > 0 && n % 8 == 0 && k % 16 == 0 && n <= (int64_t{1} << 30) &&
         k <= (int64_t{1} << 20) && aligned16(x) && aligned16(w) && w_scales != nullptr;
}

}  // namespace

cudaError_t gemv(void* out, const void* x, const void* w, const float* w_scales, int64_t n,
                 int64_t k, cudaStream_t stream) {
  if (n == 0) return cudaSuccess;
  if (!gemv_args_ok(x, w, w_scales, n, k)) return cudaErrorInvalidValue;
  return launch_gemv<false>(out, x, w, w_scales, n, k, stream);
}

cudaError_t gemv_silu_and_mul(void* out, const void* x, const void* w, const float* w_scales,
                              int64_t two_i, int64_t k, cudaStream_t stream) {
  if (two_i == 0) return cudaSuccess;
  // whole CTAs of 8 gate and 8 up rows, so no row check is needed (and no CTA straddles the two)
  if (!gemv_args_ok(x, w, w_scales, two_i, k) || two_i % 16) return cudaErrorInvalidValue;
  return launch_gemv<true>(out, x, w, w_scales, two_i, k, stream);
}

bool tokens_gemv_fits(int64_t t, int64_t n) {
  return t >= 1 && t <= (n < kTokensWideN ? 2 * kTokensPerTile : 1);
}

cudaError_t gemv_tokens(void* out, const void* xq, const float* x_scales, int64_t scale_stride,
                        const void* w, const float* w_scales, int64_t t, int64_t n, int64_t k,
                        cudaStream_t stream) {
  if (n == 0 || t == 0) return cudaSuccess;
  if (t < 0 || t > 2 * kTokensPerTile || n < 0 || k <= 0 || n % 8 || k % 16 ||
      n > (int64_t{1} << 30) || k > (int64_t{1} << 20) || scale_stride < t ||
      scale_stride > (int64_t{1} << 30) || !aligned16(xq) || !aligned16(w) ||
      x_scales == nullptr || w_scales == nullptr)
    return cudaErrorInvalidValue;
  const dim3 grid(static_cast<unsigned>((n + kRows - 1) / kRows));
  auto* o = static_cast<__nv_bfloat16*>(out);
  auto* xb = static_cast<const uint8_t*>(xq);
  auto* wb = static_cast<const uint8_t*>(w);
  const int ni = static_cast<int>(n), ki = static_cast<int>(k), ti = static_cast<int>(t);
  const int ss = static_cast<int>(scale_stride);
  const bool pdl = current_device_info().cc_major >= 9;
  if (t <= kTokensPerTile) {
    auto kernel = pdl ? tokens_kernel<4, 2, 1, true> : tokens_kernel<4, 2, 1, false>;
    return launch_ex(kernel, LaunchConfig(grid, dim3(128), 0, stream, pdl, 1), o, xb, x_scales,
                     ss, wb, w_scales, ni, ki, ti);
  }
  auto kernel = pdl ? tokens_kernel<8, 1, 2, true> : tokens_kernel<8, 1, 2, false>;
  return launch_ex(kernel, LaunchConfig(grid, dim3(256), 0, stream, pdl, 1), o, xb, x_scales, ss,
                   wb, w_scales, ni, ki, ti);
}

}  // namespace qwen3_kernels::fp8
