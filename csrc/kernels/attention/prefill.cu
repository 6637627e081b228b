// paged_attention_prefill: varlen causal GQA attention of new query tokens over keys read from
// the paged KV cache, FlashAttention-2 style on mma.sync tensor cores (sm_80 and sm_90a).
// This is the portable kernel and the entry point; on Hopper the launcher at the bottom hands the
// call to the wgmma kernel in prefill_sm90_ws.cu (same algorithm, same results up to rounding).
//
// Work split. One CTA owns BLOCK_M = 128 "packed rows" of one (sequence, kv head): packed row
// p = token * group + h is query token `token` of the sequence and q head kv_head * group + h.
// Packing the q heads of a KV group into the M tile means every K/V tile read from the cache
// serves all of them, which is what keeps short chunks (a few tokens over a long cached
// prefix) from wasting most of a 128-row tile. The q heads of one token are adjacent in
// q [Tq, Hq, D], so a packed row is still one contiguous 256-byte load.
//
// Causality. Query token t of a sequence with Lq queries and Lk keys sits at absolute position
// Lk - Lq + t and sees keys 0 ..= Lk - Lq + t (prefix-cache hits and chunked prefill). Key tiles
// are visited in increasing order, so key 0, which every query sees, comes first and the
// running max is finite from the first tile on; only the last tiles straddle the diagonal and
// pay for the mask.
//
// Pipeline. 8 warps, each owns 16 packed rows and keeps its Q fragments in registers. K and V
// tiles of BLOCK_N = 64 keys are double-buffered in shared memory and filled by 16-byte cp.async
// whose source row is looked up through the block table (a tile may span several cache blocks,
// so every row computes its own address). K(n+1) streams in while S = Q K(n)^T and the softmax
// run; V(n+1) while O += P V(n) runs. Shared-memory rows are 256 bytes with the 16-byte chunk
// index XOR-swizzled by (row & 7), so ldmatrix of 8 rows at one logical chunk hits 8 distinct
// bank groups.
//
// FP8 cache (KV = uint8_t, e4m3 with per-layer scales, launchers.h KvCache): K/V tiles arrive as
// e4m3 bytes in a staging tile (plain rows of 128 bytes, 8 threads a row); after a tile lands each
// thread widens the chunks it copied to fp16 into the usual swizzled tile, and the mma runs in fp16
// (e4m3 -> fp16 is exact; Q is turned into fp16 once, exact in fp16's normal range). k_scale is
// folded into the softmax scale, v_scale into the output's normalisation. The wgmma kernel reads
// an fp8 cache the same way (its producer widens the tiles; prefill_sm90_ws.cu).
//
// Numerics: fp32 scores and accumulators; softmax in base 2 with scale * log2(e) folded into
// one FMA; P rounded to the input dtype for the P V product (as FlashAttention does); the output
// normalised in fp32 and written with 16-byte stores through shared memory.
#include <cfloat>
#include <type_traits>

#include "prefill_common.cuh"
#include "qwen3_kernels/e4m3.cuh"

namespace qwen3_kernels {
namespace {

using namespace prefill;

constexpr int kBlockM = 128;                       // packed (token, q head) rows per CTA
constexpr int kBlockN = 64;                        // keys per K/V tile
constexpr int kWarps = kBlockM / 16;               // one m16 MMA row block per warp
constexpr int kThreads = kWarps * 32;
constexpr int kRowBytes = kHeadDim * 2;            // one 16-bit head row: 16 chunks of 16 bytes
constexpr int kQBytes = kBlockM * kRowBytes;       // 32 KiB, reused to stage the output
constexpr int kTileBytes = kBlockN * kRowBytes;    // 16 KiB per K or V tile
constexpr int kSmemBytes = kQBytes + 4 * kTileBytes;  // Q + 2 K + 2 V stages = 96 KiB
constexpr int kStagingBytes = 4 * kBlockN * kHeadDim;  // fp8 cache: 2 K + 2 V e4m3 tiles, 32 KiB
constexpr int kLoadRowsPerPass = kThreads / 16;    // 16 threads load one 256-byte row

// ---- PTX wrappers -----------------------------------------------------------------------------

// Byte offset of 16-byte chunk `chunk` of row `row` in a swizzled [rows, 256 B] tile.
__device__ __forceinline__ uint32_t swizzle(int row, int chunk) {
  return static_cast<uint32_t>(row * kRowBytes + ((chunk ^ (row & 7)) << 4));
}

// ---- the kernel -----------------------------------------------------------------------------

// grid (Hkv, ceil(max_seqlen_q * group / BLOCK_M), B). The M tiles run in reverse order so the
// longest causal rows (last tiles) start first and the short ones fill the tail.
// KV: the cache's element type (T, or uint8_t for e4m3); M: the mma's 16-bit type.
template <typename T, typename KV>
__global__ void __launch_bounds__(kThreads, 1) prefill_kernel(const PrefillParams p) {
  constexpr bool kFp8 = std::is_same_v<KV, uint8_t>;
  using M = std::conditional_t<kFp8, __half, T>;
  extern __shared__ __align__(128) uint8_t smem[];

  const int kv_head = blockIdx.x;
  const int m_block = gridDim.y - 1 - blockIdx.y;
  const int seq = blockIdx.z;
  const int q_start = p.cu_seqlens_q[seq];
  const int lq = p.cu_seqlens_q[seq + 1] - q_start;
  const int group = p.group;
  const int rows = lq * group;  // packed rows of this (sequence, kv head)
  const int row0 = m_block * kBlockM;
  if (row0 >= rows) return;  // a shorter sequence than max_seqlen_q

  // Clamping to the block table keeps a bad seq_lens_k from reading past it.
  const int lk = min(p.seq_lens_k[seq], p.max_blocks << p.block_size_log2);
  const int shift = lk - lq;  // absolute position of query token t is shift + t
  const int t_first = row0 / group;
  const int t_last = (min(row0 + kBlockM, rows) - 1) / group;
  const int key_end = shift + t_last + 1;  // keys [0, key_end) are seen by some row here
  const int n_tiles = key_end > 0 ? (key_end + kBlockN - 1) / kBlockN : 0;
  // Tiles below n_full are entirely visible to every row of the tile: no mask.
  const int n_full = max(0, (shift + t_first + 1) / kBlockN);

  const int tid = threadIdx.x;
  const int lane = tid & 31;
  const int warp = tid >> 5;
  const uint32_t s_q = smem_addr(smem);
  const uint32_t s_k = s_q + kQBytes;            // 2 stages
  const uint32_t s_v = s_k + 2 * kTileBytes;     // 2 stages
  const uint32_t s_k8 = s_v + 2 * kTileBytes;    // fp8 cache: 2 K staging tiles, then 2 V
  const uint32_t s_v8 = s_k8 + 2 * kBlockN * kHeadDim;

  // Loader role: thread tid copies chunk (tid & 15) of rows (tid >> 4) + 16 * i.
  const int ld_chunk = tid & 15;
  const int ld_row = tid >> 4;

  // Q tile (packed rows row0 ..), fully unrolled.
  load_q_tile<T, kBlockM, kLoadRowsPerPass, kBlockM / kLoadRowsPerPass>(
      p, s_q, q_start, kv_head, group, row0, rows, ld_row, ld_chunk,
      [&](int r) { return swizzle(r, ld_chunk); });

  // K/V rows: key j lives in cache block table[j / block_size] at slot j % block_size. A cache row
  // is kKvChunks 16-byte chunks (16 for 16-bit, 8 for e4m3): thread tid copies chunk
  // tid % kKvChunks of rows tid / kKvChunks + kKvRowsPerPass i.
  constexpr int kKvChunks = kHeadDim * static_cast<int>(sizeof(KV)) / 16;
  constexpr int kKvRowsPerPass = kThreads / kKvChunks;
  const int kv_chunk = tid % kKvChunks;
  const int kv_row = tid / kKvChunks;
  const int64_t slot_stride = (int64_t)p.num_kv_heads * kHeadDim;  // elements between slots
  const KV* k_head = static_cast<const KV*>(p.k_cache) + kv_head * kHeadDim +
                     kv_chunk * (16 / static_cast<int>(sizeof(KV)));
  const KV* v_head = static_cast<const KV*>(p.v_cache) + kv_head * kHeadDim +
                     kv_chunk * (16 / static_cast<int>(sizeof(KV)));
  const int32_t* table = p.block_tables + (int64_t)seq * p.max_blocks;
  const int block_mask = (1 << p.block_size_log2) - 1;
  constexpr int kKvLoads = kBlockN / kKvRowsPerPass;  // rows per thread per tile
  int64_t kv_off[kKvLoads];  // element offsets of this thread's rows; -1 past the sequence

  auto find_rows = [&](int tile) {
#pragma unroll
    for (int i = 0; i < kKvLoads; ++i) {
      const int key = tile * kBlockN + kv_row + i * kKvRowsPerPass;
      kv_off[i] = -1;
      if (key < lk) {
        const int64_t block = __ldg(table + (key >> p.block_size_log2));
        kv_off[i] = ((block << p.block_size_log2) + (key & block_mask)) * slot_stride;
      }
    }
  };
  // dst: the 16-bit tile (swizzled), or for an fp8 cache the staging tile (plain 128-byte rows).
  auto load_tile = [&](uint32_t dst, const KV* head_base) {
#pragma unroll
    for (int i = 0; i < kKvLoads; ++i) {
      const int r = kv_row + i * kKvRowsPerPass;
      const bool valid = kv_off[i] >= 0;
      const uint32_t at = kFp8 ? r * kHeadDim + kv_chunk * 16 : swizzle(r, kv_chunk);
      cp_async_16(dst + at, valid ? head_base + kv_off[i] : head_base, valid);
    }
  };
  // fp8 cache: this thread's staged chunks (landed: its own copies) -> fp16 in the swizzled tile.
  auto widen_tile = [&](uint32_t staged, uint32_t dst) {
#pragma unroll
    for (int i = 0; i < kKvLoads; ++i) {
      const int r = kv_row + i * kKvRowsPerPass;
      uint4 lo, hi;
      fp8::e4m3x16_to_half(
          *reinterpret_cast<const uint4*>(smem + (staged - s_q) + r * kHeadDim + kv_chunk * 16),
          lo, hi);
      *reinterpret_cast<uint4*>(smem + (dst - s_q) + swizzle(r, 2 * kv_chunk)) = lo;
      *reinterpret_cast<uint4*>(smem + (dst - s_q) + swizzle(r, 2 * kv_chunk + 1)) = hi;
    }
  };
  // Where tile n's copies go: the staging tile (fp8) or the 16-bit tile itself.
  const uint32_t k_dst = kFp8 ? s_k8 : s_k, v_dst = kFp8 ? s_v8 : s_v;
  constexpr uint32_t kDstBytes = kFp8 ? kBlockN * kHeadDim : kTileBytes;

  // Groups in flight, in commit order: {Q, K0}, {V0}, then per tile n: {K(n+1)}, {V(n+1)}.
  find_rows(0);
  load_tile(k_dst, k_head);
  cp_async_commit();
  load_tile(v_dst, v_head);
  cp_async_commit();

  // MMA fragment coordinates: lane holds rows g and g + 8 of its warp's 16, columns 2t, 2t + 1
  // of every 8-wide n tile.
  const int g = lane >> 2;
  const int t4 = lane & 3;
  const int lane_row16 = lane & 15;  // ldmatrix: the row this lane addresses in a 16-row block
  const int lane_hi = lane >> 4;     // ...and whether it addresses the second 8-column chunk

  cp_async_wait<1>();
  __syncthreads();
  uint32_t q_frag[kHeadDim / 16][4];
#pragma unroll
  for (int kk = 0; kk < kHeadDim / 16; ++kk)
    ldmatrix_x4(q_frag[kk], s_q + swizzle(warp * 16 + lane_row16, 2 * kk + lane_hi));
  if constexpr (kFp8) {
#pragma unroll
    for (int kk = 0; kk < kHeadDim / 16; ++kk)
#pragma unroll
      for (int r = 0; r < 4; ++r) q_frag[kk][r] = fp8::to_half2<T>(q_frag[kk][r]);
  }

  // Absolute position of this lane's two rows (rows past the sequence get positions past its
  // end: they compute harmless values on zero-filled K/V and are never stored).
  int pos[2];
#pragma unroll
  for (int h = 0; h < 2; ++h) pos[h] = shift + (row0 + warp * 16 + g + 8 * h) / group;

  float o[kHeadDim / 8][4];
#pragma unroll
  for (int j = 0; j < kHeadDim / 8; ++j) o[j][0] = o[j][1] = o[j][2] = o[j][3] = 0.f;
  float row_max[2] = {-INFINITY, -INFINITY};  // raw (unscaled) score max of each row
  float row_sum[2] = {0.f, 0.f};              // this lane's part; the quad is summed at the end

  for (int n = 0; n < n_tiles; ++n) {
    const uint32_t stage_off = (n & 1) * kTileBytes;
    cp_async_wait<1>();  // K(n) has landed (V(n) may still be in flight)
    if constexpr (kFp8) widen_tile(s_k8 + (n & 1) * kDstBytes, s_k + stage_off);
    __syncthreads();     // ... for every thread, and everyone is done with tile n - 1
    if (n + 1 < n_tiles) {
      find_rows(n + 1);
      load_tile(k_dst + ((n + 1) & 1) * kDstBytes, k_head);
    }
    cp_async_commit();

    // S = Q K^T for this warp's 16 rows x 64 keys. From -0, the additive identity (the wgmma
    // kernel's first k-step writes A B without adding, and +0 would turn a -0 product into +0).
    float s[kBlockN / 8][4];
#pragma unroll
    for (int j = 0; j < kBlockN / 8; ++j) s[j][0] = s[j][1] = s[j][2] = s[j][3] = -0.f;
#pragma unroll
    for (int kk = 0; kk < kHeadDim / 16; ++kk) {
#pragma unroll
      for (int kn = 0; kn < kBlockN / 16; ++kn) {
        // Matrices: keys 0-7 | d lo, keys 0-7 | d hi, keys 8-15 | d lo, keys 8-15 | d hi.
        uint32_t kf[4];
        ldmatrix_x4(kf, s_k + stage_off + swizzle(kn * 16 + (lane & 7) + (lane_hi << 3),
                                                  2 * kk + ((lane >> 3) & 1)));
        mma_16816<M>(s[2 * kn], q_frag[kk], kf[0], kf[1]);
        mma_16816<M>(s[2 * kn + 1], q_frag[kk], kf[2], kf[3]);
      }
    }

    // Mask (tiles on the diagonal), online softmax, and the rescale of what has been accumulated.
    softmax_step<kBlockN / 8>(reinterpret_cast<float(&)[kBlockN / 2]>(s), n, n_full, pos, t4,
                              p.scale_log2, row_max, row_sum, [&](int h, float alpha) {
#pragma unroll
                                for (int j = 0; j < kHeadDim / 8; ++j) {
                                  o[j][2 * h] *= alpha;
                                  o[j][2 * h + 1] *= alpha;
                                }
                              });

    // The accumulator layout of two adjacent n8 tiles of S is the A fragment of a k16 step.
    uint32_t p_frag[kBlockN / 16][4];
#pragma unroll
    for (int kk = 0; kk < kBlockN / 16; ++kk) {
      p_frag[kk][0] = pack2<M>(s[2 * kk][0], s[2 * kk][1]);
      p_frag[kk][1] = pack2<M>(s[2 * kk][2], s[2 * kk][3]);
      p_frag[kk][2] = pack2<M>(s[2 * kk + 1][0], s[2 * kk + 1][1]);
      p_frag[kk][3] = pack2<M>(s[2 * kk + 1][2], s[2 * kk + 1][3]);
    }

    cp_async_wait<1>();  // V(n) has landed (K(n+1) may still be in flight)
    if constexpr (kFp8) widen_tile(s_v8 + (n & 1) * kDstBytes, s_v + stage_off);
    __syncthreads();
    if (n + 1 < n_tiles) load_tile(v_dst + ((n + 1) & 1) * kDstBytes, v_head);
    cp_async_commit();

    // O += P V: V is [key][d] in shared memory, so the B fragments come from ldmatrix.trans.
#pragma unroll
    for (int kk = 0; kk < kBlockN / 16; ++kk) {
#pragma unroll
      for (int dn = 0; dn < kHeadDim / 16; ++dn) {
        // Matrices: keys 0-7 | d lo, keys 8-15 | d lo, keys 0-7 | d hi, keys 8-15 | d hi.
        uint32_t vf[4];
        ldmatrix_x4_trans(vf, s_v + stage_off + swizzle(kk * 16 + lane_row16, 2 * dn + lane_hi));
        mma_16816<M>(o[2 * dn], p_frag[kk], vf[0], vf[1]);
        mma_16816<M>(o[2 * dn + 1], p_frag[kk], vf[2], vf[3]);
      }
    }
  }
  cp_async_wait<0>();

  // Normalise in fp32; a row with no visible key (only possible for invalid inputs) writes 0.
  float inv[2];
  inverse_row_sums(row_sum, inv);
  inv[0] *= p.v_scale;
  inv[1] *= p.v_scale;

  // Stage the warp's 16 output rows in its own Q rows (only this warp ever read them), then
  // write whole 256-byte rows with 16-byte stores.
#pragma unroll
  for (int j = 0; j < kHeadDim / 8; ++j) {
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      const int r = warp * 16 + g + 8 * h;
      *reinterpret_cast<uint32_t*>(smem + swizzle(r, j) + 4 * t4) =
          pack2<T>(o[j][2 * h] * inv[h], o[j][2 * h + 1] * inv[h]);
    }
  }
  __syncwarp();
  T* out = static_cast<T*>(p.out);
#pragma unroll
  for (int i = 0; i < 16 * 16 / 32; ++i) {
    const int idx = i * 32 + lane;
    const int r = warp * 16 + (idx >> 4);
    const int chunk = idx & 15;
    const int pr = row0 + r;
    if (pr < rows)
      store_out_chunk(p, out, q_start, kv_head, group, pr, chunk,
                      [&] { return smem + swizzle(r, chunk); });
  }
}

template <typename T, typename KV>
cudaError_t launch_prefill(const PrefillParams& p, int batch, int max_seqlen_q,
                           cudaStream_t stream) {
  constexpr int kSmem = kSmemBytes + (std::is_same_v<KV, uint8_t> ? kStagingBytes : 0);
  const int64_t m_blocks = ((int64_t)max_seqlen_q * p.group + kBlockM - 1) / kBlockM;
  if (m_blocks > 65535) return cudaErrorInvalidConfiguration;  // grid.y limit
  // Opting into > 48 KiB of dynamic shared memory is per kernel and per device; it is cheap, so
  // set it on every call rather than caching a flag that would be wrong on a second GPU.
  cudaError_t err = cudaFuncSetAttribute(prefill_kernel<T, KV>,
                                         cudaFuncAttributeMaxDynamicSharedMemorySize, kSmem);
  if (err != cudaSuccess) return err;
  const dim3 grid(p.num_kv_heads, (unsigned)m_blocks, batch);
  prefill_kernel<T, KV><<<grid, kThreads, kSmem, stream>>>(p);
  return cudaGetLastError();
}

}  // namespace

cudaError_t paged_attention_prefill(void* out, const void* q, const void* k_cache,
                                    const void* v_cache, const int32_t* cu_seqlens_q,
                                    const int32_t* seq_lens_k, const int32_t* block_tables,
                                    int num_tokens, int batch, int max_seqlen_q, int num_q_heads,
                                    int num_kv_heads, int head_dim, int block_size,
                                    int max_blocks, float scale, DType dtype, KvCache kv,
                                    int32_t* tile_counter, cudaStream_t stream) {
  // head_dim 128 only: ops.py sends other head dims to the reference.
  if (head_dim != kHeadDim) return cudaErrorInvalidValue;
  if (num_kv_heads <= 0 || num_q_heads <= 0 || num_q_heads % num_kv_heads != 0)
    return cudaErrorInvalidValue;
  if (block_size < 16 || block_size > 256 || (block_size & (block_size - 1)) != 0)
    return cudaErrorInvalidValue;
  if (num_tokens < 0 || batch < 0 || max_seqlen_q < 0 || max_blocks < 0)
    return cudaErrorInvalidValue;
  // Both kernels copy q, K and V in 16-byte pieces and store out in 16-byte pieces (a misaligned
  // address faults: a sticky error for the whole context).
  if ((reinterpret_cast<uintptr_t>(q) | reinterpret_cast<uintptr_t>(out) |
       reinterpret_cast<uintptr_t>(k_cache) | reinterpret_cast<uintptr_t>(v_cache)) % 16 != 0)
    return cudaErrorInvalidValue;
  if (num_tokens == 0 || batch == 0 || max_seqlen_q == 0) return cudaSuccess;
  if (batch > 65535) return cudaErrorInvalidConfiguration;  // grid.z limit

  PrefillParams p;
  p.out = out;
  p.q = q;
  p.k_cache = k_cache;
  p.v_cache = v_cache;
  p.cu_seqlens_q = cu_seqlens_q;
  p.seq_lens_k = seq_lens_k;
  p.block_tables = block_tables;
  p.num_q_heads = num_q_heads;
  p.num_kv_heads = num_kv_heads;
  p.group = num_q_heads / num_kv_heads;
  p.block_size_log2 = __builtin_ctz(static_cast<unsigned>(block_size));
  p.max_blocks = max_blocks;
  p.scale_log2 = scale * kv.k_scale * 1.4426950408889634f;
  p.v_scale = kv.v_scale;
  p.tile_counter = tile_counter;
  // The one choice of kernel. Where the device runs this binary's sm_90a code (H100/H200): the
  // warp-specialised wgmma kernel (prefill_sm90_ws.cu), persistent up to 8192 query tokens a
  // sequence and one CTA per work tile above. H200 (bench_attention_prefill.py, four runs):
  // persistent against one-tile 0.5-4% faster at causal 4k (268.3 / 279.3 us; cuDNN 273.4),
  // 2.3-3.5% at 8 x 2k, equal on prefix chunks of 512 and 2048 queries, 0.6-6.3% slower at 16k.
  // An fp8 cache takes the same kernels. Elsewhere (sm_80 .. sm_89): this file's mma.sync kernel.
  constexpr int kPersistentMaxSeqlenQ = 8192;
  if (prefill::sm90_available())
    return prefill::launch_sm90_ws(p, num_tokens, batch, max_seqlen_q, dtype, kv.fp8,
                                   max_seqlen_q <= kPersistentMaxSeqlenQ, stream);
  return QWEN3_DISPATCH_HALF(dtype, T, [&] {
    return kv.fp8 ? launch_prefill<T, uint8_t>(p, batch, max_seqlen_q, stream)
                  : launch_prefill<T, T>(p, batch, max_seqlen_q, stream);
  });
}

}  // namespace qwen3_kernels
