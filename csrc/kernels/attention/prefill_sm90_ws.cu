// paged_attention_prefill on Hopper (sm_90a): the algorithm of prefill.cu (read its header first:
// packed (token, q head) rows, causality, numerics) with the two GEMMs on warpgroup MMA (wgmma)
// and the CTA warp-specialised (FlashAttention-3 structure). prefill.cu's entry point picks this
// kernel where the device runs its sm_90a code, the mma.sync kernel elsewhere.
//
// Why wgmma pays: mma.sync makes every warp read its own copy of the K and V fragments out of
// shared memory (ldmatrix), so at 16 rows per warp the kernel is bound by shared-memory bandwidth
// near half the tensor-core peak. wgmma reads the B operand once per warpgroup (64 rows) straight
// from shared memory through a matrix descriptor (qwen3_kernels/mma.cuh, namespace sm90).
//   S = Q K^T   wgmma m64n128k16, A = Q and B = K both from shared memory ("SS"), 8 k-steps over D.
//   O += P V    wgmma m64n128k16, A = P from registers ("RS"), B = V from shared memory read as
//               MN-major (V is [key][d], d contiguous), 8 k-steps over the 128 keys.
// Shared-memory tiles use GMMA's canonical K-major layout with the 128-byte swizzle: a [rows, 128]
// tile of 16-bit values is stored as two [rows, 64] halves (d 0..63, then d 64..127); in each half
// row r is 128 bytes at r * 128 and its 16-byte chunk c sits at chunk (c ^ (r & 7)). The hardware
// applies that XOR on address bits [4,7) ^ [7,10), so every tile starts on a 1 KiB boundary.
//   K-major operand (Q, K): 8-row groups are SBO = 1 KiB apart; a k-step of 16 elements advances
//     the start address by 32 bytes inside the 128-byte row, and k-steps 4..7 use the second half.
//   MN-major operand (V): along N (= d) the two halves are LBO = BLOCK_N * 128 bytes apart; along
//     K (= keys) 8-key groups are SBO = 1 KiB apart; a k-step of 16 keys advances 2 KiB.
// Accumulator layout of wgmma m64nN (per warp w of the warpgroup, lane = 4 g + t): d[4 j + e] is
// row 16 w + g + 8 (e >> 1), column 8 j + 2 t + (e & 1): the mma.sync C layout, N / 8 times.
// The register A operand of a k16 step has the mma.sync A layout, so P is packed as in prefill.cu.
//
// CTA = 3 warpgroups, BLOCK_M = 128 packed rows, key tiles of BLOCK_N = 128.
//   WG 0, producer (setmaxnreg down to 40): copies Q (once a work tile), then K(0), V(0), K(1), ...
//     into a ring of kStages K and kStages V slots with 16-byte cp.async (each key row's address
//     goes through the block table, so TMA's fixed-stride boxes do not fit a paged cache; cp.async
//     also zero-fills keys past the sequence, which keeps a stale NaN slot out of P V). A thread
//     signals "slot full" with cp.async.mbarrier.arrive.noinc: the barrier (count 128) completes
//     when every producer thread's copies have landed. Before refilling a slot it waits on the
//     slot's "empty" barrier (count 8: one arrival per consumer warp).
//   WG 1, 2, consumers (setmaxnreg up to 232): 64 rows each, without any load or CTA barrier:
//     iteration n issues S(n) = Q K(n)^T and P(n-1) V(n-1), waits for S(n) only and runs the
//     softmax of tile n while P V runs (intra-warpgroup overlap).
//   Ping-pong: the two consumers take turns issuing their GEMMs (named barriers 1 and 2), so one
//     warpgroup's softmax runs while the tensor cores work on the other's GEMMs.
//
// mbarrier phases: tile n lives in slot n % kStages in round r = n / kStages; consumers wait
// "full" with parity r & 1, the producer waits "empty" with parity (r & 1) ^ 1, which a fresh
// barrier satisfies at once for r = 0. cp.async writes through the generic proxy and wgmma reads
// through the async proxy, so each consumer issues fence.proxy.async after its full-waits (a
// writer-side fence is impossible: the producer never sees its copies land).
// The producer's empty-waits trap after ~2^26 polls (a lost arrival fails the launch, no hang).
// The ping-pong barriers need 256 arrivals (128 sync + 128 arrive): consumer c syncs on barrier
// 1 + c before issuing, then arrives on the other's; consumer 1 grants consumer 0
// the first turn, and consumer 0 takes one empty turn at the end (a sync on barrier 1), which
// consumes consumer 1's last grant: no arrival is left pending when the CTA exits (both do the
// same number of turns: n_tiles per work tile, the same tiles).
//
// Two grids of the same kernel (launch_sm90_ws; prefill.cu chooses by the longest query length):
//   one-tile: grid (Hkv, M blocks, B), one work tile per CTA.
//   persistent: a grid of one CTA per SM, each walking a list of work tiles (kv head, M block,
//     sequence) in a fixed order (persistent_tile), so every role knows the list without talking.
//     The K/V ring's slots and phases run on across tiles; Q gets a barrier of its own, "Q empty"
//     (one arrival per consumer warp after its last S of the tile), so the producer loads the next
//     tile's Q while the consumers still run the current tile's last P V, softmax and output; the
//     output then goes from registers straight to global memory (the one-tile grid stages it in
//     Q's shared memory, which here already holds the next Q). What it saves: each CTA of the
//     one-tile grid waits for its Q and first K before any math (6% of the stall samples at 4k
//     causal, more with many short CTAs; H200 profile).
//
// Variants that no shape picks (branch experiment/prefill-sm90-variants keeps them and the
// environment switch): a single-role wgmma kernel (prefill_sm90.cu: loads and GEMMs in
// every warp, one CTA barrier per tile), a 2-stage K/V ring, and both ring depths without
// ping-pong. H200, bench_attention_prefill.py, us (causal 4k 32/8 bs 256 | 4k 16/8 | 8 x 2k |
// 16k | 4k bs 16 | prefix Lq 2048 Lk 8k | prefix Lq 512 Lk 16k):
//   single-role   438.1 | 226.2 | 937.5 | 6339.7 | 447.8 | 731.6 | 418.9
//   2 stages      281.7 | 148.5 | 654.9 | 4291.6 | 383.8 | 469.0 | 272.6
//   2, no pp      284.0 | 144.7 | 667.2 | 4161.7 | 353.3 | 440.3 | 247.8
//   3, no pp      282.8 | 142.2 | 665.9 | 4069.5 | 338.4 | 426.5 | 239.2
//   3 (kept)      284.1 | 140.5 | 649.4 | 4093.3 | 338.7 | 418.5 | 234.0
//   3, persistent 274.2 | 138.8 | 634.7 | 4116.2 | 342.6 | 430.7 | 236.8
//   cuDNN         266.4 | 152.4 | 506.0 | 3770.9 | 264.1 |   -   |   -
#include <type_traits>

#include "prefill_common.cuh"

#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900 && defined(__CUDA_ARCH_FEAT_SM90_ALL)
#define QWEN3_PREFILL_WS 1
#endif

namespace qwen3_kernels {
namespace prefill {
namespace {

constexpr int kBlockM = 128;                        // 2 consumer warpgroups x 64 packed rows
constexpr int kBlockN = 128;                        // keys per K/V tile
constexpr int kThreads = 384;                       // producer + 2 consumer warpgroups
constexpr int kQBytes = kBlockM * kHeadDim * 2;     // 32 KiB, reused to stage the output
constexpr int kTileBytes = kBlockN * kHeadDim * 2;  // 32 KiB per K or V slot
// setmaxnreg budgets: the producer needs ~37 registers, a consumer ~190 (O, S and P of a 64 x 128
// tile live at once: 64 + 64 + 32). 128 * 40 + 256 * 232 = 64512 = 384 threads x 168.
constexpr int kProducerRegs = 40;
constexpr int kConsumerRegs = 232;
static_assert(128 * kProducerRegs + 256 * kConsumerRegs <= 65536, "register file");

constexpr int kStages = 3;                          // K/V ring depth
// 1 KiB alignment slack + Q + K and V rings + barriers (2 + 4 * kStages of 8 bytes).
constexpr int kSmemBytes = 1024 + kQBytes + 2 * kStages * kTileBytes + 8 * (2 + 4 * kStages);
static_assert(kSmemBytes <= 227 * 1024, "the ring must fit the opt-in shared memory");

#if defined(QWEN3_PREFILL_WS)

// Byte offset of 16-byte chunk `chunk` (0..15) of row `row` in a [rows, 128] GMMA tile with the
// 128-byte swizzle: two [rows, 64] halves, row r of a half at r * 128, chunk c at c ^ (r & 7).
__device__ __forceinline__ uint32_t gmma_offset(int row, int chunk, int rows) {
  return static_cast<uint32_t>((chunk >> 3) * rows * 128 + row * 128 +
                               (((chunk & 7) ^ (row & 7)) << 4));
}

// One CTA's unit of work: BLOCK_M packed rows (M block m_block) of one sequence and kv head.
struct WorkTile {
  int kv_head;
  int m_block;
  int seq;
};

// Work tile k of this CTA in the persistent order, or false past the end. The list: M blocks from
// the last (in a causal prefill the longest key range) to the first, each over all sequences and
// kv heads; round k of G CTAs takes tiles k G .. k G + G - 1, CTA b the b-th of them on even
// rounds and the (G-1-b)-th on odd ones (a snake: the CTA with one of the longest tiles of a round
// gets one of the shortest of the next). A host model of a causal 4k prefill (1,024 tiles of
// 1..32 key tiles, 132 CTAs) puts the busiest CTA within 1% of the average.
__device__ __forceinline__ bool persistent_tile(int k, int m_blocks, int kv_heads, int batch,
                                                WorkTile& w) {
  const int num_ctas = gridDim.x;
  const int64_t i = static_cast<int64_t>(k) * num_ctas +
                    ((k & 1) ? num_ctas - 1 - static_cast<int>(blockIdx.x) : blockIdx.x);
  const int per_m = kv_heads * batch;
  if (i >= static_cast<int64_t>(m_blocks) * per_m) return false;
  const int r = static_cast<int>(i / per_m), rem = static_cast<int>(i % per_m);
  w.m_block = m_blocks - 1 - r;
  w.seq = rem / kv_heads;
  w.kv_head = rem - w.seq * kv_heads;
  return true;
}

#endif  // QWEN3_PREFILL_WS

// One-tile grid: (Hkv, m_blocks, B), M tiles in reverse (longest rows first).
// Persistent (kPersistent): grid (min(tiles, SMs)), tiles from persistent_tile.
template <typename T, bool kPersistent>
__global__ void __launch_bounds__(kThreads, 1)
    prefill_ws_kernel(const PrefillParams p, int m_blocks, int batch) {
#if defined(QWEN3_PREFILL_WS)
  using namespace sm90;
  extern __shared__ uint8_t smem_raw[];
  const uint32_t raw_addr = smem_addr(smem_raw);
  const uint32_t s_q = (raw_addr + 1023) & ~1023u;  // the 128-byte swizzle needs 1 KiB alignment
  uint8_t* smem = smem_raw + (s_q - raw_addr);
  const uint32_t s_k = s_q + kQBytes;                 // kStages slots
  const uint32_t s_v = s_k + kStages * kTileBytes;    // kStages slots
  const uint32_t s_bar = s_v + kStages * kTileBytes;  // 8-byte mbarriers:
  const uint32_t bar_q = s_bar;                       //   Q landed
  const uint32_t bar_q_empty = s_bar + 8;             //   Q read by all 8 warps (persistent)
  const uint32_t bar_k_full = s_bar + 16;             //   [kStages] K slot filled
  const uint32_t bar_v_full = bar_k_full + 8 * kStages;
  const uint32_t bar_k_empty = bar_v_full + 8 * kStages;  // [kStages] K slot read by all 8 warps
  const uint32_t bar_v_empty = bar_k_empty + 8 * kStages;

  const int group = p.group;
  // Work tile k of this CTA (false: no more), and what follows from it. Every role walks the same
  // list and skips the same empty tiles (M blocks past a shorter sequence's rows).
  struct Tile {
    int kv_head, seq, q_start, rows, row0, lk, shift, n_tiles, n_full;
  };
  auto get_tile = [&](int k, Tile& t) -> bool {
    WorkTile w;
    if (kPersistent) {
      if (!persistent_tile(k, m_blocks, p.num_kv_heads, batch, w)) return false;
    } else {
      if (k > 0) return false;
      w = WorkTile{static_cast<int>(blockIdx.x), static_cast<int>(gridDim.y - 1 - blockIdx.y),
                   static_cast<int>(blockIdx.z)};
    }
    t.kv_head = w.kv_head;
    t.seq = w.seq;
    t.q_start = p.cu_seqlens_q[w.seq];
    const int lq = p.cu_seqlens_q[w.seq + 1] - t.q_start;
    t.rows = lq * group;
    t.row0 = w.m_block * kBlockM;
    t.lk = min(p.seq_lens_k[w.seq], p.max_blocks << p.block_size_log2);
    t.shift = t.lk - lq;  // absolute position of query token t is shift + t
    if (t.row0 >= t.rows) {
      t.n_tiles = -1;  // empty: skipped by every role
      return true;
    }
    const int t_first = t.row0 / group;
    const int t_last = (min(t.row0 + kBlockM, t.rows) - 1) / group;
    const int key_end = t.shift + t_last + 1;
    t.n_tiles = key_end > 0 ? (key_end + kBlockN - 1) / kBlockN : 0;
    t.n_full = max(0, (t.shift + t_first + 1) / kBlockN);  // tiles before it need no mask
    return true;
  };
  if (!kPersistent) {
    Tile t;
    get_tile(0, t);
    if (t.n_tiles < 0) return;  // the whole CTA, before any barrier
  }

  const int tid = threadIdx.x;
  const int wg = tid >> 7;

  if (tid == 0) {
    mbar_init(bar_q, 128);
    mbar_init(bar_q_empty, 8);  // one arrival per consumer warp
#pragma unroll
    for (int s = 0; s < kStages; ++s) {
      mbar_init(bar_k_full + 8 * s, 128);  // one cp.async-tracked arrival per producer thread
      mbar_init(bar_v_full + 8 * s, 128);
      mbar_init(bar_k_empty + 8 * s, 8);   // one arrival per consumer warp
      mbar_init(bar_v_empty + 8 * s, 8);
    }
    mbar_init_fence();
  }
  __syncthreads();  // the last CTA-wide barrier: the roles never meet at one again

  if (wg == 0) {
    // ---------------------------------- producer ----------------------------------
    regs_dealloc<kProducerRegs>();
    const int ld_chunk = tid & 15;  // 16 threads copy one 256-byte row
    const int ld_row = tid >> 4;    // rows ld_row + 8 i
    const int64_t slot_stride = (int64_t)p.num_kv_heads * kHeadDim;  // elements between slots
    const int log2_bs = p.block_size_log2;
    const int block_mask = (1 << log2_bs) - 1;
    // Row ld_row + 8 i of a tile lands at dst_row0 + 1024 i: the 128-byte swizzle XORs the chunk
    // with row & 7, which is ld_row for all 16 of this thread's rows.
    const uint32_t dst_row0 = gmma_offset(ld_row, ld_chunk, kBlockN);
    const int64_t row_step = 8 * slot_stride;  // elements from one of its rows to the next
    int stage = 0;
    uint32_t round_parity = 0;  // (K/V tiles loaded / kStages) & 1, over all work tiles
    uint32_t q_parity = 0;      // (work tiles loaded) & 1
    Tile tile;
    for (int k = 0; get_tile(k, tile); ++k) {
      if (tile.n_tiles < 0) continue;
      const int lk = tile.lk;
      // The previous tile's Q is free once every consumer warp has run its last S.
      if (kPersistent) mbar_wait<true>(bar_q_empty, q_parity ^ 1);
      load_q_tile<T, kBlockM, 8, 4>(p, s_q, tile.q_start, tile.kv_head, group, tile.row0,
                                    tile.rows, ld_row, ld_chunk,
                                    [&](int r) { return gmma_offset(r, ld_chunk, kBlockM); });
      cp_async_mbar_arrive(bar_q);
      q_parity ^= 1;

      const T* k_head =
          static_cast<const T*>(p.k_cache) + tile.kv_head * kHeadDim + ld_chunk * 8;
      const T* v_head =
          static_cast<const T*>(p.v_cache) + tile.kv_head * kHeadDim + ld_chunk * 8;
      const int32_t* table = p.block_tables + (int64_t)tile.seq * p.max_blocks;
      // Pages of 2^kLog2 < 128 keys: a tile starts on a page boundary and spans 128 >> kLog2
      // pages; this thread's rows of a page are the kPageRows rows ld_row, ld_row + 8, ... of it.
      auto load_small_pages = [&](uint32_t dst, const T* head_base, int t, auto log2_tag) {
        constexpr int kLog2 = decltype(log2_tag)::value;
        constexpr int kPageRows = (1 << kLog2) / 8;
        const int32_t* tile_pages = table + ((t * kBlockN) >> kLog2);
#pragma unroll
        for (int pg = 0; pg < (kBlockN >> kLog2); ++pg) {
          const int key_first = t * kBlockN + (pg << kLog2) + ld_row;  // this thread's first row
          const int64_t page = key_first < lk ? __ldg(tile_pages + pg) : 0;
          const T* src = head_base + ((page << kLog2) + ld_row) * slot_stride;
#pragma unroll
          for (int j = 0; j < kPageRows; ++j) {
            const bool valid = key_first + 8 * j < lk;
            cp_async_16(dst + dst_row0 + 1024 * (pg * kPageRows + j),
                        valid ? src + j * row_step : head_base, valid);
          }
        }
      };
      // This thread's rows of key tile t -> dst; keys past the sequence are zero-filled (and
      // their block-table entries never read). This loop was the producer's bottleneck at ~40
      // instructions a row, and the consumers waited on K (H200 profile): now the
      // source address is computed once per page the rows touch and stepped 8 slots a row between.
      auto load_tile = [&](uint32_t dst, const T* head_base, int t) {
        const int key0 = t * kBlockN + ld_row;
        if (log2_bs >= 7) {
          // Pages of >= 128 keys: the whole tile is in one page (t * 128 < lk: the tile exists).
          const int64_t page = __ldg(table + ((t * kBlockN) >> log2_bs));
          const T* src = head_base + ((page << log2_bs) + (key0 & block_mask)) * slot_stride;
          if (t * kBlockN + kBlockN <= lk) {  // every row valid (all but the last tile)
#pragma unroll
            for (int i = 0; i < kBlockN / 8; ++i)
              cp_async_16(dst + dst_row0 + 1024 * i, src + i * row_step, true);
          } else {
#pragma unroll
            for (int i = 0; i < kBlockN / 8; ++i) {
              const bool valid = key0 + 8 * i < lk;
              cp_async_16(dst + dst_row0 + 1024 * i, valid ? src + i * row_step : head_base,
                          valid);
            }
          }
          return;
        }
        // Pages of 16 / 32 / 64 keys (the op accepts 16..256): each its own unrolled loop.
        if (log2_bs == 4) load_small_pages(dst, head_base, t, std::integral_constant<int, 4>());
        if (log2_bs == 5) load_small_pages(dst, head_base, t, std::integral_constant<int, 5>());
        if (log2_bs == 6) load_small_pages(dst, head_base, t, std::integral_constant<int, 6>());
      };

      for (int t = 0; t < tile.n_tiles; ++t) {
        mbar_wait<true>(bar_k_empty + 8 * stage, round_parity ^ 1);
        load_tile(s_k + stage * kTileBytes, k_head, t);
        cp_async_mbar_arrive(bar_k_full + 8 * stage);
        mbar_wait<true>(bar_v_empty + 8 * stage, round_parity ^ 1);
        load_tile(s_v + stage * kTileBytes, v_head, t);
        cp_async_mbar_arrive(bar_v_full + 8 * stage);
        if (++stage == kStages) {
          stage = 0;
          round_parity ^= 1;
        }
      }
    }
    // Outstanding copies finish before the thread exits (their barrier arrivals still count).
    asm volatile("cp.async.wait_all;\n" ::: "memory");
    return;
  }

  // ---------------------------------- consumers ----------------------------------
  regs_alloc<kConsumerRegs>();
  const int c = wg - 1;             // consumer index: rows 64 c .. 64 c + 63 of the CTA
  const int warp = (tid >> 5) & 3;  // warp within the warpgroup
  const int lane = tid & 31;
  const int g = lane >> 2;
  const int t4 = lane & 3;

  float o[64];
  float row_max[2], row_sum[2];
  int pos[2];  // absolute positions of this lane's two rows
  int n_full = 0;
  // P of tile n (bf16 / fp16 pairs: the register A operand of its P V) lives in p_buf[n % 2]:
  // the softmax of tile n packs its P while P(n-1) V(n-1) still reads the other buffer. With one
  // buffer ptxas must wait for that P V before the first pack, and its scheduler interleaves the
  // packs with the exponentials, so the wait moved above the whole softmax and the softmax no
  // longer overlapped the P V (H200 profile).
  uint32_t p_buf[2][kBlockN / 16][4];

  // S = Q K^T for this warpgroup's 64 rows x 128 keys (8 k-steps over D; Q and K K-major).
  auto issue_s = [&](float (&s)[64], uint32_t k_slot) {
#pragma unroll
    for (int kk = 0; kk < kHeadDim / 16; ++kk) {
      const uint32_t half_k = kk >> 2, col = (kk & 3) * 32;
      const uint64_t da =
          desc_sw128(s_q + half_k * (kBlockM * 128) + c * (64 * 128) + col, 16, 1024);
      const uint64_t db = desc_sw128(k_slot + half_k * (kBlockN * 128) + col, 16, 1024);
      wgmma_m64n128k16_ss<T>(s, da, db, kk > 0 ? 1 : 0);
    }
  };
  // O += P V (8 k-steps over the keys; V read MN-major).
  auto issue_pv = [&](const uint32_t (&p_frag)[kBlockN / 16][4], uint32_t v_slot) {
#pragma unroll
    for (int kk = 0; kk < kBlockN / 16; ++kk)
      wgmma_m64n128k16_rs<T>(o, p_frag[kk],
                             desc_sw128(v_slot + kk * (16 * 128), kBlockN * 128, 1024));
  };
  // Masks tile n of the scores if it reaches the diagonal, turns them into P (online softmax,
  // prefill_common.cuh) and returns in alpha the factor that rescales what was accumulated before.
  auto softmax = [&](float (&s)[64], int n, float (&alpha)[2]) {
    softmax_step<kBlockN / 8>(s, n, n_full, pos, t4, p.scale_log2, row_max, row_sum,
                              [&](int h, float a) { alpha[h] = a; });
  };
  // Two adjacent n8 accumulator tiles form the register A operand of one k16 step.
  auto pack_p = [&](const float (&s)[64], uint32_t (&p_frag)[kBlockN / 16][4]) {
#pragma unroll
    for (int kk = 0; kk < kBlockN / 16; ++kk) {
      p_frag[kk][0] = pack2<T>(s[8 * kk + 0], s[8 * kk + 1]);
      p_frag[kk][1] = pack2<T>(s[8 * kk + 2], s[8 * kk + 3]);
      p_frag[kk][2] = pack2<T>(s[8 * kk + 4], s[8 * kk + 5]);
      p_frag[kk][3] = pack2<T>(s[8 * kk + 6], s[8 * kk + 7]);
    }
  };

  const uint32_t my_turn = 1 + c;  // named barrier ids of the ping-pong
  const uint32_t other_turn = 2 - c;
  if (c == 1) named_bar_arrive(1, 256);  // consumer 0 goes first

  // The K/V ring over all work tiles: slot `stage` of round parity `parity` holds the next tile.
  int stage = 0;
  uint32_t parity = 0;
  uint32_t q_parity = 0;  // (work tiles run) & 1
  // This warp is done reading Q (persistent: the producer may load the next tile's). The warp's
  // other lanes have passed their Q wait too (else, with the next two Q phases complete, a lane
  // still polling this one's parity would wait for a third).
  auto release_q = [&]() {
    if (kPersistent) {
      __syncwarp();
      if (lane == 0) mbar_arrive(bar_q_empty);
    }
  };
  Tile tile;
  for (int k = 0; get_tile(k, tile); ++k) {
    if (tile.n_tiles < 0) continue;
    const int n_tiles = tile.n_tiles;
    n_full = tile.n_full;
#pragma unroll
    for (int h = 0; h < 2; ++h)
      pos[h] = tile.shift + (tile.row0 + c * 64 + warp * 16 + g + 8 * h) / group;
#pragma unroll
    for (int i = 0; i < 64; ++i) o[i] = 0.f;
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      row_max[h] = -INFINITY;
      row_sum[h] = 0.f;
    }

    // Every thread waits for Q itself (also before the output reuses its space below).
    mbar_wait(bar_q, q_parity);
    q_parity ^= 1;

    // alpha of the last tile whose softmax ran: o is rescaled by it once the P V before landed.
    float alpha[2] = {1.f, 1.f};
    int prev_stage = stage;  // slot of V(n - 1)
    uint32_t prev_parity = parity;
    int pp_stage = -1;  // slot of V(n - 2), whose P V is the one in flight (-1: none)
    auto advance = [&]() {
      prev_stage = stage;
      prev_parity = parity;
      if (++stage == kStages) {
        stage = 0;
        parity ^= 1;
      }
    };
    // Tile 0: S(0) alone (o is still zero: nothing to rescale, no P V yet).
    if (n_tiles > 0) {
      named_bar_sync(my_turn, 256);
      mbar_wait(bar_k_full + 8 * stage, parity);
      fence_proxy_async();
      float s[64];
      wgmma_fence();
      issue_s(s, s_k + stage * kTileBytes);
      wgmma_commit();
      named_bar_arrive(other_turn, 256);
      wgmma_wait<0>();
      fence_regs(s);
      if (lane == 0) mbar_arrive(bar_k_empty + 8 * stage);  // this warp is done with K(0)
      if (n_tiles == 1) release_q();
      softmax(s, 0, alpha);
      pack_p(s, p_buf[0]);
      advance();
    } else {
      release_q();
    }

    // Iteration n waits for P(n-2) V(n-2) and rescales o by tile n-1's alpha, issues
    // S(n) = Q K(n)^T and O += P(n-1) V(n-1), waits for S(n) only and runs the softmax of tile n
    // while P V runs. The wait for P V sits in the next iteration, behind the K / V barrier waits
    // (each a loop, so a basic block of its own): ptxas hoists a wgmma wait over independent ALU
    // work in its block, and in the softmax's block it moved above the whole softmax, so P V and
    // the softmax never overlapped (H200 profile and SASS). For the same reason P
    // alternates between two register buffers: P(n) is packed while P(n-1) V(n-1) still reads
    // the other one.
    // Waits for the P V in flight, frees its V slot and rescales o by the last softmax's alpha.
    auto retire_pv = [&]() {
      wgmma_wait<0>();
      fence_regs(o);
      if (pp_stage >= 0 && lane == 0) mbar_arrive(bar_v_empty + 8 * pp_stage);
      rescale_rows(o, alpha);
    };
    // One iteration: p_prev holds P(n-1) (read by this iteration's P V), p_next receives P(n).
    auto step = [&](int n, uint32_t (&p_prev)[kBlockN / 16][4],
                    uint32_t (&p_next)[kBlockN / 16][4]) {
      named_bar_sync(my_turn, 256);
      mbar_wait(bar_v_full + 8 * prev_stage, prev_parity);  // issued before K(n): usually landed
      retire_pv();
      mbar_wait(bar_k_full + 8 * stage, parity);
      fence_proxy_async();
      float s[64];
      fence_regs(o);
      fence_regs(p_prev);
      wgmma_fence();  // o and p_prev were written by ordinary instructions
      issue_s(s, s_k + stage * kTileBytes);
      wgmma_commit();
      issue_pv(p_prev, s_v + prev_stage * kTileBytes);
      wgmma_commit();
      named_bar_arrive(other_turn, 256);  // the other consumer may issue now
      wgmma_wait<1>();  // S(n) is done; P V may still run
      fence_regs(s);
      if (lane == 0) mbar_arrive(bar_k_empty + 8 * stage);
      if (n == n_tiles - 1) release_q();
      softmax(s, n, alpha);
      pack_p(s, p_next);  // into the buffer P V is not reading
      pp_stage = prev_stage;
      advance();
    };
    // The last tile's P V (outside the ping-pong: nothing follows it).
    auto last_pv = [&](uint32_t (&p_last)[kBlockN / 16][4]) {
      mbar_wait(bar_v_full + 8 * prev_stage, prev_parity);
      retire_pv();
      fence_proxy_async();
      fence_regs(o);
      fence_regs(p_last);
      wgmma_fence();
      issue_pv(p_last, s_v + prev_stage * kTileBytes);
      wgmma_commit();
      wgmma_wait<0>();
      fence_regs(o);
      // The one-tile kernels never refill this slot; the persistent one does.
      if (kPersistent && lane == 0) mbar_arrive(bar_v_empty + 8 * prev_stage);
    };
    // Unrolled by two so that each P buffer is a fixed set of registers: P(n) is in p_buf[n % 2].
    for (int n = 1; n_tiles > 0; n += 2) {
      if (n >= n_tiles) {
        last_pv(p_buf[0]);
        break;
      }
      step(n, p_buf[0], p_buf[1]);
      if (n + 1 >= n_tiles) {
        last_pv(p_buf[1]);
        break;
      }
      step(n + 1, p_buf[1], p_buf[0]);
    }

    float inv[2];
    inverse_row_sums(row_sum, inv);

    T* out = static_cast<T*>(p.out);
    if (kPersistent) {
      // Straight from the registers: Q's shared memory may already hold the next tile's Q. Each
      // store writes 4 bytes of a row; a warp's store covers 16 bytes of each of 8 rows.
#pragma unroll
      for (int h = 0; h < 2; ++h) {
        const int pr = tile.row0 + c * 64 + warp * 16 + g + 8 * h;
        if (pr < tile.rows) {
          T* dst = out + packed_row_offset(p, tile.q_start, tile.kv_head, group, pr) + 2 * t4;
#pragma unroll
          for (int j = 0; j < kHeadDim / 8; ++j)
            *reinterpret_cast<uint32_t*>(dst + 8 * j) =
                pack2<T>(o[4 * j + 2 * h] * inv[h], o[4 * j + 2 * h + 1] * inv[h]);
        }
      }
      continue;
    }
    // Stage the output in this warpgroup's own Q rows (same swizzled layout, so the writes are
    // conflict-free): every warp of the warpgroup must be done with its wgmmas, which read those
    // rows through the async proxy. The other consumer never touches them.
    named_bar_sync(3 + c, 128);
#pragma unroll
    for (int j = 0; j < kHeadDim / 8; ++j) {
#pragma unroll
      for (int h = 0; h < 2; ++h) {
        const int r = c * 64 + warp * 16 + g + 8 * h;
        *reinterpret_cast<uint32_t*>(smem + gmma_offset(r, j, kBlockM) + 4 * t4) =
            pack2<T>(o[4 * j + 2 * h] * inv[h], o[4 * j + 2 * h + 1] * inv[h]);
      }
    }
    __syncwarp();  // each warp reads back only the 16 rows it wrote
#pragma unroll
    for (int i = 0; i < 16 * 16 / 32; ++i) {
      const int idx = i * 32 + lane;
      const int r = c * 64 + warp * 16 + (idx >> 4);
      const int chunk = idx & 15;
      const int pr = tile.row0 + r;
      if (pr < tile.rows)
        store_out_chunk(p, out, tile.q_start, tile.kv_head, group, pr, chunk,
                        [&] { return smem + gmma_offset(r, chunk, kBlockM); });
    }
  }
  // Consumer 0's empty last turn: it consumes consumer 1's grant after its last turn.
  if (c == 0) named_bar_sync(1, 256);
#endif  // QWEN3_PREFILL_WS
}

// SMs of the current device, queried once per device (the persistent grid is one CTA per SM).
int num_sms() {
  constexpr int kMaxDevices = 64;
  static int cached[kMaxDevices] = {};
  int dev = 0;
  if (cudaGetDevice(&dev) != cudaSuccess) return 0;
  if (dev < kMaxDevices && cached[dev] > 0) return cached[dev];
  int n = 0;
  if (cudaDeviceGetAttribute(&n, cudaDevAttrMultiProcessorCount, dev) != cudaSuccess) return 0;
  if (dev < kMaxDevices) cached[dev] = n;
  return n;
}

template <typename T, bool kPersistent>
cudaError_t launch(const PrefillParams& p, int batch, int max_seqlen_q, cudaStream_t stream) {
  const int64_t m_blocks = ((int64_t)max_seqlen_q * p.group + kBlockM - 1) / kBlockM;
  if (m_blocks > 65535) return cudaErrorInvalidConfiguration;  // grid.y limit
  auto kernel = prefill_ws_kernel<T, kPersistent>;
  cudaError_t err =
      cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, kSmemBytes);
  if (err != cudaSuccess) return err;
  dim3 grid(p.num_kv_heads, (unsigned)m_blocks, batch);
  if (kPersistent) {
    const int64_t tiles = m_blocks * p.num_kv_heads * batch;
    if (tiles >= (int64_t{1} << 31)) return cudaErrorInvalidConfiguration;
    const int sms = num_sms();
    if (sms <= 0) return cudaErrorInvalidDevice;
    grid = dim3((unsigned)(tiles < sms ? tiles : sms));
    if (tiles == 0) return cudaSuccess;
  }
  kernel<<<grid, kThreads, kSmemBytes, stream>>>(p, (int)m_blocks, batch);
  return cudaGetLastError();
}

}  // namespace

bool sm90_available() {
  // Per device: does it run this binary's sm_90a code of the kernel? (binaryVersion is the SASS
  // version the driver picked: 90 on an H100/H200 built with sm_90a, 80 on an A100.)
  static int cached[64];  // 0 unknown, 1 yes, 2 no; a benign race writes the same value
  int dev = 0;
  if (cudaGetDevice(&dev) != cudaSuccess) return false;
  if (dev >= 0 && dev < 64 && cached[dev] != 0) return cached[dev] == 1;
  cudaFuncAttributes attr;
  bool ok = cudaFuncGetAttributes(&attr, prefill_ws_kernel<__nv_bfloat16, false>) == cudaSuccess &&
            attr.binaryVersion == 90;
  if (!ok) (void)cudaGetLastError();  // clear a "no kernel image" error; we just fall back
  if (dev >= 0 && dev < 64) cached[dev] = ok ? 1 : 2;
  return ok;
}

cudaError_t launch_sm90_ws(const PrefillParams& p, int batch, int max_seqlen_q, DType dtype,
                           bool persistent, cudaStream_t stream) {
  if (!sm90_available()) return cudaErrorNotSupported;
  return QWEN3_DISPATCH_HALF(dtype, T, [&] {
    return persistent ? launch<T, true>(p, batch, max_seqlen_q, stream)
                      : launch<T, false>(p, batch, max_seqlen_q, stream);
  });
}

}  // namespace prefill
}  // namespace qwen3_kernels
