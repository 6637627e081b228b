// paged_attention_decode: one new query token per sequence attends over its whole paged KV context
// (GQA), split-KV ("flash-decoding") with a combine pass when the batch alone cannot fill the GPU.
//
// Spec: qwen3_kernels/reference.py::paged_attention_decode (fp32 softmax, output in the input
// dtype).
// head_dim is fixed at 128 and block_size must be a multiple of 16; the launcher returns
// cudaErrorInvalidValue otherwise (the Python wrapper runs the reference for other head dims).
//
// Why this shape: decode attention reads every K/V byte of the context once and does ~2 FLOP per
// byte per q head, so it is bound by HBM. The design goals are (1) read each kv head's K/V once for
// all the q heads of its group, (2) keep enough bytes in flight on every SM, (3) spend few
// instructions per byte so the memory pipe never waits on math.
//
// Work split:
//   * A CTA owns one (sequence b, kv head, split). Its 16 "rows" are the q heads of that kv group
//     (Hq / Hkv of them; the rest are zero padding; groups larger than 16 take several CTAs, each
//     re-reading the K/V: a case Qwen3 does not have).
//   * The keys of a sequence are cut into tiles of 16 (the smallest block size, so a tile never
//     spans two cache blocks: one block-table lookup per tile). A "chunk" is kTilesPerWarpChunk
//     tiles per warp (4 x 4 warps = 256 keys in the batch shape, 1 x 8 warps = 128 keys in the
//     split shape, see "The launch" below); a non-empty split covers at least one chunk, so short
//     sequences use fewer splits rather than many CTAs that each fill no pipeline. The split count
//     itself is chosen on the host from B, Hkv, the SM count and the context's upper bound
//     (max_blocks * block_size), so no host sync is needed and a CUDA graph replays correctly
//     whatever seq_lens hold.
//     Two ways to give tiles to splits:
//       contiguous (batch shape): the sequence's tiles, from its real length read on the device,
//         are cut into num_splits equal ranges. The first block-table read waits on seq_lens.
//       interleaved (split shape): split s takes chunks s, s + num_splits, s + 2 num_splits, ...
//         Where a split starts no longer depends on seq_len, so the block-table and seq_lens reads
//         overlap (one memory latency less before the first K/V byte arrives).
//   * Inside the CTA each warp takes every kWarps-th tile of the split (within a chunk) and runs
//     its own cp.async pipeline (kStages stages of a 16-key K tile + V tile = 8 KB each) and its
//     own online softmax; warps never wait for each other until the final merge through shared
//     memory.
//   * Math on tensor cores (mma.sync m16n8k16, fp32 accumulate): S = Q K^T with Q (16 rows x 128)
//     held in registers for the whole kernel, P = softmax numerator rounded to the input dtype (as
//     FlashAttention does), O += P V. This leaves the SM's issue slots nearly idle, which is what a
//     bandwidth-bound kernel wants.
//   * One split: the CTA normalises and writes out[b, h, :] directly. Several splits: each CTA
//     writes its normalised partial output and log2-sum-exp to the workspace, and a small combine
//     kernel (launched with PDL on sm_90) merges them. A split with no keys writes lse = -inf and
//     the combine skips it. A sequence that fits in one chunk (all its keys in split 0) is
//     written by split 0 directly even when several splits were launched, and the combine
//     leaves it alone: the split count is fixed at capture, the length is not.
//
// The launch (choose_launch, next to the host code below) is picked from the shape alone:
//   batch shape (the batch's (sequence, kv head) CTAs fill every SM without splits): w4s3 = 4
//     warps x 3 stages (96 KB of shared memory, 2 CTAs per SM on H100/H200), contiguous splits,
//     the looping combine kernel, main kernel launched without PDL.
//   split shape (the batch needs splits): w8s3c1 = 8 warps x 3 stages (192 KB, 1 CTA per SM) in
//     chunks of one tile per warp, interleaved splits, the one-round-trip combine kernel (all of a
//     (b, h)'s partials loaded at once instead of a loop of dependent loads) and PDL on the main
//     kernel too: before its wait it reads seq_lens and its first block ids and prefetches its
//     first K / V tiles into L2 (decode_split, kWaitInside), which overlaps qk_norm_rope, whose
//     trigger comes first (launch.cuh). A GPU without 192 KB of shared memory per CTA (A100)
//     runs the split shape's choices on w4s3.
//   batch-invariant (batch_invariant=true): a sequence of at most kDecodeInvariantSplitKeys keys
//     runs in the prefill kernels' per-row order (decode_prefill_order.cu, where
//     invariant_prefill_order holds; prefill then runs those rows at its default speed); longer
//     ones, and every sequence elsewhere, in w4s3's order at every batch size, splits at fixed
//     key positions, w4s2 for prefill's CTA groups (see choose_launch; skip_alone leaves the
//     short rows to the other kernel). Lost to the mma.sync kernel: the mode's decode through the
//     wgmma prefill kernel itself (branch experiment/deterministic-prefill-order): its 128-row
//     tiles hold 2..4 valid rows in decode, and the wasted tensor work cost power and clock (H200,
//     Qwen3-0.6B workload 21,761 output tok/s at 1,755 MHz against 23,967 for w4s3's order).
//   Measured on an H200 (bench_attention_decode.py, against cuDNN): batch shape B=32 ctx 4k
//   0.96-0.99x cuDNN, B=128 ctx 1k 0.98-1.00x (w8s3 there: 0.93-0.97x); split shape B=16 ctx 2k
//   0.96-1.02x, B=1 ctx 32k 1.01-1.05x (w4s3 there: 0.90-0.97x). Chunks of one tile per warp: at
//   batch 1 a context of 384 / 640 / 1024 keys is read by 3 / 5 / 8 splits at once instead of 1 / 2
//   / 2, 6.6 / 7.0 / 7.3 us instead of 8.2 / 11.4 / 11.1 for Qwen3-8B's heads (cuDNN 7.2 / 8.6 /
//   7.6), the same at 128 keys, B=16 ctx 2k and B=1 ctx 32k; engine, Qwen3-8B batch 1: 219.8-219.9
//   tok/s against 215.5-218.7, and 366.8-367.9 against 358.2-358.3 at TP 2.
//
// Variants that no shape of the default launch picks (branch experiment/kernel-launch-variants
// keeps them, with the environment switches that selected them):
//   w4s2 (64 KB, 3 CTAs per SM; the batch-invariant prefill's), w4s4 (128 KB), w4s6 (192 KB),
//   w8s3 (chunks of 4 tiles per warp):
//     B=16 ctx 2k Hq/Hkv 32/8 (cuDNN 34.5 us, automatic split count, any flags): w4s2 38.2-39.0
//     us, w4s4 43.2-44.3, w4s6 41.0-41.8, w8s3 36.5-37.1, w4s3 37.9-38.4 (bench_attention_decode.py
//     sweep); w8s3 at batch 1 also in the chunk figures above.
//   w8s3c2 (chunks of 2 tiles per warp), with the fused combine: batch 1, Qwen3-8B heads, 384 / 640
//     / 1024 keys 8.42 / 8.84 / 8.97 us against w8s3c1's 6.63 / 6.99 / 7.29.
//   Fused combine: no combine kernel; the split CTA that arrives last (an arrival counter per
//     (sequence, kv head, head chunk)) merges every split's partial. Qwen3-8B decode step, batch
//     1, on top of the one-chunk path (decode_step.py, w8s3): 0.7-1.0% faster at 128 tokens,
//     0.5-0.8% at 384, 0.3% slower at 1024, 1.1-1.5% faster on a TP-2 rank's shapes at 128; engine
//     217.4 vs 216.6 tok/s at TP 1 and 359.8 vs 357.6 at TP 2; with w8s3c1 it lost at TP 2
//     (merging 31 splits' partials in one CTA). Too small and context-dependent to keep.
//
// Shared memory tiles are [16 keys][128 dims] with the 16-byte chunk index XOR-swizzled by
// (row & 7), so ldmatrix (8 rows x 16 bytes per phase) and the cp.async writes are bank-conflict
// free.
//
// FP8 cache (KV = uint8_t: e4m3 K/V with per-layer scales, launchers.h KvCache): the cp.async
// pipeline carries the e4m3 bytes at the 16-bit cache's stage count (half its shared memory, so
// more CTAs a SM), and each lane reads its mma fragments' bytes straight from the landed tile and
// widens them to fp16 in registers (fp8_qk / fp8_pv: e4m3 -> fp16 is exact, the dims taken in an
// order that makes a lane's bytes contiguous). Q is turned into fp16 once (exact in fp16's normal
// range). k_scale is folded into the softmax scale and v_scale into the output's normalisation.
// Measured (H200, benchmarks/decode_ab, CUDA-graph replays, Qwen3-8B heads, blocks of 16, us)
// against the earlier converted-tile path: B=176 x 100..2047 keys (the 8B workload's decode step)
// 110.9 vs 175.7, B=128 x 1k 76.9 vs 108.8, B=16 x 2k 21.3 vs 31.0, B=1 x 32k 23.5 vs 33.6, B=32 x
// 4k 77.2 vs 101.8, the batch-invariant launch at B=176 134.0 vs 171.8; outputs within a few
// bf16 ulps of it. Twice the stages in the same shared memory won at B=32 x 4k (66.8) and lost
// elsewhere (120.1 / 83.0 / 23.1 / 25.2 / 135.4 on the shapes above).
// Fewer instructions a byte did not pay (benchmarks/decode_ab, H100, 3 rounds, against this kernel;
// branch experiment/decode-fp8-alu-widen): the widening by bit operations instead of cvt ((w &
// 0x80008000) | ((w & 0x7f007f00) >> 1) is the value times 2^-8, the factor folded into the
// scales) 0.96-0.98x on every fp8 shape (B=176 x 100..2047 149.4 against 144.1 us); skipping o's
// rescale where no row's maximum moved, or the key compares of a tile inside both rows' lengths
// (the same bits), 1.00x. So what holds the e4m3 cache under the 16-bit one's rate (2.7 against
// 3.0 TB/s at B=176) is not its instruction count. Nor its occupancy or the cache's layout
// (benchmarks/decode_ab, H100, 3 rounds, same call; branch experiment/decode-fp8-occupancy):
// __launch_bounds__ for 4 w4s3 CTAs a SM instead of the 3 its 156 registers allow (128
// registers, a 28-byte spill) 0.91-0.97x (B=176 x 100..2047 160.2 against 145.2 us), for 2
// w8s3c1 CTAs 0.76-0.96x on the split shapes (B=16 x 2k 33.4 against 25.5); the e4m3 rate is the
// same whether a kv head's consecutive keys are 1 KB apart (Hkv 8: B=32 x 4k 2.65 TB/s), 256 B
// (Hkv 2: 2.61) or 128 B (Hkv 1: 2.63), or in pages of 256 (2.66), where the 16-bit cache reads
// 3.0-3.1 TB/s on each.
//
// Workspace: the binding passes fp32 [B, Hq, max_splits, D + 1]; this file uses it as two flat
// arrays, partial outputs [B, Hq, max_splits, D] followed by log2-sum-exps [B, Hq, max_splits], so
// the partial rows stay 16-byte aligned. Same bytes, private layout.
//
// Not checked on the device (no bound is passed, and a check would need a host sync): block_tables
// entries must be < num_blocks. seq_lens are clamped to [0, max_blocks * block_size]; a sequence of
// length 0 gets a zero output.
#include <algorithm>
#include <type_traits>

#include "qwen3_kernels/common.cuh"
#include "qwen3_kernels/e4m3.cuh"
#include "qwen3_kernels/mma.cuh"
#include "qwen3_kernels/launch.cuh"  // pdl_wait, pdl_launch_dependents, LaunchConfig, launch_ex
#include "prefill_common.cuh"  // PrefillParams, launch_decode_prefill_order, sm90_available

namespace qwen3_kernels {
namespace {

constexpr int kHeadDim = 128;
constexpr int kRows = 16;                       // q heads per CTA: the mma M dimension
constexpr int kTileKeys = 16;                   // keys per warp tile (= smallest block size)
constexpr int kTileElems = kTileKeys * kHeadDim;
constexpr int kStageElems = 2 * kTileElems;     // K tile then V tile
constexpr int kMergeStride = kHeadDim + 8;      // padded fp32 row: conflict-free float2 stores
constexpr int kMaxSplits = 64;                  // combine kernels hold one weight per split
constexpr int kCombineThreads = 128;            // one thread per dim
constexpr int kInvariantSplitTiles = kDecodeInvariantSplitKeys / 16;  // tiles of a fixed split
static_assert(kTileElems * 2 / 16 == 8 * 32, "a tile is 8 16-byte chunks per lane");
static_assert(kCombineThreads == kHeadDim, "the combine gives each thread one dim");

// The kernel shape: warps per CTA, cp.async stages per warp, and tiles per warp in a chunk (the
// unit of work a split takes: fewer tiles per chunk spread a short context over more splits).
template <int kWarps_, int kStages_, int kTilesPerWarpChunk_ = 4>
struct Shape {
  static constexpr int kWarps = kWarps_;
  static constexpr int kStages = kStages_;
  static constexpr int kTilesPerWarpChunk = kTilesPerWarpChunk_;
  static constexpr int kThreads = kWarps * 32;
  // Per warp: kStages stages of [K | V] tiles in the cache's element type.
  template <typename KV>
  static constexpr int warp_bytes() {
    return kStages * kStageElems * static_cast<int>(sizeof(KV));
  }
  static constexpr int kMergeBytes = (kWarps * kRows * kMergeStride + 2 * kWarps * kRows) * 4;
  template <typename KV>
  static constexpr int smem_bytes() {
    return kWarps * warp_bytes<KV>() > kMergeBytes ? kWarps * warp_bytes<KV>() : kMergeBytes;
  }
  static constexpr int kSmemBytes = smem_bytes<uint16_t>();  // the largest (16-bit cache)
  // Tiles of one chunk, the smallest non-empty split.
  static constexpr int kChunkTiles = kWarps * kTilesPerWarpChunk;
  static_assert(kThreads % kHeadDim == 0, "the merge gives each thread one dim of some rows");
  static_assert(kStages >= 2, "a pipeline needs a stage to fill while one is read");
};
using BatchShape = Shape<4, 3>;     // w4s3: 96 KB of shared memory, 2 CTAs per SM on H100/H200
using SplitShape = Shape<8, 3, 1>;  // w8s3c1: 192 KB, 1 CTA per SM, chunks of 1 tile per warp
using LeanShape = Shape<4, 2>;      // w4s2: 64 KB, 3 CTAs per SM (the invariant prefill's)

// The batch-invariant launch's CTA groups (paged_attention_decode's cta_first / cta_count): a
// kernel argument of its own, so the other launches' code does not change with it.
struct CtaGroups {
  const int32_t* first;  // [gridDim.z] or null (then CTA z takes batch row z alone)
  const int32_t* count;  // [gridDim.z]
};

struct DecodeParams {
  void* out;                    // [B, Hq, 128]
  const void* q;                // [B, Hq, 128]
  const void* k_cache;          // [num_blocks, block_size, Hkv, 128]
  const void* v_cache;          // [num_blocks, block_size, Hkv, 128]
  const int32_t* block_tables;  // [B, max_blocks]
  const int32_t* seq_lens;      // [B]
  float* ws_out;                // [B, Hq, max_splits, 128] partial outputs (normalised)
  float* ws_lse;                // [B, Hq, max_splits] log2-sum-exp of each partial (scaled logits)
  int num_q_heads, num_kv_heads, group, head_chunks;
  int block_size, max_blocks, num_splits, max_splits;
  int chunk_tiles;              // a sequence of at most this many tiles is read by split 0 alone
                                // (see "alone" in the main kernel): the launched shape's
                                // kChunkTiles, or split_tiles when that is set
  int split_tiles;              // > 0: every split covers this many tiles at fixed positions (the
                                // batch-invariant launch); 0: the count follows num_splits
  int ctx_cap;                  // min(max_blocks * block_size, 2^30): seq_lens are clamped to it
  int interleave;               // 1: split s takes chunks s, s + num_splits, ... (else contiguous)
  int pdl;                      // 1: launched with PDL; wait for the previous grid first
  int combine_heads;            // q heads per combine CTA (a divisor of Hq): 1, or the group
                                // where the batch alone fills the GPU (fewer CTAs that find a
                                // sequence written alone and return)
  int skip_alone;               // 1 (the batch-invariant launch where invariant_prefill_order
                                // holds): rows that fit in split 0 are not this kernel's (decode:
                                // decode_prefill_order.cu; prefill: the prefill kernel), so it
                                // leaves them alone
  float scale_log2;             // softmax scale * k_scale * log2(e): the kernel works in base 2
  float v_scale;                // the output's factor (1 but for an fp8 cache)
};

// ---- PTX wrappers -------------------------------------------------------------------------------

// Element offset of 16-byte chunk `chunk` of row `row` in a swizzled [16][128] tile.
__device__ __forceinline__ int swz(int row, int chunk) {
  return row * kHeadDim + ((chunk ^ (row & 7)) << 3);
}

// ---- fp8 cache: tiles straight into mma fragments ----------------------------------------------
//
// An e4m3 tile is [16 keys][128 bytes]. No ldmatrix reads bytes as mma fragments, so each lane
// reads 16-byte chunks with plain loads and widens them in registers (e4m3 -> f16 is exact), and
// the fragments take the dims in an order that makes those chunks contiguous:
//   - S = Q K^T (fp8_qk): lane (g, t) holds key g (+8) at dims 64 h + 16 t .. + 15 (h = 0, 1),
//     and these feed k-steps 4 h .. 4 h + 3: k-step m = 4 h + mm takes dims 64 h + 16 t + 4 mm
//     + 0, 1 as the fragment's k = 2 t, 2 t + 1 and + 2, 3 as k = 2 t + 8, 2 t + 9. Q's fragments
//     are loaded in the same order (fp8_dim), so every product meets its partner: the same dot
//     products.
//   - O += P V (fp8_pv): lane (g, t) reads keys 2 t, 2 t + 1, 2 t + 8, 2 t + 9 at dims 16 g ..
//     + 15, and n-tile j's column n is dim 16 n + j, so the lane's column g of the 16 n-tiles is
//     its own 16 bytes; byte permutes pair keys 2 t, 2 t + 1 (and 2 t + 8, 2 t + 9) of one dim.
//     O's fragment o[j][e] is then row g (e < 2) or g + 8, dim 32 t + 16 (e & 1) + j.
// Chunk c of row r is stored at chunk c ^ (r & 6) ^ (4 (r & 1)): the 8 lanes of each quarter-warp
// read 8 different bank groups, in fp8_qk (rows g, g + 1 at chunks 4 h + t) and in fp8_pv (rows
// 2 t (+1, +8, +9) at chunk g), and the cp.async writes (8 lanes a row) stay conflict-free.

// Byte offset of 16-byte chunk `chunk` of row `row` in a swizzled e4m3 [16][128] tile.
__device__ __forceinline__ int swz8(int row, int chunk) {
  return row * kHeadDim + ((chunk ^ (row & 6) ^ ((row & 1) << 2)) << 4);
}

// The dim of Q's A-fragment pair at k-step ks, half hk (k = 2 t or 2 t + 8) for an fp8 cache.
__device__ __forceinline__ int fp8_dim(int ks, int hk, int t) {
  return 64 * (ks >> 2) + 16 * t + 4 * (ks & 3) + 2 * hk;
}

// s[nt] += Q (qa: f16 A fragments in fp8_dim's order) x K^T of keys 8 nt .. 8 nt + 7 of the e4m3
// K tile k8.
__device__ __forceinline__ void fp8_qk(float (&s)[2][4], const uint32_t (&qa)[8][4],
                                       const uint8_t* k8, int g, int t) {
  uint4 w[2][2];
#pragma unroll
  for (int nt = 0; nt < 2; ++nt)
#pragma unroll
    for (int h = 0; h < 2; ++h)
      w[nt][h] = *reinterpret_cast<const uint4*>(k8 + swz8(8 * nt + g, 4 * h + t));
#pragma unroll
  for (int nt = 0; nt < 2; ++nt) {
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      const uint32_t words[4] = {w[nt][h].x, w[nt][h].y, w[nt][h].z, w[nt][h].w};
#pragma unroll
      for (int mm = 0; mm < 4; ++mm) {
        uint32_t b0, b1;  // dims + 0, 1 (k = 2 t, 2 t + 1) and + 2, 3 (k = 2 t + 8, 2 t + 9)
        fp8::e4m3x4_to_half2x2(words[mm], b0, b1);
        mma_16816<__half>(s[nt], qa[4 * h + mm], b0, b1);
      }
    }
  }
}

// o[j] += P (pa: f16 A fragment over the tile's 16 keys) x V of the e4m3 V tile v8, n-tile j's
// column n being dim 16 n + j.
__device__ __forceinline__ void fp8_pv(float (&o)[16][4], const uint32_t (&pa)[4],
                                       const uint8_t* v8, int g, int t) {
  const uint4 a = *reinterpret_cast<const uint4*>(v8 + swz8(2 * t, g));
  const uint4 b = *reinterpret_cast<const uint4*>(v8 + swz8(2 * t + 1, g));
  const uint4 c = *reinterpret_cast<const uint4*>(v8 + swz8(2 * t + 8, g));
  const uint4 d = *reinterpret_cast<const uint4*>(v8 + swz8(2 * t + 9, g));
  const uint32_t aw[4] = {a.x, a.y, a.z, a.w}, bw[4] = {b.x, b.y, b.z, b.w};
  const uint32_t cw[4] = {c.x, c.y, c.z, c.w}, dw[4] = {d.x, d.y, d.z, d.w};
#pragma unroll
  for (int q = 0; q < 4; ++q) {  // dims 16 g + 4 q .. + 3: n-tiles 4 q .. 4 q + 3
    // [key 2t, key 2t + 1] byte pairs of dims +0, +1 and +2, +3 (the lower key in the lower byte)
    uint32_t b0[4], b1[4];
    fp8::e4m3x4_to_half2x2(__byte_perm(aw[q], bw[q], 0x5140), b0[0], b0[1]);
    fp8::e4m3x4_to_half2x2(__byte_perm(aw[q], bw[q], 0x7362), b0[2], b0[3]);
    fp8::e4m3x4_to_half2x2(__byte_perm(cw[q], dw[q], 0x5140), b1[0], b1[1]);
    fp8::e4m3x4_to_half2x2(__byte_perm(cw[q], dw[q], 0x7362), b1[2], b1[3]);
#pragma unroll
    for (int e = 0; e < 4; ++e) mma_16816<__half>(o[4 * q + e], pa, b0[e], b1[e]);
  }
}

// ---- split weights ------------------------------------------------------------------------------

// One warp, one (b, h): the weights w_s = 2^(lse_s - max lse) of the splits lane and lane + 32
// (lse_a, lse_c; -inf past num_splits) and their sum over all splits (in every lane). A split that
// saw no key (lse = -inf) weighs 0, so a caller that skips zero weights never reads its stale
// (maybe NaN) partial. Shared by both combine kernels.
struct SplitWeights {
  float a, c;   // weights of splits lane and lane + 32
  float total;  // sum of all weights (0 when no split saw a key)
};
__device__ __forceinline__ SplitWeights split_weights(float lse_a, float lse_c) {
  const float m = warp_max(fmaxf(lse_a, lse_c));
  SplitWeights w;
  w.a = lse_a == -INFINITY ? 0.f : exp2f(lse_a - m);
  w.c = lse_c == -INFINITY ? 0.f : exp2f(lse_c - m);
  w.total = warp_sum(w.a + w.c);
  return w;
}

// Whether sequence b's split 0 wrote its output itself (the main kernel's "alone" case): the
// combine has nothing to do for it. Called after the wait for the main kernel.
__device__ __forceinline__ bool written_alone(const DecodeParams& p, int64_t bh) {
  const int seq_len = max(0, min(p.seq_lens[bh / p.num_q_heads], p.ctx_cap));
  return (seq_len + kTileKeys - 1) / kTileKeys <= p.chunk_tiles;
}

// One (b, h)'s combine, shared by the combine kernel and the looping main kernel's own combine
// (so both give the same bits): combine warp cw of 4 sums splits cw, cw + 4, ... for its lane's
// 4 dims (weights w_s = 2^(lse_s - max lse); a split that saw no key is skipped, never
// multiplied: its stale row may hold NaN); combine_finish then adds the 4 warps' sums in order.
constexpr int kCombineWarps = 4;
struct CombinePart {
  float4 acc;   // this lane's 4 dims, this warp's splits
  float total;  // sum of all weights (0 when no split saw a key)
};
__device__ __forceinline__ CombinePart combine_part(const DecodeParams& p, int64_t bh, int cw,
                                                    int lane) {
  constexpr int kPerWarp = kMaxSplits / kCombineWarps;  // splits a warp may own
  const float* lse = p.ws_lse + bh * p.max_splits;
  const float4* part =
      reinterpret_cast<const float4*>(p.ws_out + bh * p.max_splits * kHeadDim) + lane;
  float4 v[kPerWarp];
#pragma unroll
  for (int k = 0; k < kPerWarp; ++k) {
    const int s = cw + k * kCombineWarps;
    v[k] = s < p.num_splits ? part[s * (kHeadDim / 4)] : make_float4(0.f, 0.f, 0.f, 0.f);
  }
  const float a = lane < p.num_splits ? lse[lane] : -INFINITY;
  const float c = lane + 32 < p.num_splits ? lse[lane + 32] : -INFINITY;
  const SplitWeights sw = split_weights(a, c);  // every warp the same
  float4 acc = make_float4(0.f, 0.f, 0.f, 0.f);
#pragma unroll
  for (int k = 0; k < kPerWarp; ++k) {
    const int s = cw + k * kCombineWarps;  // the same in all lanes
    if (s < p.num_splits) {
      const float w = __shfl_sync(0xffffffffu, s < 32 ? sw.a : sw.c, s & 31);
      if (w != 0.f) {
        acc.x += w * v[k].x;
        acc.y += w * v[k].y;
        acc.z += w * v[k].z;
        acc.w += w * v[k].w;
      }
    }
  }
  return CombinePart{acc, sw.total};
}
// red: the 4 warps' sums [kCombineWarps][32] float4 = [kCombineWarps][128] floats; dim d's value.
__device__ __forceinline__ float combine_finish(const float4* red, int d, float total) {
  const float* redf = reinterpret_cast<const float*>(red);
  float sum = 0.f;
#pragma unroll
  for (int w = 0; w < kCombineWarps; ++w) sum += redf[w * kHeadDim + d];
  return total > 0.f ? sum / total : 0.f;
}

// ---- main kernel --------------------------------------------------------------------------------

// Asks L2 for the 128-byte line at ptr (no register, no L1 line; a hint the memory system may drop).
__device__ __forceinline__ void prefetch_l2(const void* ptr) {
  asm volatile("prefetch.global.L2 [%0];\n" ::"l"(ptr));
}

// S::kThreads threads, S::kSmemBytes of dynamic smem (the kernel is paged_decode_kernel below).
// Keep this loop free of code it does not run: with a merge step compiled into the split kernel
// (not run), ptxas scheduled the main loop differently and B=1 ctx 32k went from 37.8 to 43.7 us
// (H200, bench_attention_decode.py).
// KV: the cache's element type (T, or uint8_t for e4m3); M: the mma's 16-bit type.
// One split of one (sequence, kv head, head chunk): the whole CTA, shared memory included.
// kMulti (the batch-invariant launch): the CTA's rows are the q heads of ntok consecutive rows b ..
// b + ntok - 1 of the batch (prefill_as_decode's query tokens of one sequence; one row b =
// blockIdx.z without groups.first), each masked at its own length. A row's arithmetic is the same
// whoever shares the CTA: a tile past its length only multiplies its state by 2^0 and adds zeros,
// and a state that has seen no key stays (-inf, 0, 0), as for a warp that read nothing.
// kWaitInside (the PDL launch of the default path): the kernel has not waited for the kernel
// before; this function waits (p.pdl) before its first read of q or K/V into shared memory and
// before any write, and until then reads only seq_lens and the block table (which no kernel of
// the package writes) and prefetches its first K / V tiles into L2 (a hint: L2 is where the
// writes of the kernel before land, so a line it writes later is read fresh after the wait).
// Every CTA waits, also one that returns early, so the grid ends after the one before it.
template <typename T, typename KV, bool kSplit, typename S, bool kMulti = false,
          bool kWaitInside = false>
__device__ __forceinline__ void decode_split(const DecodeParams& p, const int split,
                                             unsigned char* smem, const CtaGroups& groups) {
  constexpr bool kFp8 = std::is_same_v<KV, uint8_t>;
  using M = std::conditional_t<kFp8, __half, T>;
  constexpr int kStageBytes = kStageElems * static_cast<int>(sizeof(KV));
  constexpr int kWarps = S::kWarps;
  constexpr int kStages = S::kStages;
  constexpr int kChunkTiles = S::kChunkTiles;
  constexpr int kTilesPerWarpChunk = S::kTilesPerWarpChunk;
  const int kvh = blockIdx.y / p.head_chunks;
  const int chunk = blockIdx.y % p.head_chunks;
  const int b = kMulti && groups.first != nullptr ? groups.first[blockIdx.z] : blockIdx.z;
  if constexpr (kMulti) {
    if (b < 0) return;  // an unused group
  }
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  const int g = lane >> 2, t = lane & 3;  // mma fragment coordinates: row g (and g + 8), col pair t
  const int head0 = kvh * p.group + chunk * kRows;
  const int row_heads = min(kRows, p.group - chunk * kRows);  // q heads of one token here
  const int ntok = kMulti && groups.first != nullptr
                       ? max(1, min(groups.count[blockIdx.z], kRows / row_heads))
                       : 1;
  const int rows = row_heads * ntok;
  // Row r: batch row b + r / row_heads, q head head0 + r % row_heads; its length (0 past rows).
  auto row_bh = [&](int r) -> int64_t {
    if constexpr (!kMulti) return static_cast<int64_t>(b) * p.num_q_heads + head0 + r;
    return static_cast<int64_t>(b + r / row_heads) * p.num_q_heads + head0 + r % row_heads;
  };
  auto row_len = [&](int r) -> int {
    return r < rows ? max(0, min(p.seq_lens[b + r / row_heads], p.ctx_cap)) : 0;
  };

  // This split's share of the sequence's tiles, from the length on the device (kMulti: the
  // longest of the CTA's rows).
  const int seq_len = [&] {
    int len = max(0, min(p.seq_lens[b], p.ctx_cap));
    if constexpr (kMulti) {
      for (int i = 1; i < ntok; ++i) len = max(len, row_len(i * row_heads));
    }
    return len;
  }();
  const int n_tiles = (seq_len + kTileKeys - 1) / kTileKeys;
  const bool interleave = kSplit && p.interleave;
  // contiguous splits: tiles [tile_begin, tile_end); warp w takes tile_begin + w + i * kWarps.
  // (tile_begin is 0 without splits, known at compile time, so the first block-table reads need
  // not wait for seq_lens to arrive)
  int tile_begin = 0, n_mine = 0;
  bool empty = false;
  if (interleave) {
    // chunks split, split + num_splits, ...; the last chunk of the sequence may be partial
    const int n_chunks = (n_tiles + kChunkTiles - 1) / kChunkTiles;
    empty = split >= n_chunks;
    if (!empty) {
      const int my_chunks = (n_chunks - 1 - split) / p.num_splits + 1;
      n_mine = my_chunks * kTilesPerWarpChunk;
      if ((n_chunks - 1 - split) % p.num_splits == 0) {  // this split owns the last chunk
        const int rem = n_tiles - (n_chunks - 1) * kChunkTiles;  // its tiles, 1 .. kChunkTiles
        const int in_last = rem > warp ? (rem - warp + kWarps - 1) / kWarps : 0;
        n_mine += in_last - kTilesPerWarpChunk;
      }
    }
  } else {
    // kMulti (the batch-invariant launch, fixed splits of p.split_tiles): where a split starts
    // does not depend on seq_len, so the first block-table reads need not wait for it.
    const int per_split = kMulti || p.split_tiles > 0
                              ? p.split_tiles
                              : max((n_tiles + p.num_splits - 1) / p.num_splits, kChunkTiles);
    tile_begin = kMulti ? split * per_split : kSplit ? min(split * per_split, n_tiles) : 0;
    const int tile_end = min(tile_begin + per_split, n_tiles);
    empty = kMulti ? tile_begin >= tile_end : tile_begin == tile_end;  // (kMulti: may pass it)
    const int my_first = tile_begin + warp;
    n_mine = tile_end > my_first ? (tile_end - my_first + kWarps - 1) / kWarps : 0;
  }
  // A sequence of at most one chunk has all its keys in split 0, in both modes. That split then
  // writes the final output itself and the combine skips the sequence (it finds the same
  // condition), so a short context pays neither the partials' round trip nor the combine's.
  // (Qwen3-8B batch 1 at 384 tokens: the combine cost ~2 us a layer, 1.7% of the step.)
  const bool alone = kSplit && n_tiles <= p.chunk_tiles;
  auto wait_previous = [&]() {
    if (kWaitInside && p.pdl) pdl_wait();
  };
  if (alone && (split > 0 || p.skip_alone)) {
    wait_previous();
    return;
  }
  if (kSplit && empty && !alone) {  // nothing to read: an empty partial, skipped by the combine
    wait_previous();
    if (threadIdx.x < rows) {
      const int64_t bh = kMulti ? row_bh(threadIdx.x)
                                : static_cast<int64_t>(b) * p.num_q_heads + head0 + threadIdx.x;
      p.ws_lse[bh * p.max_splits + split] = -INFINITY;
    }
    return;
  }
  // The lengths of this lane's rows g and g + 8 (kMulti; otherwise both are seq_len).
  const int len_lo = kMulti ? row_len(g) : seq_len;
  const int len_hi = kMulti ? row_len(g + 8) : seq_len;
  // The sequence tile of this warp's i-th tile.
  auto tile_of = [&](int i) -> int {
    if (interleave) {
      const int c = split + (i / kTilesPerWarpChunk) * p.num_splits;
      return c * kChunkTiles + warp + (i % kTilesPerWarpChunk) * kWarps;
    }
    return tile_begin + warp + i * kWarps;
  };

  // Q as mma A fragments, 8 k-steps of 16 dims; padding rows are zero. An fp8 cache's k-steps
  // take the dims in fp8_qk's order (the same permutation for Q and K: the same dot products).
  // Loaded after the wait (kWaitInside: after the first copies), else before them.
  uint32_t qa[8][4];
  auto load_q = [&]() {
    const T* q = static_cast<const T*>(p.q) +
                 (kMulti ? 0 : (static_cast<int64_t>(b) * p.num_q_heads + head0) * kHeadDim);
#pragma unroll
    for (int ks = 0; ks < 8; ++ks) {
#pragma unroll
      for (int r = 0; r < 4; ++r) {
        const int row = g + (r & 1) * 8;
        const int col = kFp8 ? fp8_dim(ks, r >> 1, t) : ks * 16 + (r >> 1) * 8 + 2 * t;
        const uint32_t w =
            row < rows ? *reinterpret_cast<const uint32_t*>(
                             q + (kMulti ? row_bh(row) * kHeadDim : row * kHeadDim) + col)
                       : 0u;
        qa[ks][r] = kFp8 ? fp8::to_half2<T>(w) : w;
      }
    }
  };
  if constexpr (!kWaitInside) load_q();

  // Per-warp cp.async pipeline.
  uint8_t* pipe = smem + warp * S::template warp_bytes<KV>();
  const int32_t* table = p.block_tables + static_cast<int64_t>(b) * p.max_blocks;
  const int64_t row_stride = static_cast<int64_t>(p.num_kv_heads) * kHeadDim;  // between keys
  const int64_t block_stride = row_stride * p.block_size;
  const KV* k_head = static_cast<const KV*>(p.k_cache) + static_cast<int64_t>(kvh) * kHeadDim;
  const KV* v_head = static_cast<const KV*>(p.v_cache) + static_cast<int64_t>(kvh) * kHeadDim;
  // A cache row is kRowChunks 16-byte chunks: lane copies chunk lane_chunk of rows
  // lane / kRowChunks + (32 / kRowChunks) j.
  constexpr int kRowChunks = kHeadDim * static_cast<int>(sizeof(KV)) / 16;
  constexpr int kRowsPerPass = 32 / kRowChunks;
  const int lane_chunk = lane % kRowChunks;
  const int lane_row = lane / kRowChunks;

  // The block id of the i-th tile of this warp, read one tile ahead of its copy so the copy never
  // waits on the block-table load. The index is clamped to the table rather than checked against
  // n_mine, so the read does not wait on seq_len either (except for contiguous splits, whose
  // start depends on it); ids past n_mine are never used.
  auto block_of = [&](int i) -> int {
    return table[min(tile_of(i) * kTileKeys / p.block_size, p.max_blocks - 1)];
  };
  auto issue = [&](int i, int block) {
    const int key0 = tile_of(i) * kTileKeys;
    const int64_t base = static_cast<int64_t>(block) * block_stride +
                         static_cast<int64_t>(key0 % p.block_size) * row_stride +
                         lane_chunk * (16 / static_cast<int>(sizeof(KV)));
    uint8_t* ks = pipe + (i % kStages) * kStageBytes;
    uint8_t* vs = ks + kStageBytes / 2;
#pragma unroll
    for (int j = 0; j < kTileKeys / kRowsPerPass; ++j) {
      const int row = lane_row + kRowsPerPass * j;
      const bool valid = key0 + row < seq_len;
      const int64_t off = base + (valid ? row : 0) * row_stride;
      // 16-bit tiles are swizzled for ldmatrix, fp8 ones for fp8_qk's and fp8_pv's reads.
      const int dst = kFp8 ? swz8(row, lane_chunk) : swz(row, lane_chunk) * 2;
      cp_async_16(smem_addr(ks + dst), k_head + off, valid);
      cp_async_16(smem_addr(vs + dst), v_head + off, valid);
    }
  };

  // kWaitInside: the first tiles' block ids (and the next one's) are read before the wait, and
  // their K / V prefetched into L2, so that after it the copies find them there: at batch 1 the
  // chain qk_norm_rope -> decode then has one L2 round trip before the first K / V byte, not the
  // seq_lens, block-table and HBM round trips one after another. Measured (H100, one call,
  // alternating, .prebuilt builds, bench_engine.py --batch1): Qwen3-8B-FP8 291.7 / 291.6 decode
  // tok/s against 287.3 / 287.3, Qwen3-8B 181.2 / 181.4 against 180.8 / 180.8;
  // benchmarks/decode_ab (CUDA-graph replays, the same bits): batch 1 at 512 / 1024 keys 4.70 /
  // 5.53 us against 5.25 / 6.09 (bf16 cache), B=16 x 2k 45.6 against 47.2, B=1 x 32k 47.6
  // against 49.1, the batch shapes (no PDL) within 0.3%.
  int next_block;
  if constexpr (kWaitInside) {
    int first_blocks[kStages - 1];
#pragma unroll
    for (int s = 0; s < kStages - 1; ++s) first_blocks[s] = block_of(s);
    next_block = block_of(kStages - 1);
    if (p.pdl) {
      constexpr int kLinesPerRow = kHeadDim * static_cast<int>(sizeof(KV)) / 128;
#pragma unroll
      for (int s = 0; s < kStages - 1; ++s) {
        const int key0 = tile_of(s) * kTileKeys;
        const int64_t base = static_cast<int64_t>(first_blocks[s]) * block_stride +
                             static_cast<int64_t>(key0 % p.block_size) * row_stride;
#pragma unroll
        for (int idx = lane; idx < kTileKeys * kLinesPerRow; idx += 32) {
          const int row = idx / kLinesPerRow;
          const int64_t off =
              base + row * row_stride + (idx % kLinesPerRow) * (128 / sizeof(KV));
          if (s < n_mine && key0 + row < seq_len) {
            prefetch_l2(k_head + off);
            prefetch_l2(v_head + off);
          }
        }
      }
    }
    wait_previous();
#pragma unroll
    for (int s = 0; s < kStages - 1; ++s) {
      if (s < n_mine) issue(s, first_blocks[s]);
      cp_async_commit();  // empty groups keep the wait_group count uniform
    }
    load_q();
  } else {
#pragma unroll
    for (int s = 0; s < kStages - 1; ++s) {
      if (s < n_mine) issue(s, block_of(s));
      cp_async_commit();
    }
    next_block = block_of(kStages - 1);
  }

  float o[16][4];  // O accumulator: rows g and g + 8, dims 8j + 2t (+1) (fp8: see fp8_pv)
#pragma unroll
  for (int j = 0; j < 16; ++j) o[j][0] = o[j][1] = o[j][2] = o[j][3] = 0.f;
  float m0 = -INFINITY, m1 = -INFINITY;  // running max of rows g, g + 8 (scaled, base 2)
  float l0 = 0.f, l1 = 0.f;              // this lane's part of the running sums

  for (int i = 0; i < n_mine; ++i) {
    cp_async_wait<kStages - 2>();
    __syncwarp();  // tile i visible to the whole warp; tile i - 1's buffer free to overwrite
    if (i + kStages - 1 < n_mine) {
      issue(i + kStages - 1, next_block);
      next_block = block_of(i + kStages);
    }
    cp_async_commit();

    const uint8_t* tile = pipe + (i % kStages) * kStageBytes;  // [K | V]

    // S = Q K^T for 16 keys: two n8 tiles.
    float s[2][4] = {};
    if constexpr (kFp8) {
      fp8_qk(s, qa, tile, g, t);
    } else {
      // ldmatrix matrices: (keys 0-7 | 8-15) x (dims lo | hi).
      const M* ks = reinterpret_cast<const M*>(tile);
      const int key = (lane & 7) + ((lane >> 4) << 3);
      const int hi = (lane >> 3) & 1;
#pragma unroll
      for (int kk = 0; kk < 8; ++kk) {
        uint32_t kb[4];
        ldmatrix_x4(kb, smem_addr(ks + swz(key, 2 * kk + hi)));
        mma_16816<M>(s[0], qa[kk], kb[0], kb[1]);
        mma_16816<M>(s[1], qa[kk], kb[2], kb[3]);
      }
    }

    // Online softmax in base 2; keys past the sequence end are -inf.
    const int key_base = tile_of(i) * kTileKeys;
    float mx0 = -INFINITY, mx1 = -INFINITY;
#pragma unroll
    for (int j = 0; j < 2; ++j) {
#pragma unroll
      for (int e = 0; e < 4; ++e) {
        const int key = key_base + 8 * j + 2 * t + (e & 1);
        s[j][e] = key < ((e & 2) ? len_hi : len_lo) ? s[j][e] * p.scale_log2 : -INFINITY;
      }
      mx0 = fmaxf(mx0, fmaxf(s[j][0], s[j][1]));
      mx1 = fmaxf(mx1, fmaxf(s[j][2], s[j][3]));
    }
#pragma unroll
    for (int off = 1; off < 4; off <<= 1) {
      mx0 = fmaxf(mx0, __shfl_xor_sync(0xffffffffu, mx0, off));
      mx1 = fmaxf(mx1, __shfl_xor_sync(0xffffffffu, mx1, off));
    }
    // Every tile holds at least one real key of the longest row, so its new maximum is finite;
    // kMulti: a shorter row's may be -inf (no key yet), and then 0 stands in as the reference
    // (alpha and every p are 0, and the state stays (-inf, 0, 0)).
    const float new_m0 = fmaxf(m0, mx0), new_m1 = fmaxf(m1, mx1);
    const float ref0 = kMulti && new_m0 == -INFINITY ? 0.f : new_m0;
    const float ref1 = kMulti && new_m1 == -INFINITY ? 0.f : new_m1;
    const float alpha0 = exp2f(m0 - ref0), alpha1 = exp2f(m1 - ref1);
    m0 = new_m0;
    m1 = new_m1;
    float sum0 = 0.f, sum1 = 0.f;
#pragma unroll
    for (int j = 0; j < 2; ++j) {
      s[j][0] = exp2f(s[j][0] - ref0);
      s[j][1] = exp2f(s[j][1] - ref0);
      s[j][2] = exp2f(s[j][2] - ref1);
      s[j][3] = exp2f(s[j][3] - ref1);
      sum0 += s[j][0] + s[j][1];
      sum1 += s[j][2] + s[j][3];
    }
    l0 = l0 * alpha0 + sum0;
    l1 = l1 * alpha1 + sum1;
#pragma unroll
    for (int j = 0; j < 16; ++j) {
      o[j][0] *= alpha0;
      o[j][1] *= alpha0;
      o[j][2] *= alpha1;
      o[j][3] *= alpha1;
    }

    // O += P V. P's C-fragment layout (two n8 tiles) is exactly the A layout of one k16 step.
    uint32_t pa[4];
    pa[0] = pack2<M>(s[0][0], s[0][1]);
    pa[1] = pack2<M>(s[0][2], s[0][3]);
    pa[2] = pack2<M>(s[1][0], s[1][1]);
    pa[3] = pack2<M>(s[1][2], s[1][3]);
    if constexpr (kFp8) {
      fp8_pv(o, pa, tile + kTileElems, g, t);
    } else {
      // ldmatrix.trans matrices: (keys 0-7 | 8-15) x (dims 16n .. +7 | 16n + 8 .. +15).
      const M* vs = reinterpret_cast<const M*>(tile) + kTileElems;
      const int key = (lane & 7) + (((lane >> 3) & 1) << 3);
      const int hi = lane >> 4;
#pragma unroll
      for (int n = 0; n < 8; ++n) {
        uint32_t vb[4];
        ldmatrix_x4_trans(vb, smem_addr(vs + swz(key, 2 * n + hi)));
        mma_16816<M>(o[2 * n], pa, vb[0], vb[1]);
        mma_16816<M>(o[2 * n + 1], pa, vb[2], vb[3]);
      }
    }
  }

  // Merge the warps' partial softmax states through shared memory (pipeline buffers reused).
  cp_async_wait<0>();
#pragma unroll
  for (int off = 1; off < 4; off <<= 1) {
    l0 += __shfl_xor_sync(0xffffffffu, l0, off);
    l1 += __shfl_xor_sync(0xffffffffu, l1, off);
  }
  __syncthreads();
  float* so = reinterpret_cast<float*>(smem);                   // [kWarps][kRows][kMergeStride]
  float* sm = so + kWarps * kRows * kMergeStride;               // [kWarps][kRows] maxima
  float* sl = sm + kWarps * kRows;                              // [kWarps][kRows] sums
  {
    if constexpr (kFp8) {
      // o[j][e]: dim 32 t + 16 (e & 1) + j (fp8_pv), so four j are four consecutive dims
      float* f0 = so + (warp * kRows + g) * kMergeStride + 32 * t;
      float* f1 = f0 + 8 * kMergeStride;
#pragma unroll
      for (int j = 0; j < 16; j += 4) {
#pragma unroll
        for (int e = 0; e < 2; ++e) {
          *reinterpret_cast<float4*>(f0 + 16 * e + j) =
              make_float4(o[j][e], o[j + 1][e], o[j + 2][e], o[j + 3][e]);
          *reinterpret_cast<float4*>(f1 + 16 * e + j) =
              make_float4(o[j][2 + e], o[j + 1][2 + e], o[j + 2][2 + e], o[j + 3][2 + e]);
        }
      }
    } else {
      // o[j][e]: dim 8 j + 2 t + (e & 1)
      float* r0 = so + (warp * kRows + g) * kMergeStride + 2 * t;
      float* r1 = r0 + 8 * kMergeStride;
#pragma unroll
      for (int j = 0; j < 16; ++j) {
        *reinterpret_cast<float2*>(r0 + 8 * j) = make_float2(o[j][0], o[j][1]);
        *reinterpret_cast<float2*>(r1 + 8 * j) = make_float2(o[j][2], o[j][3]);
      }
    }
    if (t == 0) {
      sm[warp * kRows + g] = m0;
      sm[warp * kRows + g + 8] = m1;
      sl[warp * kRows + g] = l0;
      sl[warp * kRows + g + 8] = l1;
    }
  }
  __syncthreads();

  // Thread (d, r0): dim d of rows r0, r0 + kThreads / 128, ...
  const int d = threadIdx.x % kHeadDim;
  for (int r = threadIdx.x / kHeadDim; r < rows; r += S::kThreads / kHeadDim) {
    float m = -INFINITY;
#pragma unroll
    for (int w = 0; w < kWarps; ++w) m = fmaxf(m, sm[w * kRows + r]);
    float l = 0.f, acc = 0.f;
    if (m != -INFINITY) {  // else: no key at all in this split (or an empty sequence)
#pragma unroll
      for (int w = 0; w < kWarps; ++w) {
        const float f = exp2f(sm[w * kRows + r] - m);  // 0 for an idle warp (max -inf)
        l += sl[w * kRows + r] * f;
        acc += so[(w * kRows + r) * kMergeStride + d] * f;
      }
    }
    const float val = l > 0.f ? acc / l * p.v_scale : 0.f;
    const int64_t bh = row_bh(r);
    // kMulti: a row that fits in split 0 is written by split 0 alone, whatever the CTA's longest
    bool row_alone = alone;
    if constexpr (kMulti) {
      row_alone = (row_len(r) + kTileKeys - 1) / kTileKeys <= p.chunk_tiles;
      if (row_alone && (split > 0 || p.skip_alone)) continue;
    }
    if (!kSplit || row_alone) {
      static_cast<T*>(p.out)[bh * kHeadDim + d] = from_float<T>(val);
    } else {
      const int64_t slot = bh * p.max_splits + split;
      p.ws_out[slot * kHeadDim + d] = val;
      if (d == 0) p.ws_lse[slot] = l > 0.f ? m + __log2f(l) : -INFINITY;
    }
  }
}

// The looping kernel's own combine (see paged_decode_kernel): the CTA's rows as decode_split
// numbers them, kCombineThreads threads a row (S::kThreads / kCombineThreads rows at a time).
template <typename T, typename S>
__device__ __noinline__ void combine_in_cta(const DecodeParams& p, const CtaGroups& groups,
                                            unsigned char* smem) {
  constexpr int kGroups = S::kThreads / kCombineThreads;
  static_assert(S::kThreads % kCombineThreads == 0, "whole combine groups");
  const int kvh = blockIdx.y / p.head_chunks, chunk = blockIdx.y % p.head_chunks;
  const int b = groups.first != nullptr ? groups.first[blockIdx.z] : blockIdx.z;
  if (b < 0) return;
  const int head0 = kvh * p.group + chunk * kRows;
  const int row_heads = min(kRows, p.group - chunk * kRows);
  const int ntok =
      groups.first != nullptr ? max(1, min(groups.count[blockIdx.z], kRows / row_heads)) : 1;
  const int rows = row_heads * ntok;
  // The CTA's longest row fits in split 0: every row was written alone (the common case of a
  // batch that fills the GPU), and nothing is left to combine. The same in every thread.
  int longest = 0;
  for (int i = 0; i < ntok; ++i) longest = max(longest, min(p.seq_lens[b + i], p.ctx_cap));
  if ((longest + kTileKeys - 1) / kTileKeys <= p.chunk_tiles) return;
  float4* red = reinterpret_cast<float4*>(smem);  // [kGroups][kCombineWarps][32]
  const int grp = threadIdx.x / kCombineThreads, d = threadIdx.x % kCombineThreads;
  const int cw = d / 32, lane = threadIdx.x % 32;
  for (int r0 = 0; r0 < rows; r0 += kGroups) {
    const int r = r0 + grp;
    const int64_t bh =
        static_cast<int64_t>(b + r / row_heads) * p.num_q_heads + head0 + r % row_heads;
    const bool act = r < rows && !written_alone(p, bh);
    CombinePart c{};
    if (act) {
      c = combine_part(p, bh, cw, lane);
      red[(grp * kCombineWarps + cw) * 32 + lane] = c.acc;
    }
    __syncthreads();
    if (act)
      static_cast<T*>(p.out)[bh * kHeadDim + d] =
          from_float<T>(combine_finish(red + grp * kCombineWarps * 32, d, c.total));
    __syncthreads();
  }
}

// grid (launched splits, Hkv * head_chunks, B). kLoop (the batch-invariant launch): the CTA of
// launched split x runs splits x, x + gridDim.x, ... of p.num_splits in turn, so the grid follows
// the batch (enough CTAs to fill the GPU) while the splits stay at fixed key positions; a grid of
// p.num_splits CTAs per (sequence, kv head) would launch mostly empty CTAs, each paying a launch and
// a seq_lens round trip.
//
// kAloneFast (the batch-invariant decode launch, no CTA groups): a sequence that fits in split 0
// runs the default launch's one-split code (kSplit = false) in the CTA of launched split 0, and
// the CTA's other launched splits return. Same tiles, same per-warp order, same merge as the
// looping path's split 0 with one row per CTA (its per-row masks then equal the sequence's own),
// so the same bits, without the looping path's per-row lengths and skipped splits. Measured
// (H200, Qwen3-8B, one call): deterministic workload 8,805 / 8,812 against 8,592 / 8,596 output
// tok/s, batch 1 215.2 against 211.9 decode tok/s.
template <typename T, typename KV, bool kSplit, typename S, bool kLoop = false,
          bool kAloneFast = false>
__global__ void __launch_bounds__(S::kThreads)
    paged_decode_kernel(const DecodeParams p, const CtaGroups groups) {
  extern __shared__ __align__(16) unsigned char smem[];
  // The combine (or o_proj) may launch at once: its own wait waits for this grid.
  if (kSplit || p.pdl) pdl_launch_dependents();
  // Before any read (the previous kernel may have written q or K/V); the default path waits in
  // decode_split, after the reads that may come first (kWaitInside).
  constexpr bool kWaitInside = !kLoop && !kAloneFast;
  if (p.pdl && !kWaitInside) pdl_wait();
  if constexpr (kAloneFast) {
    if (groups.first == nullptr) {  // (a CTA of several rows keeps the loop)
      const int len = max(0, min(p.seq_lens[blockIdx.z], p.ctx_cap));
      if ((len + kTileKeys - 1) / kTileKeys <= p.split_tiles) {
        if (blockIdx.x == 0 && !p.skip_alone) decode_split<T, KV, false, S>(p, 0, smem, groups);
        return;
      }
    }
  }
  if constexpr (kLoop) {
    for (int split = blockIdx.x; split < p.num_splits; split += gridDim.x) {
      decode_split<T, KV, kSplit, S, true>(p, split, smem, groups);
      __syncthreads();  // the next split's copies reuse the merge's shared memory
    }
    // One CTA ran every split of its rows (gridDim.x == 1): it combines them itself, with the
    // combine kernel's arithmetic (combine_part), so the host launches no combine.
    if (gridDim.x == 1 && p.num_splits > 1) combine_in_cta<T, S>(p, groups, smem);
  } else {
    decode_split<T, KV, kSplit, S, false, kWaitInside>(p, blockIdx.x, smem, groups);
  }
}

// ---- combine kernels ----------------------------------------------------------------------------


// grid (B * Hq), kCombineThreads threads: out[b, h, d] = sum_s w_s * partial_s[d] / sum_s w_s with
// w_s = 2^(lse_s - max lse). Splits that saw no key (lse = -inf) are skipped, so their stale
// workspace rows (maybe NaN) are never read.
template <typename T>
__global__ void __launch_bounds__(kCombineThreads)
    paged_decode_combine_kernel(const DecodeParams p) {
  __shared__ float weight[kMaxSplits];
  __shared__ float inv_total;
  const int64_t bh = blockIdx.x;
  const float* lse = p.ws_lse + bh * p.max_splits;
  if (p.pdl) pdl_launch_dependents();
  pdl_wait();
  if (written_alone(p, bh)) return;
  if (threadIdx.x < 32) {
    const int lane = threadIdx.x;
    const float a = lane < p.num_splits ? lse[lane] : -INFINITY;
    const float c = lane + 32 < p.num_splits ? lse[lane + 32] : -INFINITY;
    const SplitWeights w = split_weights(a, c);
    weight[lane] = w.a;
    weight[lane + 32] = w.c;
    if (lane == 0) inv_total = w.total > 0.f ? 1.f / w.total : 0.f;
  }
  __syncthreads();
  const int d = threadIdx.x;
  const float* part = p.ws_out + bh * p.max_splits * kHeadDim + d;
  float acc = 0.f;
  for (int s = 0; s < p.num_splits; ++s) {
    const float w = weight[s];
    if (w != 0.f) acc += w * part[static_cast<int64_t>(s) * kHeadDim];
  }
  static_cast<T*>(p.out)[bh * kHeadDim + d] = from_float<T>(acc * inv_total);
}

// Same result, one memory round trip: warp w owns splits w, w + 4, ... and each lane 4 dims
// (float4), so every partial row of a (b, h) is loaded at once, next to the lse loads, before any
// is used. The loop above issues its loads behind a data-dependent branch, one after another: at
// 32+ splits (batch 1, long context) that chain of L2 latencies is several microseconds.
template <typename T>
__global__ void __launch_bounds__(kCombineThreads)
    paged_decode_combine_fast_kernel(const DecodeParams p) {
  static_assert(kCombineThreads == kCombineWarps * 32, "one combine warp per 32 threads");
  __shared__ float4 red[kCombineWarps][32];  // each warp's sum, dims 4 lane .. 4 lane + 3
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  if (p.pdl) pdl_launch_dependents();
  pdl_wait();
  // The CTA's heads are of one sequence (combine_heads divides Hq): alone for all or for none.
  if (written_alone(p, static_cast<int64_t>(blockIdx.x) * p.combine_heads)) return;
  for (int hc = 0; hc < p.combine_heads; ++hc) {
    const int64_t bh = static_cast<int64_t>(blockIdx.x) * p.combine_heads + hc;
    if (hc > 0) __syncthreads();  // the previous head's reads of red are done
    const CombinePart c = combine_part(p, bh, warp, lane);
    red[warp][lane] = c.acc;
    __syncthreads();
    static_cast<T*>(p.out)[bh * kHeadDim + threadIdx.x] =
        from_float<T>(combine_finish(&red[0][0], threadIdx.x, c.total));
  }
}

// ---- host side ----------------------------------------------------------------------------------

constexpr int kMaxDevices = 64;

// Whether the current device has programmatic dependent launch (compute capability 9.0+).
cudaError_t device_has_pdl(bool* has) {
  static int cached[kMaxDevices] = {};  // 0 unknown, 1 no, 2 yes
  int dev = 0;
  cudaError_t err = cudaGetDevice(&dev);
  if (err != cudaSuccess) return err;
  if (dev < kMaxDevices && cached[dev] != 0) {
    *has = cached[dev] == 2;
    return cudaSuccess;
  }
  int major = 0;
  err = cudaDeviceGetAttribute(&major, cudaDevAttrComputeCapabilityMajor, dev);
  if (err != cudaSuccess) return err;
  *has = major >= 9;
  if (dev < kMaxDevices) cached[dev] = *has ? 2 : 1;
  return cudaSuccess;
}

// Whether the current device gives one CTA SplitShape's shared memory (not on A100: 163 KB).
// A failed query keeps SplitShape (its launch then reports the error).
bool split_shape_fits() {
  static int optin_smem[kMaxDevices] = {};
  int dev = 0;
  if (cudaGetDevice(&dev) != cudaSuccess || dev >= kMaxDevices) return true;
  if (optin_smem[dev] == 0 &&
      cudaDeviceGetAttribute(&optin_smem[dev], cudaDevAttrMaxSharedMemoryPerBlockOptin, dev) !=
          cudaSuccess)
    optin_smem[dev] = -1;
  return optin_smem[dev] <= 0 || SplitShape::kSmemBytes <= optin_smem[dev];
}

// Resident CTAs of the main kernel per SM (w4s3: 1 on A100's 164 KB of shared memory, 2 on
// H100/H200), queried once per device. Also raises the kernel's dynamic shared memory limit, which
// is per device. A shape that does not fit the device's shared memory fails here.
template <typename T, typename KV, bool kSplit, typename S, bool kLoop = false,
          bool kAloneFast = false>
cudaError_t prepare_kernel(int* ctas_per_sm) {
  static int cached[kMaxDevices] = {};
  int dev = 0;
  cudaError_t err = cudaGetDevice(&dev);
  if (err != cudaSuccess) return err;
  if (dev < kMaxDevices && cached[dev] > 0) {
    *ctas_per_sm = cached[dev];
    return cudaSuccess;
  }
  auto kernel = paged_decode_kernel<T, KV, kSplit, S, kLoop, kAloneFast>;
  constexpr int kSmem = S::template smem_bytes<KV>();
  err = cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, kSmem);
  if (err != cudaSuccess) return err;
  int n = 0;
  err = cudaOccupancyMaxActiveBlocksPerMultiprocessor(&n, kernel, S::kThreads, kSmem);
  if (err != cudaSuccess) return err;
  n = n > 0 ? n : 1;
  if (dev < kMaxDevices) cached[dev] = n;
  *ctas_per_sm = n;
  return cudaSuccess;
}

// How many splits: enough CTAs for whole waves over every SM slot, with each split keeping each
// warp busy for several tiles (a pipeline that never fills wastes bandwidth). Depends only on host
// values, never on seq_lens, so it needs no sync and stays valid across CUDA graph replays.
int choose_num_splits(int base_ctas, int max_ctx, int slots, int max_splits, int chunk_tiles) {
  if (base_ctas * 5 >= slots * 4) return 1;  // the batch alone fills >= 80% of a wave
  const int ctx_tiles = (max_ctx + kTileKeys - 1) / kTileKeys;
  int cap = ctx_tiles / chunk_tiles;
  cap = cap < max_splits ? cap : max_splits;
  cap = cap < kMaxSplits ? cap : kMaxSplits;
  if (cap <= 1) return 1;
  // Fraction of the last wave that is busy, for each split count; take the smallest count within
  // 5% of the best (fewer splits = less combine traffic).
  auto efficiency = [&](int s) {
    const double waves = static_cast<double>(base_ctas) * s / slots;
    return waves / static_cast<double>(static_cast<int>(waves + 0.999999));
  };
  double best = 0.0;
  for (int s = 1; s <= cap; ++s) best = efficiency(s) > best ? efficiency(s) : best;
  for (int s = 1; s <= cap; ++s)
    if (efficiency(s) >= 0.95 * best) return s;
  return cap;
}

// What the launch does besides the kernel shape (see "The launch" in the header).
struct LaunchChoice {
  bool split_shape;   // SplitShape (w8s3c1) rather than BatchShape (w4s3)
  bool invariant;     // splits of kInvariantSplitTiles tiles at fixed positions (batch-invariant)
  bool interleave;    // splits take interleaved chunks (else contiguous ranges)
  bool fast_combine;  // the one-round-trip combine kernel (else the looping one)
  bool pdl;           // the main kernel waits on the previous one under PDL (where the GPU has it)
};

// The one place the launch is chosen, from the shape alone. When the batch's (sequence, kv head)
// CTAs fill every SM without splits: w4s3 with no flags; otherwise w8s3c1 with interleaved splits,
// the fast combine and PDL (measurements in the header). On a GPU where w8s3c1 does not fit, the
// same flags on w4s3.
//
// Batch-invariant: one order for every batch, so a row's result depends on its own sequence only:
// w4s3's order (4 warps, warp w taking tiles w, w + 4, ... of a split), contiguous splits of
// kInvariantSplitTiles tiles from key 0, split 0 writing a sequence that fits in one split, the
// fast combine's arithmetic (launch_invariant). The CTAs loop over the splits (paged_decode_kernel's
// kLoop): as many are launched per (sequence, kv head) as fill the GPU once, so a large batch
// launches one CTA per sequence and kv head, never the empty splits past a short sequence that the
// context bound would ask for, and that CTA combines its own rows (no combine launch). Prefill's
// CTA groups run the same order on w4s2 (3 CTAs per SM for its many short CTAs): the stage count
// sets only the pipeline depth, so the bits are the same. In decode a sequence that fits in split 0
// runs the one-split kernel's code instead of the loop (paged_decode_kernel's kAloneFast). Dropping
// the PDL wait where the batch fills the GPU (as the automatic launch does) measured no faster:
// workload 8,566 against 8,592.
// Measured (H200, Qwen3-8B heads, 4096-key table, mode time / automatic launch's): w4s3 at B = 256
// 1.19 / 1.13 / 1.08 at 512 / 1024 / mixed 100..2048 keys, where w8s3c1 took 1.53 / 1.22 / 1.20;
// batch 1 2.11 / 2.98 at 512 / 1024 keys against w8s3c1's 1.86 / 2.50. Engine, Qwen3-8B: workload
// 0.859x the default mode against w8s3c1's 0.800-0.830x; batch 1 210.5 against 211.8 decode tok/s
// (other calls). Prefill as decode: w4s2 5.7-6.9x the prefill kernel, w4s3 7.5-9.9x, w8s3c1
// 9.6-13.5x. Split size: 2048 keys measured best over 640 / 1024 / 2048 / 4096 on w8s3c1; on w4s3
// 1024 was no better (B = 256 1.11-1.25x against 1.09-1.24x in one call; batch 1 better only at
// 3000 keys); 640 gave B = 256 1.17x (1.89x under a 40960-key bound), 4096 batch 1 at 4k 35.4 us.
LaunchChoice choose_launch(int batch, int kv_ctas, int num_sms, bool batch_invariant) {
  if (batch_invariant) return LaunchChoice{false, true, false, true, true};
  const bool fills_gpu = int64_t{batch} * kv_ctas >= num_sms;
  if (fills_gpu) return LaunchChoice{false, false, false, false, false};
  return LaunchChoice{split_shape_fits(), false, true, true, true};
}

// cudaLaunchKernelEx with the PDL attribute when asked for (and the device has it).
template <typename Kernel, typename... Args>
cudaError_t launch_pdl(Kernel kernel, dim3 grid, int threads, int smem, bool pdl,
                       cudaStream_t stream, const Args&... args) {
  return launch_ex(kernel, LaunchConfig(grid, dim3(threads), smem, stream, pdl, 1), args...);
}

// The batch-invariant launch (see choose_launch): splits of kInvariantSplitTiles tiles at fixed
// key positions, the looping kernel, and the combine in the CTAs or in the fast combine kernel.
// kAloneFast: decode (no CTA groups), where a sequence that fits in split 0 runs the one-split
// code (paged_decode_kernel).
template <typename T, typename KV, typename S, bool kAloneFast>
cudaError_t launch_invariant(DecodeParams p, const CtaGroups& groups, int batch, int grid_z,
                             int max_ctx, int num_sms, cudaStream_t stream) {
  constexpr int kSmem = S::template smem_bytes<KV>();
  int loop_ctas = 1;
  cudaError_t err = prepare_kernel<T, KV, true, S, true, kAloneFast>(&loop_ctas);
  if (err != cudaSuccess) return err;
  bool has_pdl = false;
  err = device_has_pdl(&has_pdl);
  if (err != cudaSuccess) return err;
  const int base_ctas = grid_z * p.num_kv_heads * p.head_chunks;
  const int ctx_tiles = (max_ctx + kTileKeys - 1) / kTileKeys;
  p.num_splits = std::max(1, (ctx_tiles + kInvariantSplitTiles - 1) / kInvariantSplitTiles);
  if (p.num_splits > p.max_splits || p.num_splits > kMaxSplits) return cudaErrorInvalidValue;
  p.split_tiles = p.chunk_tiles = kInvariantSplitTiles;
  // Launched splits: enough CTAs to fill every SM slot once, at most the splits there are.
  const int slots = num_sms * loop_ctas;
  const int launched = std::min(p.num_splits, std::max(1, (slots + base_ctas - 1) / base_ctas));
  p.interleave = 0;
  p.pdl = has_pdl ? 1 : 0;
  const dim3 grid(launched, p.num_kv_heads * p.head_chunks, grid_z);
  err = launch_pdl(paged_decode_kernel<T, KV, true, S, true, kAloneFast>, grid, S::kThreads,
                   kSmem, p.pdl != 0, stream, p, groups);
  // One split: every sequence alone. One launched split: the CTAs combine their own rows.
  if (err != cudaSuccess || p.num_splits == 1 || launched == 1) return err;
  p.combine_heads = base_ctas >= slots ? p.group : 1;
  return launch_pdl(paged_decode_combine_fast_kernel<T>,
                    dim3(batch * p.num_q_heads / p.combine_heads), kCombineThreads, 0, has_pdl,
                    stream, p);
}

template <typename T, typename KV, typename S>
cudaError_t launch(DecodeParams p, int batch, int max_ctx, int num_sms, const LaunchChoice& c,
                   cudaStream_t stream) {
  constexpr int kSmem = S::template smem_bytes<KV>();
  int ctas_per_sm = 1, unused = 1;
  cudaError_t err = prepare_kernel<T, KV, true, S>(&ctas_per_sm);
  if (err != cudaSuccess) return err;
  err = prepare_kernel<T, KV, false, S>(&unused);
  if (err != cudaSuccess) return err;
  bool has_pdl = false;
  err = device_has_pdl(&has_pdl);
  if (err != cudaSuccess) return err;

  const int base_ctas = batch * p.num_kv_heads * p.head_chunks;
  p.num_splits = choose_num_splits(base_ctas, max_ctx, num_sms * ctas_per_sm, p.max_splits,
                                   S::kChunkTiles);
  p.chunk_tiles = S::kChunkTiles;
  p.interleave = c.interleave ? 1 : 0;
  p.pdl = c.pdl && has_pdl ? 1 : 0;
  const dim3 grid(p.num_splits, p.num_kv_heads * p.head_chunks, batch);
  if (p.num_splits == 1) {
    if (p.pdl)
      return launch_pdl(paged_decode_kernel<T, KV, false, S>, grid, S::kThreads, kSmem, true,
                        stream, p, CtaGroups{});
    paged_decode_kernel<T, KV, false, S><<<grid, S::kThreads, kSmem, stream>>>(p, CtaGroups{});
    return cudaGetLastError();
  }
  if (p.pdl) {
    err = launch_pdl(paged_decode_kernel<T, KV, true, S>, grid, S::kThreads, kSmem, true, stream,
                     p, CtaGroups{});
  } else {
    paged_decode_kernel<T, KV, true, S><<<grid, S::kThreads, kSmem, stream>>>(p, CtaGroups{});
    err = cudaGetLastError();
  }
  if (err != cudaSuccess) return err;
  const dim3 cgrid(batch * p.num_q_heads);
  if (c.fast_combine)
    return launch_pdl(paged_decode_combine_fast_kernel<T>, cgrid, kCombineThreads, 0, has_pdl,
                     stream, p);
  return launch_pdl(paged_decode_combine_kernel<T>, cgrid, kCombineThreads, 0, has_pdl, stream, p);
}

}  // namespace

bool invariant_prefill_order(bool fp8_kv, int num_q_heads, int num_kv_heads, int block_size) {
  return !fp8_kv && num_kv_heads > 0 && num_q_heads % num_kv_heads == 0 &&
         num_q_heads / num_kv_heads <= kRows && block_size >= 16 && block_size <= 256 &&
         (block_size & (block_size - 1)) == 0 && prefill::sm90_available();
}

cudaError_t paged_attention_decode(void* out, const void* q, const void* k_cache,
                                   const void* v_cache, const int32_t* block_tables,
                                   const int32_t* seq_lens, float* workspace, int batch,
                                   int num_q_heads, int num_kv_heads, int head_dim,
                                   int block_size, int max_blocks, int max_splits, float scale,
                                   int num_sms, bool batch_invariant, DType dtype, KvCache kv,
                                   cudaStream_t stream, const int32_t* cta_first,
                                   const int32_t* cta_count, int cta_groups) {
  if ((cta_first != nullptr) && (!batch_invariant || cta_count == nullptr || cta_groups < 0 ||
                                 cta_groups > 65535))
    return cudaErrorInvalidValue;
  if (head_dim != kHeadDim || block_size < kTileKeys || block_size % kTileKeys != 0 ||
      num_kv_heads < 1 || num_q_heads < 1 || num_q_heads % num_kv_heads != 0 || max_splits < 1 ||
      max_blocks < 1 || num_sms < 1 || batch < 0 || batch > 65535 ||
      reinterpret_cast<uintptr_t>(k_cache) % 16 != 0 ||
      reinterpret_cast<uintptr_t>(v_cache) % 16 != 0 || reinterpret_cast<uintptr_t>(q) % 4 != 0 ||
      reinterpret_cast<uintptr_t>(workspace) % 16 != 0)  // the combine's float4 loads
    return cudaErrorInvalidValue;
  if (batch == 0 || (cta_first != nullptr && cta_groups == 0)) return cudaSuccess;
  DecodeParams p{};
  p.out = out;
  p.q = q;
  p.k_cache = k_cache;
  p.v_cache = v_cache;
  p.block_tables = block_tables;
  p.seq_lens = seq_lens;
  p.ws_out = workspace;
  p.ws_lse = workspace + static_cast<int64_t>(batch) * num_q_heads * max_splits * kHeadDim;
  p.num_q_heads = num_q_heads;
  p.num_kv_heads = num_kv_heads;
  p.group = num_q_heads / num_kv_heads;
  p.head_chunks = (p.group + kRows - 1) / kRows;
  p.block_size = block_size;
  p.max_blocks = max_blocks;
  p.max_splits = max_splits;
  p.scale_log2 = scale * kv.k_scale * 1.4426950408889634f;
  p.v_scale = kv.v_scale;
  p.combine_heads = 1;
  p.skip_alone =
      batch_invariant && invariant_prefill_order(kv.fp8, num_q_heads, num_kv_heads, block_size);
  const int64_t max_ctx64 = static_cast<int64_t>(max_blocks) * block_size;
  // (batch-invariant: at most kDecodeInvariantMaxKeys; ops.py refuses longer sequences there)
  const int64_t ctx_limit = batch_invariant ? kDecodeInvariantMaxKeys : (1 << 30);
  const int max_ctx = static_cast<int>(max_ctx64 > ctx_limit ? ctx_limit : max_ctx64);
  p.ctx_cap = max_ctx;
  if (num_kv_heads * p.head_chunks > 65535) return cudaErrorInvalidValue;
  const LaunchChoice c = choose_launch(batch, num_kv_heads * p.head_chunks, num_sms,
                                       batch_invariant);
  auto run = [&](auto t_tag, auto kv_tag) {
    using T = decltype(t_tag);
    using KV = decltype(kv_tag);
    if (c.invariant) {
      // Sequences that fit in split 0, where invariant_prefill_order holds: the prefill kernels'
      // order (decode_prefill_order.cu); the split kernel then takes only the longer ones, and
      // is not launched when there can be none.
      if (p.skip_alone && cta_first == nullptr) {
        prefill::PrefillParams pp{};
        pp.out = out;
        pp.q = q;
        pp.k_cache = k_cache;
        pp.v_cache = v_cache;
        pp.seq_lens_k = seq_lens;
        pp.block_tables = block_tables;
        pp.num_q_heads = num_q_heads;
        pp.num_kv_heads = num_kv_heads;
        pp.group = p.group;
        pp.block_size_log2 = __builtin_ctz(static_cast<unsigned>(block_size));
        pp.max_blocks = max_blocks;
        pp.scale_log2 = p.scale_log2;
        pp.v_scale = 1.f;
        const cudaError_t err =
            prefill::launch_decode_prefill_order(pp, batch, max_ctx, dtype, stream);
        if (err != cudaSuccess) return err;
      }
      if (p.skip_alone && max_ctx <= kDecodeInvariantSplitKeys) return cudaSuccess;
      // Prefill's CTA groups (many short CTAs) on w4s2, decode on w4s3: one order (the stage
      // count sets only the pipeline depth), see choose_launch.
      const CtaGroups groups{cta_first, cta_count};
      return cta_first != nullptr
                 ? launch_invariant<T, KV, LeanShape, false>(p, groups, batch, cta_groups,
                                                             max_ctx, num_sms, stream)
                 : launch_invariant<T, KV, BatchShape, true>(p, groups, batch, batch, max_ctx,
                                                             num_sms, stream);
    }
    return c.split_shape ? launch<T, KV, SplitShape>(p, batch, max_ctx, num_sms, c, stream)
                         : launch<T, KV, BatchShape>(p, batch, max_ctx, num_sms, c, stream);
  };
  return QWEN3_DISPATCH_HALF(dtype, T, [&] {
    return kv.fp8 ? run(T(), uint8_t()) : run(T(), T());
  });
}

}  // namespace qwen3_kernels
