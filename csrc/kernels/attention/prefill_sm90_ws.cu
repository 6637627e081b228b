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
// CTA = 3 warpgroups, BLOCK_M = 128 packed rows, key tiles of BLOCK_N = 128. Shared memory (the
// persistent grid's; the one-tile grid's in brackets, see Buffers): two [one] Q buffers (32 KiB
// each), a ring of 2 [3] K slots and 3 V slots (32 KiB each), a published work tile per Q buffer,
// the barriers: 225 KiB of the 227 KiB a CTA may opt into.
//   WG 0, producer (setmaxnreg down to 40): the only role that walks the list of work tiles
//     (reading the sequence bounds from global memory). For each non-empty tile it publishes the
//     tile (a TileInfo in shared memory) and its Q in the next Q buffer (round robin), then
//     copies K(0), V(0), K(1), ... into the rings, then the next tile; past the last it publishes
//     an end marker. Q: two TMA copies issued by thread 0 (a box per half of D; encode_rows_map),
//     or where a box cannot hold an M block (group not a power of two: Qwen3-14B's 40 / 8)
//     16-byte cp.async by all 128 threads. K / V: always cp.async (each key row's address goes
//     through the block table, so TMA's fixed-stride boxes do not fit a paged cache; cp.async
//     also zero-fills keys past the sequence, which keeps a stale NaN slot out of P V). A thread
//     signals "full" with cp.async.mbarrier.arrive.noinc: a ring slot's barrier (count 128)
//     completes when every producer thread's copies have landed. A Q buffer's barrier completes on
//     thread 0's arrive, made after it wrote the TileInfo (release), with the TMA copies' bytes
//     expected on it (count 1), or with the 128 cp.async arrivals (count 129). Before refilling a
//     slot or a Q buffer it waits on its "empty" barrier (count 8: one arrival per consumer warp).
//   WG 1, 2, consumers (setmaxnreg up to 232): 64 rows each, without any load or CTA barrier:
//     wait for the next Q buffer, read its TileInfo (end marker: done), then iteration n issues
//     S(n) = Q K(n)^T and P(n-1) V(n-1), waits for S(n) only and runs the softmax of tile n while
//     P V runs (intra-warpgroup overlap); the output goes out through the warp's rows of the
//     finished Q buffer: read back into registers, the buffer returned to the producer, then
//     16-byte stores of whole rows.
//   Ping-pong: the two consumers take turns issuing their GEMMs (named barriers 1 and 2), so one
//     warpgroup's softmax runs while the tensor cores work on the other's GEMMs.
// Why two Q buffers and the producer's TileInfo: with one Q buffer the producer could load the
// next tile's Q only once both consumers had run their last S of the current one, and each
// consumer computed the next tile itself (integer divisions and dependent global loads of the
// sequence bounds). A clock64 profile of the one-buffer kernel (H200, 8 x 2k causal) put ~2,700
// cycles a work tile in the consumers' wait for Q and ~2,400 in their tile computation, next to
// ~3,200 a key tile; the two buffers cost the K ring its third slot (the V ring keeps three: a V
// slot is held one iteration longer than a K slot, from P V's issue to its retirement). Why TMA
// for Q: the producer's cp.async copies of a Q tile queued behind the K / V copies in flight,
// ~7,000 cycles from the first issue to the last byte, and the consumers still waited ~4,000
// cycles a work tile for their Q; TMA copies (one thread, two instructions) landed in time:
// the wait fell to ~1,000 (same profile).
//
// mbarrier phases: ring slot s of round r (r = tiles through the ring / depth) is waited "full"
// with parity r & 1 by the consumers and "empty" with parity (r & 1) ^ 1 by the producer, which a
// fresh barrier satisfies at once for r = 0; Q buffer b = j % kQBuffers (j: tiles published) is
// in round j / kQBuffers the same way.
// K and V rings run on across work tiles with their own slot counters. cp.async writes through
// the generic proxy and wgmma reads through the async proxy, so each consumer issues
// fence.proxy.async after its full-waits (a writer-side fence is impossible: the producer never
// sees its copies land). The producer's waits trap after ~2^26 polls (a lost arrival fails the
// launch, no hang). The ping-pong barriers need 256 arrivals (128 sync + 128 arrive): consumer c
// syncs on barrier 1 + c before issuing, then arrives on the other's; consumer 1 grants consumer
// 0 the first turn, and consumer 0 takes one empty turn at the end (a sync on barrier 1), which
// consumes consumer 1's last grant: no arrival is left pending when the CTA exits (both do the
// same number of turns: n_tiles per work tile, the same tiles).
//
// Two grids of the same kernel (launch_sm90_ws; prefill.cu chooses by the longest query length):
//   one-tile: grid (Hkv, M blocks, B), a list of one work tile per CTA.
//   persistent: a grid of one CTA per SM over one list of work tiles (list_tile: sections of
//     (sequence, kv head) pairs, M blocks longest first), each CTA's producer taking the next
//     tile from a work counter when it is ready for one (several sequences) or its share in a
//     fixed order (one); the next tile's Q lands while the consumers finish the current one.
//
// Measured (H200, scratch harness on branch experiment/prefill-sm90-q-buffers, same inputs,
// alternating, us; causal Hq/Hkv 32/8 but where noted): the one-Q-buffer K3/V3 kernel -> two Q
// buffers with cp.async Q -> two Q buffers with TMA Q (this kernel):
//   4k 259.2 -> 254.4 -> 243.2 | 4k 16/8 132.7 -> 131.1 -> 123.6 | 8 x 2k 618.5 -> 605.9 -> 564.7 |
//   4k bs 16 328.4 -> 313.4 -> 294.5 | 8 x 2k bs 16 756.5 -> 723.3 -> 659.5 |
//   16 x 1k 408.5 -> 402.0 -> 349.3 | 64 x 256 251.4 -> 239.1 -> 185.4 |
//   24 x 100..1024 288.2 -> 281.5 -> 236.5 | prefix Lq 2048 Lk 8k 408.2 -> 399.7 -> 399.4 |
//   prefix Lq 512 Lk 16k 239.6 -> 235.0 -> 226.5 (TMA and cp.async Q give the same bits).
//   The one-tile grid (16k) was within the run-to-run spread of the long shape (3.9-4.0 ms).
// Variants that lost: the tile boundary as an ordinary step (the next tile's S(0) issued with the
// last P V; branch experiment/prefill-sm90-tile-close): 0.77-0.97x but on prefix chunks
// (1.01-1.04x), as the consumers then wait at the boundary for the next tile's K(0), which the
// producer issues only about one step ahead (K ring of 2); K ring 3 / V ring 2 with two Q buffers
// (0.80-0.95x on every shape but 64 x 256); the next tile's Q published after the current tile's
// first K / V (cp.async Q: the producer spills at 40 registers, and at 72 / 216 the consumers slow
// down: 0.65-0.94x); in the one-buffer kernel: each consumer's 64 Q rows with barriers of their
// own, the producer's K(0) / V(0) ahead of the next Q, an L2 prefetch of the next tile's Q, the
// (sequence, kv head) pairs in L2-sized sections (hit rate 47% -> 85% at 8 x 2k, 3-13% slower):
// 0.87-1.03x. Older variants (branch experiment/prefill-sm90-variants): a single-role kernel,
// 2-stage rings, no ping-pong.
//
// The persistent list (list_tile): the work counter and the sections of pairs against the snake
// over all pairs at once, H100, same call, alternating (bench_attention_prefill.py, us): 8 x 2k
// 571.9 / 570.6 -> 532.3 / 531.1, 16 x 1k 392.7 / 393.8 -> 325.0 / 322.8, 64 x 256 230.2 / 228.1
// -> 172.4 / 172.6, 24 x 143..991 236.4 / 234.7 -> 198.0 / 199.5, 8 x 2k over an fp8 cache in
// pages of 16 865.7 / 874.9 -> 852.0 / 858.1; one sequence (4k, 4k 16/8, prefix chunks, an fp8
// cache's 4k) as before (it keeps the snake). Lost (benchmarks/prefill_ab, H100): the sections
// under the snake, 1.03-1.39x on those shapes but 0.88-1.15x over draws of mixed lengths (which
// CTA draws which lengths is luck); the counter without sections, 0.90x at 16 x 1k and 1.00x at
// 64 x 256; the counter for one sequence as well, 0.96x at 4k 16/8 and 0.97x on an fp8 cache's
// 4k (the producer's barrier a tile); sections of 32 MB, 1.16x at 64 x 256 (two sections) where
// 16 MB gave 1.37x.
// Where a short work tile's time goes (benchmarks/prefill_ab/mkprof.py, clock64 stamps, H100; the
// profiled build runs 5-25% slower): at 64 x 256 a consumer warpgroup spends ~12.4k cycles a work
// tile (1.5 key tiles), of which the epilogue ~4.4k (staging, stores, fence and release), the
// softmax of tile 0 ~1.5k, S(0) ~0.7k, the last P V ~1.0k, and the waits for Q and K(0) only
// ~1.2k; at 16 x 1k the epilogue is ~3.2k of ~21k (an upper bound: the profiler's own atomics may
// be in flight at the epilogue's fence). The producer is rarely what the consumers wait
// for, and three variants aimed at it lost (prefill_ab, H100, against this kernel, same call):
// thread 0 prefetching (L1) the next tile's sequence bounds and block-table row from the
// counter's index, 0.95-0.99x with several sequences (1.00-1.025x with one); three Q buffers with
// a V ring of two (the producer two tiles ahead), 1.017x at 64 x 256 but 0.77-0.98x on every
// other shape; a tile's K(0) copied before its Q buffer wait, 0.87-1.00x.
// The epilogue, then (prefill_ab, H100, 3 rounds, same call, against the kernel before): its
// staged rows read back in one batch and the Q buffer released before the global stores, which
// step each row's token and head instead of dividing (see there): 64 x 256 1.070x, 16 x 1k
// 1.053x, mixes of 24 x 100..1024 1.042-1.048x, 48 x 64..512 1.068x, 8 x 2k 1.028x, prefix
// 2k / 8k 1.014x, 4k 1.013x, pages of 16 1.002-1.013x, the one-tile grid's 16k and prefix
// 512 / 16k 1.00x (the same bits everywhere). Without the stores at all (a bound, wrong output)
// 64 x 256 would gain another 1.2x. TMA stores of a warp's 16 rows (the Q load's box on the
// output), with the buffer released after the next tile's first GEMM, against the plain
// epilogue (prefill_ab, H100, 3 rounds, bit-identical output): on pages of 256 64 x 256 1.030x,
// 16 x 1k 1.029x, mixes of 64..2048 1.013-1.037x, prefix 2k / 8k 1.020x, 4k 1.011x; but on pages
// of 16 0.955-0.974x, on the one-tile grid ~0.98x and on a prefix chunk of 512 queries against
// 16k keys 0.985-0.988x, and the kernel spills; on pages of 128 16 x 1k 1.025x and 4k 1.019x, of
// 64 0.971-0.996x, of 32 0.989-0.990x (prefill_ab, H100, 3 rounds). So TMA stores only where
// they gained: the persistent grid over a 16-bit cache in pages of 128 or 256, at 2048 query
// tokens or more (kTmaOut; its two instances spill 28 bytes, and every other launch compiles to
// the plain epilogue's SASS).
// Short tiles are partly memory-bound: 64 x 256 (causal 32/8)
// moves Q 134 MB, K and V 67 MB and the output 134 MB, 335 MB that take ~110 us at the H100's
// ~3 TB/s of practical bandwidth, more than its ~80 us of tensor-core work (1.5 key tiles a
// 128-row tile, dense); cuDNN's ~131 us keeps the memory ~85% busy, this kernel's ~158 us ~70%
// (the H200's 4.8 TB/s leaves more room).
//
// FP8 cache (KV = uint8_t, e4m3 with per-layer scales; prefill.cu's header has the numerics): the
// GEMMs run in fp16 (e4m3 -> fp16 is exact). The producer copies each K / V tile's e4m3 bytes
// into a staging tile (plain 128-byte rows; one for K, one for V), waits for its own copies,
// widens them to fp16 into the ring slot (the swizzled tile the wgmma descriptors read) and
// arrives on the slot's "full" barrier with an ordinary arrival; the next tile's copies go out as
// soon as a staging tile has been widened, so the copies of tile n + 1 are in flight while the
// producer waits for slot n's consumers. Each consumer turns its 64 rows of a bf16 Q buffer into
// fp16 in place before its first S. The staging tiles (32 KiB) cost the persistent grid its third
// V slot and the one-tile grid its third K slot.
// Measured (H100, bench_attention_prefill.py's fp8 rows, causal 32/8, us): against the mma.sync
// kernel that read an fp8 cache before, same call: 8 x 2k bs 16 1,283.9 -> 869.9, 4k bs 256
// 615.5 -> 366.6; still 0.75x / 0.69x of this kernel on a bf16 cache (665 / 256). Lost, same
// call, alternating (branch experiment/prefill-ws-fp8-in-slot): each e4m3 chunk staged inside the
// ring slot where its fp16 values go and widened in place, which keeps the 16-bit kernel's rings
// and needs no staging tiles: 915.0 / 911.1 against 877.8 / 880.0 at 8 x 2k, 385.3 / 386.2
// against 370.1 / 366.0 at 4k (a copy must then wait for its slot to empty, and the copies run
// only one tile ahead of the widening either way).
#include <cuda.h>  // CUtensorMap (the map is encoded through the runtime's driver entry point)
#include <cudaTypedefs.h>

#include <mutex>
#include <type_traits>

#include "prefill_common.cuh"
#include "qwen3_kernels/e4m3.cuh"

#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900 && defined(__CUDA_ARCH_FEAT_SM90_ALL)
#define QWEN3_PREFILL_WS 1
#endif

namespace qwen3_kernels {
namespace prefill {
namespace {

constexpr int kBlockM = 128;                        // 2 consumer warpgroups x 64 packed rows
constexpr int kBlockN = 128;                        // keys per K/V tile
constexpr int kThreads = 384;                       // producer + 2 consumer warpgroups
constexpr int kQBytes = kBlockM * kHeadDim * 2;     // 32 KiB per Q buffer
constexpr int kTileBytes = kBlockN * kHeadDim * 2;  // 32 KiB per K or V slot
// setmaxnreg budgets: the producer needs ~37 registers, a consumer ~190 (O, S and P of a 64 x 128
// tile live at once: 64 + 64 + 32). 128 * 40 + 256 * 232 = 64512 = 384 threads x 168. An fp8
// cache's producer also widens tiles (a chunk in, two out): at 40 it spills, at 56 it does not.
// The budgets must fit what the CTA was launched with (384 threads x the 168 registers
// __launch_bounds__(384, 1) gives), not the register file: a setmaxnreg.inc beyond it waits
// forever for registers nobody frees.
constexpr int kLaunchRegs = 168;
template <bool kFp8>
constexpr int kProducerRegs = kFp8 ? 56 : 40;
template <bool kFp8>
constexpr int kConsumerRegs = kFp8 ? 224 : 232;
static_assert(128 * kProducerRegs<false> + 256 * kConsumerRegs<false> <= kThreads * kLaunchRegs,
              "setmaxnreg budgets");
static_assert(128 * kProducerRegs<true> + 256 * kConsumerRegs<true> <= kThreads * kLaunchRegs,
              "setmaxnreg budgets");

constexpr int kInfoBytes = 64;                      // one published work tile (TileInfo)
// K / V bytes of the (sequence, kv head) pairs of one section of the persistent order: a third of
// the H100's 50 MB L2, which the Q and output streams pass through too.
constexpr int64_t kSectionBytes = int64_t{16} << 20;
constexpr int kMinSectionPairs = 16;
constexpr uint32_t kProducerBar = 5;  // named barrier of the producer's 128 threads

// The buffers of each grid: the persistent one double-buffers Q at the cost of a K slot; the
// one-tile grid has one tile, so one Q buffer and a K ring of 3. An fp8 cache's two staging tiles
// take a V slot (persistent) or a K slot (one-tile).
template <bool kPersistent, bool kFp8>
struct Buffers {
  static constexpr int kQ = kPersistent ? 2 : 1;                // Q buffers (with a TileInfo each)
  static constexpr int kK = kPersistent || kFp8 ? 2 : 3;        // K ring depth
  static constexpr int kV = kPersistent && kFp8 ? 2 : 3;        // V ring depth
  static constexpr int kStaging = kFp8 ? 2 * kBlockN * kHeadDim : 0;  // e4m3 K and V tiles
  // 1 KiB alignment slack + Q buffers + the K and V rings + staging + TileInfos + the barriers (a
  // full and an empty per Q buffer and ring slot, 8 bytes each) + the producer's two list
  // indices (persistent grid).
  static constexpr int kSmemBytes = 1024 + kQ * kQBytes + (kK + kV) * kTileBytes + kStaging +
                                    kQ * kInfoBytes + 16 * (kQ + kK + kV) + 8;
  static_assert(kSmemBytes <= 227 * 1024, "the rings must fit the opt-in shared memory");
};

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

// Work tile i of the persistent grid's list, or false past its end. The list: the (sequence, kv
// head) pairs in sections of section_pairs (the last may be smaller); a section's tiles are its
// M blocks from the last (in a causal prefill the longest key range) to the first, each over the
// section's pairs, or from the first to the last in every other section, so that the list ends
// on its shortest tiles (longest first) and neighbouring sections meet at tiles of one length.
// Why sections: every M block of a pair reads the pair's keys again, and over all pairs at once
// those re-reads came back from HBM once the pairs' K / V outgrew the L2 (8 x 2k, 16 x 1k,
// 64 x 256: 64 MB); a section's K / V stay in it (see kSectionBytes).
// Who takes which tile (the producer's loop below): with several sequences, the CTAs take the
// list's tiles in order from a counter in global memory (p.tile_counter, zeroed by the launch),
// each when its producer is ready for another, so a CTA that drew short tiles takes more of them
// (sequences of mixed lengths give one M block's tiles mixed lengths). One sequence, or no more
// tiles than CTAs, has no counter: round r of the G CTAs takes tiles r G .. r G + G - 1, CTA b
// the b-th of them on even rounds and the (G-1-b)-th on odd ones (a snake: the CTA with one of
// the longest tiles of a round gets one of the shortest of the next), and one M block's tiles are
// of one length; a host model of a causal 4k prefill (1,024 tiles of 1..32 key tiles, 132 CTAs)
// puts the busiest CTA within 1% of the average.
__device__ __forceinline__ bool list_tile(int i, int m_blocks, int kv_heads, int batch,
                                          int section_pairs, WorkTile& w) {
  const int pairs = kv_heads * batch;
  if (i >= m_blocks * pairs) return false;  // the launch keeps m_blocks * pairs below 2^31
  const int section = i / (m_blocks * section_pairs);
  const int in_section = i - section * (m_blocks * section_pairs);
  const int first = section * section_pairs;
  const int n_pairs = min(section_pairs, pairs - first);
  const int level = in_section / n_pairs;
  const int pair = first + (in_section - level * n_pairs);
  const int sections = (pairs + section_pairs - 1) / section_pairs;
  w.m_block = ((sections - 1 - section) & 1) ? level : m_blocks - 1 - level;
  w.seq = pair / kv_heads;
  w.kv_head = pair - w.seq * kv_heads;
  return true;
}

// A work tile as the producer publishes it (shared memory, with its Q): packed rows row0 ..
// of sequence seq (its first query token at q_start, rows = its query length x group) for one kv
// head; query token t sits at absolute position shift + t; n_tiles key tiles, the first n_full
// without a mask. n_tiles == kEndOfWork: no more work for this CTA.
struct TileInfo {
  int kv_head, seq, q_start, rows, row0, shift, n_tiles, n_full;
};
static_assert(sizeof(TileInfo) <= kInfoBytes, "TileInfo slot");
constexpr int kEndOfWork = -2;

#endif  // QWEN3_PREFILL_WS

// One-tile grid (Hkv, m_blocks, B): the CTA's list is its one work tile (M blocks in reverse:
// longest rows first). Persistent (kPersistent): grid (min(tiles, SMs)), tiles from list_tile
// (section_pairs, and who takes which: see there). kTmaQ: thread 0
// loads each Q tile with two TMA copies through q_map (see encode_rows_map); else all producer
// threads copy it with cp.async (q_map unused). kTmaOut (persistent grid, two Q buffers): a
// warp stores its 16 output rows with two TMA copies through out_map where they all lie in the
// sequence (see the epilogue); else out_map is unused.
// KV: the cache's element type (T, or uint8_t for e4m3); M: the GEMMs' 16-bit type.
template <typename T, typename KV, bool kPersistent, bool kTmaQ, bool kTmaOut>
__global__ void __launch_bounds__(kThreads, 1)
    prefill_ws_kernel(const PrefillParams p, const __grid_constant__ CUtensorMap q_map,
                      int m_blocks, int batch, int section_pairs,
                      const __grid_constant__ CUtensorMap out_map) {
#if defined(QWEN3_PREFILL_WS)
  using namespace sm90;
  constexpr bool kFp8 = std::is_same_v<KV, uint8_t>;
  using M = std::conditional_t<kFp8, __half, T>;
  using Buf = Buffers<kPersistent, kFp8>;
  constexpr int kQBuffers = Buf::kQ;
  constexpr int kKStages = Buf::kK;
  constexpr int kVStages = Buf::kV;
  extern __shared__ uint8_t smem_raw[];
  const uint32_t raw_addr = smem_addr(smem_raw);
  const uint32_t s_q = (raw_addr + 1023) & ~1023u;  // [kQBuffers] Q buffers
  uint8_t* smem = smem_raw + (s_q - raw_addr);
  const uint32_t s_k = s_q + kQBuffers * kQBytes;       // [kKStages] K slots
  const uint32_t s_v = s_k + kKStages * kTileBytes;     // [kVStages] V slots
  const uint32_t s_k8 = s_v + kVStages * kTileBytes;    // fp8 cache: e4m3 K staging tile
  const uint32_t s_v8 = s_k8 + Buf::kStaging / 2;       //   and V staging tile
  const uint32_t s_info = s_k8 + Buf::kStaging;         // [kQBuffers] TileInfo
  TileInfo* info = reinterpret_cast<TileInfo*>(smem + (s_info - s_q));
  const uint32_t s_bar = s_info + kQBuffers * kInfoBytes;    // 8-byte mbarriers:
  const uint32_t bar_q_full = s_bar;                         //   [kQBuffers] Q + info landed
  const uint32_t bar_q_empty = bar_q_full + 8 * kQBuffers;   //   [kQBuffers] Q done by 8 warps
  const uint32_t bar_k_full = bar_q_empty + 8 * kQBuffers;   //   [kKStages]
  const uint32_t bar_k_empty = bar_k_full + 8 * kKStages;    //   [kKStages] read by 8 warps
  const uint32_t bar_v_full = bar_k_empty + 8 * kKStages;    //   [kVStages]
  const uint32_t bar_v_empty = bar_v_full + 8 * kVStages;    //   [kVStages] read by 8 warps
  int* tile_index = reinterpret_cast<int*>(smem + (bar_v_empty + 8 * kVStages - s_q));  // [2]

  const int group = p.group;
  const int tid = threadIdx.x;
  const int wg = tid >> 7;
  if (!kPersistent) {  // an M block past a shorter sequence's rows: the whole CTA returns early
    const int seq = blockIdx.z;
    const int rows = (p.cu_seqlens_q[seq + 1] - p.cu_seqlens_q[seq]) * group;
    if (static_cast<int>(gridDim.y - 1 - blockIdx.y) * kBlockM >= rows) return;
  }

  if (tid == 0) {
#pragma unroll
    for (int b = 0; b < kQBuffers; ++b) {
      // TMA: thread 0's arrive.expect_tx (after its TileInfo) and the copies' bytes; cp.async:
      // 128 cp.async-tracked arrivals and thread 0's plain one after its TileInfo.
      mbar_init(bar_q_full + 8 * b, kTmaQ ? 1 : 129);
      mbar_init(bar_q_empty + 8 * b, 8);   // one arrival per consumer warp
    }
#pragma unroll
    for (int s = 0; s < kKStages; ++s) {
      mbar_init(bar_k_full + 8 * s, 128);
      mbar_init(bar_k_empty + 8 * s, 8);
    }
#pragma unroll
    for (int s = 0; s < kVStages; ++s) {
      mbar_init(bar_v_full + 8 * s, 128);
      mbar_init(bar_v_empty + 8 * s, 8);
    }
    mbar_init_fence();
  }
  __syncthreads();

  if (wg == 0) {
    // ---------------------------------- producer ----------------------------------
    regs_dealloc<kProducerRegs<kFp8>>();
    const int ld_chunk = tid & 15;  // Q: 16 threads copy one 256-byte row
    const int ld_row = tid >> 4;    // rows ld_row + 8 i
    // K / V: a cache row is kKvChunks 16-byte chunks (16 for 16-bit, 8 for e4m3); this thread
    // copies chunk kv_chunk of rows kv_row + kKvRowsPerPass i.
    constexpr int kKvChunks = kHeadDim * static_cast<int>(sizeof(KV)) / 16;
    constexpr int kKvRowsPerPass = 128 / kKvChunks;
    const int kv_chunk = tid % kKvChunks;
    const int kv_row = tid / kKvChunks;
    const int64_t slot_stride = (int64_t)p.num_kv_heads * kHeadDim;  // elements between slots
    const int log2_bs = p.block_size_log2;
    const int block_mask = (1 << log2_bs) - 1;
    // Row kv_row + kKvRowsPerPass i of a tile lands at dst_row0 + kDstRowStep i: in a 16-bit slot
    // the 128-byte swizzle XORs the chunk with row & 7, which is kv_row for all 16 of this
    // thread's rows; a staging tile has plain 128-byte rows.
    const uint32_t dst_row0 =
        kFp8 ? kv_row * kHeadDim + kv_chunk * 16 : gmma_offset(kv_row, kv_chunk, kBlockN);
    constexpr uint32_t kDstRowStep = kFp8 ? kKvRowsPerPass * kHeadDim : 1024;
    const int64_t row_step = kKvRowsPerPass * slot_stride;  // elements from one row to the next
    int k_stage = 0, v_stage = 0;              // next ring slots, over all work tiles
    uint32_t k_parity = 0, v_parity = 0;       // (tiles through the ring / depth) & 1
    int j = 0;  // tiles published: Q buffer j % kQBuffers
    // The persistent grid's list index of this CTA's k-th tile (see list_tile). From the counter:
    // thread 0 takes it one tile ahead of its use (the atomic's round trip overlaps this tile's
    // copies) and hands it to the other producer threads through shared memory (two slots, so
    // one barrier a tile suffices). Without one (the snake), every thread computes it.
    int32_t* const counter = p.tile_counter;
    int next = kPersistent && counter != nullptr && tid == 0 ? atomicAdd(counter, 1) : 0;
    for (int k = 0;; ++k) {
      WorkTile w;
      bool more;
      if (kPersistent) {
        int i;
        if (counter != nullptr) {
          volatile int* slot = tile_index + (k & 1);
          if (tid == 0) *slot = next;
          named_bar_sync(kProducerBar, 128);
          i = *slot;
        } else {
          const int g = static_cast<int>(gridDim.x), b = static_cast<int>(blockIdx.x);
          const int64_t snake = static_cast<int64_t>(k) * g + ((k & 1) ? g - 1 - b : b);
          i = snake < 0x7fffffff ? static_cast<int>(snake) : 0x7fffffff;  // past the end either way
        }
        more = list_tile(i, m_blocks, p.num_kv_heads, batch, section_pairs, w);
        if (counter != nullptr && tid == 0 && more) next = atomicAdd(counter, 1);
      } else {
        more = k == 0;
        w = WorkTile{static_cast<int>(blockIdx.x), static_cast<int>(gridDim.y - 1 - blockIdx.y),
                     static_cast<int>(blockIdx.z)};
      }
      TileInfo t;
      int lk = 0;
      if (more) {
        t.kv_head = w.kv_head;
        t.seq = w.seq;
        t.q_start = p.cu_seqlens_q[w.seq];
        const int lq = p.cu_seqlens_q[w.seq + 1] - t.q_start;
        t.rows = lq * group;
        t.row0 = w.m_block * kBlockM;
        if (t.row0 >= t.rows) continue;  // past a shorter sequence's rows: nothing to do
        lk = min(p.seq_lens_k[w.seq], p.max_blocks << p.block_size_log2);
        t.shift = lk - lq;
        const int t_first = t.row0 / group;
        const int t_last = (min(t.row0 + kBlockM, t.rows) - 1) / group;
        const int key_end = t.shift + t_last + 1;
        t.n_tiles = key_end > 0 ? (key_end + kBlockN - 1) / kBlockN : 0;
        t.n_full = max(0, (t.shift + t_first + 1) / kBlockN);
      } else {
        t.n_tiles = kEndOfWork;
      }
      // Q buffer b is free once every consumer warp has stored its output of tile j - kQBuffers
      // through it.
      const int b = j % kQBuffers;
      mbar_wait<true>(bar_q_empty + 8 * b, ((j / kQBuffers) & 1) ^ 1);
      ++j;
      if (tid == 0) info[b] = t;
      if (!more) {
        if (!kTmaQ) mbar_arrive(bar_q_full + 8 * b);  // 128 plain arrivals + thread 0's below
        if (tid == 0) mbar_arrive(bar_q_full + 8 * b);
        break;
      }
      if (kTmaQ) {
        // One box per half of D: the M block's 128 / group tokens x group heads are its packed
        // rows in order; rows past the sequence hold the next one's tokens (their outputs are
        // never stored), rows past Tq are zero-filled.
        if (tid == 0) {
          const uint32_t bar = bar_q_full + 8 * b;
          mbar_arrive_expect_tx(bar, kQBytes);  // also releases the info written above
#pragma unroll
          for (int half = 0; half < 2; ++half)
            tma_load_3d(s_q + b * kQBytes + half * (kBlockM * 128), &q_map, half * 64,
                        t.kv_head * group, t.q_start + t.row0 / group, bar);
        }
      } else {
        load_q_tile<T, kBlockM, 8, 4>(p, s_q + b * kQBytes, t.q_start, t.kv_head, group, t.row0,
                                      t.rows, ld_row, ld_chunk,
                                      [&](int r) { return gmma_offset(r, ld_chunk, kBlockM); });
        cp_async_mbar_arrive(bar_q_full + 8 * b);
        if (tid == 0) mbar_arrive(bar_q_full + 8 * b);  // releases the info written above
      }

      constexpr int kChunkElems = 16 / static_cast<int>(sizeof(KV));
      const KV* k_head =
          static_cast<const KV*>(p.k_cache) + t.kv_head * kHeadDim + kv_chunk * kChunkElems;
      const KV* v_head =
          static_cast<const KV*>(p.v_cache) + t.kv_head * kHeadDim + kv_chunk * kChunkElems;
      const int32_t* table = p.block_tables + (int64_t)t.seq * p.max_blocks;
      // Pages of 2^kLog2 < 128 keys: a tile starts on a page boundary and spans 128 >> kLog2
      // pages; this thread's rows of a page are the kPageRows rows kv_row, kv_row +
      // kKvRowsPerPass, ... of it.
      auto load_small_pages = [&](uint32_t dst, const KV* head_base, int kt, auto log2_tag) {
        constexpr int kLog2 = decltype(log2_tag)::value;
        constexpr int kPageRows = (1 << kLog2) / kKvRowsPerPass;
        static_assert(kPageRows >= 1, "a page holds a pass of rows");
        const int32_t* tile_pages = table + ((kt * kBlockN) >> kLog2);
#pragma unroll
        for (int pg = 0; pg < (kBlockN >> kLog2); ++pg) {
          const int key_first = kt * kBlockN + (pg << kLog2) + kv_row;  // this thread's first row
          const int64_t page = key_first < lk ? __ldg(tile_pages + pg) : 0;
          const KV* src = head_base + ((page << kLog2) + kv_row) * slot_stride;
#pragma unroll
          for (int i = 0; i < kPageRows; ++i) {
            const bool valid = key_first + kKvRowsPerPass * i < lk;
            cp_async_16(dst + dst_row0 + kDstRowStep * (pg * kPageRows + i),
                        valid ? src + i * row_step : head_base, valid);
          }
        }
      };
      // This thread's rows of key tile kt -> dst; keys past the sequence are zero-filled (and
      // their block-table entries never read). This loop was the producer's bottleneck at ~40
      // instructions a row, and the consumers waited on K (H200 profile): now the source address
      // is computed once per page the rows touch and stepped kKvRowsPerPass slots a row between.
      auto load_tile = [&](uint32_t dst, const KV* head_base, int kt) {
        const int key0 = kt * kBlockN + kv_row;
        if (log2_bs >= 7) {
          // Pages of >= 128 keys: the whole tile is in one page (kt * 128 < lk: the tile exists).
          const int64_t page = __ldg(table + ((kt * kBlockN) >> log2_bs));
          const KV* src = head_base + ((page << log2_bs) + (key0 & block_mask)) * slot_stride;
          if (kt * kBlockN + kBlockN <= lk) {  // every row valid (all but the last tile)
#pragma unroll
            for (int i = 0; i < kBlockN / kKvRowsPerPass; ++i)
              cp_async_16(dst + dst_row0 + kDstRowStep * i, src + i * row_step, true);
          } else {
#pragma unroll
            for (int i = 0; i < kBlockN / kKvRowsPerPass; ++i) {
              const bool valid = key0 + kKvRowsPerPass * i < lk;
              cp_async_16(dst + dst_row0 + kDstRowStep * i, valid ? src + i * row_step : head_base,
                          valid);
            }
          }
          return;
        }
        // Pages of 16 / 32 / 64 keys (the op accepts 16..256): each its own unrolled loop.
        if (log2_bs == 4) load_small_pages(dst, head_base, kt, std::integral_constant<int, 4>());
        if (log2_bs == 5) load_small_pages(dst, head_base, kt, std::integral_constant<int, 5>());
        if (log2_bs == 6) load_small_pages(dst, head_base, kt, std::integral_constant<int, 6>());
      };
      auto advance_k = [&]() {
        if (++k_stage == kKStages) {
          k_stage = 0;
          k_parity ^= 1;
        }
      };
      auto advance_v = [&]() {
        if (++v_stage == kVStages) {
          v_stage = 0;
          v_parity ^= 1;
        }
      };
      if constexpr (kFp8) {
        // This thread's staged chunks (its own copies, landed) -> fp16 in the swizzled slot.
        // Chunk c of a row becomes 16-bit chunks 2c and 2c + 1, in the slot's first half for
        // c < 4 and its second for c >= 4; the second half's threads store their upper chunk
        // first, so each quarter-warp's stores (one row) hit 8 distinct 16-byte bank groups.
        auto widen_tile = [&](uint32_t staged, uint32_t slot) {
          const bool upper_first = kv_chunk >= 4;
#pragma unroll 2  // fully unrolled, the loads are hoisted and the producer spills
          for (int i = 0; i < kBlockN / kKvRowsPerPass; ++i) {
            const int r = kv_row + kKvRowsPerPass * i;
            uint4 lo, hi;
            fp8::e4m3x16_to_half(
                *reinterpret_cast<const uint4*>(smem + (staged - s_q) + dst_row0 +
                                                kDstRowStep * i),
                lo, hi);
            uint8_t* base = smem + (slot - s_q);
            uint4* at_lo = reinterpret_cast<uint4*>(base + gmma_offset(r, 2 * kv_chunk, kBlockN));
            uint4* at_hi =
                reinterpret_cast<uint4*>(base + gmma_offset(r, 2 * kv_chunk + 1, kBlockN));
            if (upper_first) {
              *at_hi = hi;
              *at_lo = lo;
            } else {
              *at_lo = lo;
              *at_hi = hi;
            }
          }
        };
        // Groups in flight, in commit order: {K(0)}, {V(0)}, then per tile kt: {K(kt+1)},
        // {V(kt+1)} (empty past the last), so "all but the newest group" is always the one due.
        if (t.n_tiles > 0) {
          load_tile(s_k8, k_head, 0);
          cp_async_commit();
          load_tile(s_v8, v_head, 0);
          cp_async_commit();
        }
        for (int kt = 0; kt < t.n_tiles; ++kt) {
          cp_async_wait<1>();  // K(kt) landed
          mbar_wait<true>(bar_k_empty + 8 * k_stage, k_parity ^ 1);
          widen_tile(s_k8, s_k + k_stage * kTileBytes);
          mbar_arrive(bar_k_full + 8 * k_stage);
          advance_k();
          if (kt + 1 < t.n_tiles) load_tile(s_k8, k_head, kt + 1);
          cp_async_commit();
          cp_async_wait<1>();  // V(kt) landed
          mbar_wait<true>(bar_v_empty + 8 * v_stage, v_parity ^ 1);
          widen_tile(s_v8, s_v + v_stage * kTileBytes);
          mbar_arrive(bar_v_full + 8 * v_stage);
          advance_v();
          if (kt + 1 < t.n_tiles) load_tile(s_v8, v_head, kt + 1);
          cp_async_commit();
        }
      } else {
        for (int kt = 0; kt < t.n_tiles; ++kt) {
          mbar_wait<true>(bar_k_empty + 8 * k_stage, k_parity ^ 1);
          load_tile(s_k + k_stage * kTileBytes, k_head, kt);
          cp_async_mbar_arrive(bar_k_full + 8 * k_stage);
          advance_k();
          mbar_wait<true>(bar_v_empty + 8 * v_stage, v_parity ^ 1);
          load_tile(s_v + v_stage * kTileBytes, v_head, kt);
          cp_async_mbar_arrive(bar_v_full + 8 * v_stage);
          advance_v();
        }
      }
    }
    // Outstanding copies finish before the thread exits (their barrier arrivals still count).
    asm volatile("cp.async.wait_all;\n" ::: "memory");
    return;
  }

  // ---------------------------------- consumers ----------------------------------
  regs_alloc<kConsumerRegs<kFp8>>();
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
  auto issue_s = [&](float (&s)[64], uint32_t q_buf, uint32_t k_slot) {
#pragma unroll
    for (int kk = 0; kk < kHeadDim / 16; ++kk) {
      const uint32_t half_k = kk >> 2, col = (kk & 3) * 32;
      const uint64_t da =
          desc_sw128(q_buf + half_k * (kBlockM * 128) + c * (64 * 128) + col, 16, 1024);
      const uint64_t db = desc_sw128(k_slot + half_k * (kBlockN * 128) + col, 16, 1024);
      wgmma_m64n128k16_ss<M>(s, da, db, kk > 0 ? 1 : 0);
    }
  };
  // O += P V (8 k-steps over the keys; V read MN-major).
  auto issue_pv = [&](const uint32_t (&p_frag)[kBlockN / 16][4], uint32_t v_slot) {
#pragma unroll
    for (int kk = 0; kk < kBlockN / 16; ++kk)
      wgmma_m64n128k16_rs<M>(o, p_frag[kk],
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
      p_frag[kk][0] = pack2<M>(s[8 * kk + 0], s[8 * kk + 1]);
      p_frag[kk][1] = pack2<M>(s[8 * kk + 2], s[8 * kk + 3]);
      p_frag[kk][2] = pack2<M>(s[8 * kk + 4], s[8 * kk + 5]);
      p_frag[kk][3] = pack2<M>(s[8 * kk + 6], s[8 * kk + 7]);
    }
  };

  const uint32_t my_turn = 1 + c;  // named barrier ids of the ping-pong
  const uint32_t other_turn = 2 - c;
  if (c == 1) named_bar_arrive(1, 256);  // consumer 0 goes first

  // The K and V rings over all work tiles: the next K tile is in slot k_stage of round parity
  // k_parity, the next V tile (V(n - 1) during step n) in v_stage / v_parity.
  int k_stage = 0, v_stage = 0;
  uint32_t k_parity = 0, v_parity = 0;
  // kTmaOut: tile j - 1's Q buffer, which held its output on the way out, goes back to the
  // producer once tile j's first GEMM is issued (lane 0 waits for the output's TMA store, if
  // any, to have read it).
  auto release_previous = [&](int j) {
    if (kTmaOut && j > 0 && lane == 0) {
      bulk_wait_group_read<0>();
      mbar_arrive(bar_q_empty + 8 * ((j - 1) % kQBuffers));
    }
  };
  for (int j = 0;; ++j) {
    // Every thread waits for the tile's Q and TileInfo itself.
    const int b = j % kQBuffers;
    const uint32_t q_buf = s_q + b * kQBytes;
    mbar_wait(bar_q_full + 8 * b, (j / kQBuffers) & 1);
    const TileInfo tile = info[b];
    if (tile.n_tiles == kEndOfWork) break;
    if constexpr (kFp8 && !std::is_same_v<T, __half>) {
      // This consumer's 64 rows of Q (both halves of D) from T to fp16, in place: thread i of the
      // warpgroup converts chunk i & 15 of rows i / 16 + 8 j. Then the generic writes are made
      // visible to wgmma (async proxy) and the warpgroup waits for all of them (barrier 3 + c).
      const int i = tid & 127;
#pragma unroll
      for (int jr = 0; jr < 8; ++jr) {
        uint4* at = reinterpret_cast<uint4*>(
            smem + (q_buf - s_q) + gmma_offset(c * 64 + (i >> 4) + 8 * jr, i & 15, kBlockM));
        uint4 v = *at;
        v.x = fp8::to_half2<T>(v.x);
        v.y = fp8::to_half2<T>(v.y);
        v.z = fp8::to_half2<T>(v.z);
        v.w = fp8::to_half2<T>(v.w);
        *at = v;
      }
      fence_proxy_async();
      named_bar_sync(3 + c, 128);
    }
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

    // alpha of the last tile whose softmax ran: o is rescaled by it once the P V before landed.
    float alpha[2] = {1.f, 1.f};
    int pp_stage = -1;  // V slot of the P V in flight (-1: none)
    auto advance_k = [&]() {
      if (++k_stage == kKStages) {
        k_stage = 0;
        k_parity ^= 1;
      }
    };
    auto advance_v = [&]() {
      if (++v_stage == kVStages) {
        v_stage = 0;
        v_parity ^= 1;
      }
    };
    // Tile 0: S(0) alone (o is still zero: nothing to rescale, no P V yet).
    if (n_tiles > 0) {
      named_bar_sync(my_turn, 256);
      mbar_wait(bar_k_full + 8 * k_stage, k_parity);
      fence_proxy_async();
      float s[64];
      wgmma_fence();
      issue_s(s, q_buf, s_k + k_stage * kTileBytes);
      wgmma_commit();
      named_bar_arrive(other_turn, 256);
      release_previous(j);
      wgmma_wait<0>();
      fence_regs(s);
      if (lane == 0) mbar_arrive(bar_k_empty + 8 * k_stage);  // this warp is done with K(0)
      softmax(s, 0, alpha);
      pack_p(s, p_buf[0]);
      advance_k();
    } else {
      release_previous(j);
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
    // One iteration: S(n) on K slot k_stage, P(n-1) V(n-1) on V slot v_stage; p_prev holds P(n-1)
    // (read by this iteration's P V), p_next receives P(n).
    auto step = [&](int n, uint32_t (&p_prev)[kBlockN / 16][4],
                    uint32_t (&p_next)[kBlockN / 16][4]) {
      named_bar_sync(my_turn, 256);
      mbar_wait(bar_v_full + 8 * v_stage, v_parity);  // issued before K(n): usually landed
      retire_pv();
      mbar_wait(bar_k_full + 8 * k_stage, k_parity);
      fence_proxy_async();
      float s[64];
      fence_regs(o);
      fence_regs(p_prev);
      wgmma_fence();  // o and p_prev were written by ordinary instructions
      issue_s(s, q_buf, s_k + k_stage * kTileBytes);
      wgmma_commit();
      issue_pv(p_prev, s_v + v_stage * kTileBytes);
      wgmma_commit();
      named_bar_arrive(other_turn, 256);  // the other consumer may issue now
      wgmma_wait<1>();                    // S(n) is done; P V may still run
      fence_regs(s);
      if (lane == 0) mbar_arrive(bar_k_empty + 8 * k_stage);
      softmax(s, n, alpha);
      pack_p(s, p_next);  // into the buffer P V is not reading
      pp_stage = v_stage;
      advance_k();
      advance_v();
    };
    // The last tile's P V (outside the ping-pong: nothing follows it).
    auto last_pv = [&](uint32_t (&p_last)[kBlockN / 16][4]) {
      mbar_wait(bar_v_full + 8 * v_stage, v_parity);
      retire_pv();
      fence_proxy_async();
      fence_regs(o);
      fence_regs(p_last);
      wgmma_fence();
      issue_pv(p_last, s_v + v_stage * kTileBytes);
      wgmma_commit();
      wgmma_wait<0>();
      fence_regs(o);
      if (lane == 0) mbar_arrive(bar_v_empty + 8 * v_stage);
      advance_v();
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
    if constexpr (kFp8) {
      inv[0] *= p.v_scale;
      inv[1] *= p.v_scale;
    }
    // The output goes out through this warp's 16 rows of Q buffer b (rows it alone reads: the
    // warpgroup's last S has completed, and the other consumer reads its own 64 rows): each lane
    // writes its 4-byte pairs into the swizzled rows (one bank per lane), then each half-warp
    // stores a whole 256-byte row with 16-byte stores. From the registers each store wrote 4
    // bytes of 8 rows, half a 32-byte sector of each: H200, same inputs and bits, alternating,
    // staged / from registers: 64 x 256 1.07-1.08x, 14B 4 x 1000 (40/8) 1.08x, 4k bs 16 1.04x,
    // 16 x 1k 1.02-1.03x, mix 100..1024 1.01-1.02x, 8 x 2k 1.01x, 4k 1.00x, prefix Lq 512 /
    // Lk 16k 0.98x.
    const int row_base = c * 64 + warp * 16;  // this warp's first row of the Q buffer
#pragma unroll
    for (int h = 0; h < 2; ++h) {
#pragma unroll
      for (int jj = 0; jj < kHeadDim / 8; ++jj)
        *reinterpret_cast<uint32_t*>(smem + (q_buf - s_q) +
                                     gmma_offset(row_base + g + 8 * h, jj, kBlockM) + 4 * t4) =
            pack2<T>(o[4 * jj + 2 * h] * inv[h], o[4 * jj + 2 * h + 1] * inv[h]);
    }
    __syncwarp();
    if constexpr (kTmaOut) {
      // The tile's fields again from shared memory (its slot stays until the buffer goes back).
      const TileInfo ot = info[b];
      const int warp_row0 = ot.row0 + row_base;  // packed row of this warp's first row
      if (warp_row0 + 16 <= ot.rows) {
        // All 16 rows in the sequence: lane 0 stores them with a TMA copy a half of D (the box
        // of encode_rows_map: 16 / group tokens x group heads), the async proxy reading the
        // staged rows after every lane's fence; the buffer goes back at the next tile.
        fence_proxy_async();
        __syncwarp();
        if (lane == 0) {
#pragma unroll
          for (int half = 0; half < 2; ++half)
            tma_store_3d(&out_map, half * 64, ot.kv_head * group, ot.q_start + warp_row0 / group,
                         q_buf + half * (kBlockM * 128) + row_base * 128);
          bulk_commit_group();
        }
        continue;
      }
    }
    const int chunk = lane & 15;
    uint4 staged[8];  // this lane's 16 bytes of rows row_base + 2 i + (lane >> 4)
#pragma unroll
    for (int i = 0; i < 8; ++i)
      staged[i] = *reinterpret_cast<const uint4*>(
          smem + (q_buf - s_q) + gmma_offset(row_base + 2 * i + (lane >> 4), chunk, kBlockM));
    // This warp is done with Q buffer b: the producer may load a later tile's Q into it (by TMA:
    // the async proxy, hence the fence after these generic accesses). The warp's lanes have all
    // passed their Q wait (else, with the next two phases of the buffer complete, a lane still
    // polling this one's parity would wait for a third). The global stores come after the
    // release, from registers: behind the fence they held the buffer (and the next tile's Q) back.
    fence_proxy_async();
    __syncwarp();
    if (!kTmaOut && lane == 0) mbar_arrive(bar_q_empty + 8 * b);
    // Packed row pr is query token pr / group, head kv_head * group + pr % group: one division for
    // the lane's first row, then the quotient and remainder stepped by the 2 rows between stores
    // (a division a row was ~30 instructions and serialised each store behind its shared load).
    T* out = static_cast<T*>(p.out) + (int64_t)tile.q_start * p.num_q_heads * kHeadDim +
             (int64_t)tile.kv_head * group * kHeadDim + chunk * 8;
    int pr = tile.row0 + row_base + (lane >> 4);
    int token = pr / group;
    int within = pr - token * group;
#pragma unroll
    for (int i = 0; i < 8; ++i) {
      if (pr < tile.rows)
        *reinterpret_cast<uint4*>(out + ((int64_t)token * p.num_q_heads + within) * kHeadDim) =
            staged[i];
      pr += 2;
      within += 2;
      while (within >= group) {  // at most twice: group >= 1
        within -= group;
        ++token;
      }
    }
  }
  if (kTmaOut && lane == 0) bulk_wait_group_read<0>();  // shared memory outlives the last store
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

// A [Tq, Hq, D] tensor (Q or the output) as a 3-D TMA tensor (D, Hq, Tq) with the box (64 dims,
// group heads, box_rows / group tokens): box_rows packed rows of one half of D, in the 128-byte
// swizzle of the wgmma descriptors (the Q buffer's layout). False where box_rows is not a whole
// number of tokens (group not a power of two up to box_rows) or the map cannot be made (tensor
// not 16-byte aligned, no driver entry point). Why TMA for Q: see the header; for the output:
// see the epilogue.
bool encode_rows_map(const void* tensor, const PrefillParams& p, int num_tokens, int box_rows,
                     DType dtype, CUtensorMap* map) {
  const int group = p.group;
  if (group > box_rows || (group & (group - 1)) != 0 || num_tokens <= 0) return false;
  if ((reinterpret_cast<uintptr_t>(tensor) & 15) != 0) return false;
  static PFN_cuTensorMapEncodeTiled_v12000 encode = nullptr;
  static std::once_flag once;
  std::call_once(once, [] {
    cudaDriverEntryPointQueryResult found;
    void* fn = nullptr;
    if (cudaGetDriverEntryPointByVersion("cuTensorMapEncodeTiled", &fn, 12000, cudaEnableDefault,
                                         &found) == cudaSuccess &&
        found == cudaDriverEntryPointSuccess)
      encode = reinterpret_cast<PFN_cuTensorMapEncodeTiled_v12000>(fn);
    else
      (void)cudaGetLastError();
  });
  if (encode == nullptr) return false;
  const cuuint64_t dims[3] = {kHeadDim, static_cast<cuuint64_t>(p.num_q_heads),
                              static_cast<cuuint64_t>(num_tokens)};
  const cuuint64_t strides[2] = {kHeadDim * 2,
                                 static_cast<cuuint64_t>(p.num_q_heads) * kHeadDim * 2};
  const cuuint32_t box[3] = {64, static_cast<cuuint32_t>(group),
                             static_cast<cuuint32_t>(box_rows / group)};
  const cuuint32_t element_strides[3] = {1, 1, 1};
  return encode(map,
                dtype == DType::kFloat16 ? CU_TENSOR_MAP_DATA_TYPE_FLOAT16
                                         : CU_TENSOR_MAP_DATA_TYPE_BFLOAT16,
                3, const_cast<void*>(tensor), dims, strides, box, element_strides,
                CU_TENSOR_MAP_INTERLEAVE_NONE, CU_TENSOR_MAP_SWIZZLE_128B,
                CU_TENSOR_MAP_L2_PROMOTION_L2_256B,
                CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE) == CUDA_SUCCESS;
}

template <typename T, typename KV, bool kPersistent, bool kTmaQ, bool kTmaOut = false>
cudaError_t launch(const PrefillParams& p, const CUtensorMap& q_map, const CUtensorMap& out_map,
                   int batch, int max_seqlen_q, cudaStream_t stream) {
  const int64_t m_blocks = ((int64_t)max_seqlen_q * p.group + kBlockM - 1) / kBlockM;
  if (m_blocks > 65535) return cudaErrorInvalidConfiguration;  // grid.y limit
  auto kernel = prefill_ws_kernel<T, KV, kPersistent, kTmaQ, kTmaOut>;
  constexpr int kSmemBytes = Buffers<kPersistent, std::is_same_v<KV, uint8_t>>::kSmemBytes;
  cudaError_t err =
      cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, kSmemBytes);
  if (err != cudaSuccess) return err;
  dim3 grid(p.num_kv_heads, (unsigned)m_blocks, batch);
  PrefillParams lp = p;
  int section_pairs = 1;
  if (kPersistent) {
    const int64_t pairs = int64_t{p.num_kv_heads} * batch;
    const int64_t tiles = m_blocks * pairs;
    if (tiles >= (int64_t{1} << 31)) return cudaErrorInvalidConfiguration;
    const int sms = num_sms();
    if (sms <= 0) return cudaErrorInvalidDevice;
    grid = dim3((unsigned)(tiles < sms ? tiles : sms));
    if (tiles == 0) return cudaSuccess;
    // The work counter (list_tile), for several sequences with more tiles than CTAs.
    if (batch > 1 && tiles > sms) {
      if (p.tile_counter == nullptr) return cudaErrorInvalidValue;
      err = cudaMemsetAsync(p.tile_counter, 0, sizeof(int32_t), stream);
      if (err != cudaSuccess) return err;
    } else {
      lp.tile_counter = nullptr;
    }
    // Pairs a section (list_tile): as many as kSectionBytes of K and V hold at the longest
    // key range the block table allows; one section (all pairs) where fewer than
    // kMinSectionPairs would fit.
    const int64_t pair_bytes =
        (int64_t{p.max_blocks} << p.block_size_log2) * kHeadDim * int64_t{sizeof(KV)} * 2;
    const int64_t fit = kSectionBytes / (pair_bytes > 0 ? pair_bytes : 1);
    section_pairs = static_cast<int>(fit < kMinSectionPairs || fit >= pairs ? pairs : fit);
  }
  kernel<<<grid, kThreads, kSmemBytes, stream>>>(lp, q_map, (int)m_blocks, batch, section_pairs,
                                                 out_map);
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
  bool ok =
      cudaFuncGetAttributes(&attr,
                            prefill_ws_kernel<__nv_bfloat16, __nv_bfloat16, false, false, false>) ==
          cudaSuccess &&
      attr.binaryVersion == 90;
  if (!ok) (void)cudaGetLastError();  // clear a "no kernel image" error; we just fall back
  if (dev >= 0 && dev < 64) cached[dev] = ok ? 1 : 2;
  return ok;
}

cudaError_t launch_sm90_ws(const PrefillParams& p, int num_tokens, int batch, int max_seqlen_q,
                           DType dtype, bool fp8_kv, bool persistent, cudaStream_t stream) {
  if (!sm90_available()) return cudaErrorNotSupported;
  // Q: half an M block a box. The output: a warp's 16 rows a box, stored by TMA on the
  // persistent grid over a 16-bit cache in pages of 128 or 256 keys at kTmaOutMinTokens query
  // tokens or more; elsewhere (pages of 16..64, the one-tile grid, 512 queries against 16k keys)
  // TMA stores lost to the plain ones (see the header), and over an fp8 cache they are
  // unmeasured.
  constexpr int kTmaOutMinTokens = 2048;
  constexpr int kTmaOutMinPageLog2 = 7;  // pages of 128 keys
  CUtensorMap q_map = {}, out_map = {};
  const bool tma_q = encode_rows_map(p.q, p, num_tokens, kBlockM, dtype, &q_map);
  const bool tma_out = tma_q && persistent && !fp8_kv && p.block_size_log2 >= kTmaOutMinPageLog2 &&
                       num_tokens >= kTmaOutMinTokens &&
                       encode_rows_map(p.out, p, num_tokens, 16, dtype, &out_map);
  auto go = [&](auto t_tag, auto kv_tag) {
    using T = decltype(t_tag);
    using KV = decltype(kv_tag);
    if constexpr (std::is_same_v<KV, T>)
      if (tma_out)
        return launch<T, KV, true, true, true>(p, q_map, out_map, batch, max_seqlen_q, stream);
    if (tma_q)
      return persistent ? launch<T, KV, true, true>(p, q_map, out_map, batch, max_seqlen_q, stream)
                        : launch<T, KV, false, true>(p, q_map, out_map, batch, max_seqlen_q,
                                                     stream);
    return persistent ? launch<T, KV, true, false>(p, q_map, out_map, batch, max_seqlen_q, stream)
                      : launch<T, KV, false, false>(p, q_map, out_map, batch, max_seqlen_q,
                                                    stream);
  };
  return QWEN3_DISPATCH_HALF(dtype, T, [&] {
    return fp8_kv ? go(T{}, uint8_t{}) : go(T{}, T{});
  });
}

}  // namespace prefill
}  // namespace qwen3_kernels
