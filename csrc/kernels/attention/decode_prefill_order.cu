// The deterministic mode's decode of a sequence whose keys fit in the mode's first split (at most
// kDecodeInvariantSplitKeys, launchers.h): one query token per sequence in the prefill kernels'
// per-row order, so decode gives a token the bits prefill gives it at the same position (chunked
// prefill, prefix cache, recompute after preemption), and prefill runs at its own speed.
//
// The prefill kernels' order for one row (prefill_sm90_ws.cu; prefill.cu at BLOCK_N 128): key
// tiles of 128 from key 0; per tile S = Q K^T over 8 k16 steps of D from -0, softmax_step
// (prefill_common.cuh), P rounded to T, o <- alpha o, then o += P V over 8 k16 steps of keys;
// finally o / l rounded to T. mma.sync m16n8k16 gives a wgmma k16 step's fp32 bits for the same
// operands and accumulator (H200 probe), so one warp with the group's q heads as its 16 rows
// reproduces the 128-row wgmma tile's arithmetic without its 8x tensor work: the wgmma kernel run
// as decode (2..4 valid rows of 128) drew the power limit and lost clock (decode.cu, "batch-
// invariant").
//
// Work split. One CTA of 4 warps per (sequence, kv head) (grid (Hkv, B)) walks the sequence's
// keys in tiles of 128, the warps sharing each tile without changing a row's arithmetic: warp w
// computes S for keys 32 w .. 32 w + 31 (each score's k16 chain is its own), the row maxima meet in
// shared memory (a max has no order), each warp exponentiates its own scores with the common
// maximum, the P fragments and the pair sums of every key block go through shared memory, every
// warp runs the row sums' chain over the 16 key blocks in order (as one lane of the 128-row
// kernel does), and warp w accumulates o for dims 32 w .. 32 w + 31 over all 128 keys (each
// output column's chain is its own). One warp per (sequence, kv head) took ~7 us a tile (H200:
// batch 1 at 384 keys 21.6 us, Qwen3-0.6B workload 0.78x the default mode; branch
// experiment/decode-prefill-order-1warp). Eight warps (S of 16 keys, o of 16 dims a warp; same
// bits) where the batch does not fill the SMs gained nothing and lost elsewhere (H200,
// benchmarks/prefill_ab, us, 4 / 8 warps: 1 x 1/384 8.0 / 8.0, 8 x 1/300..2047 34.4 / 35.6, 64 x
// 1/1000 66.0 / 81.2, 256 x 1/1000 243.4 / 306.6; branch experiment/decode-prefill-order-8warps).
//
// Loads: each warp streams its own units of 4 KiB through a ring of kSlots: per tile its two K
// sub-tiles (16 keys x 256 B, swizzled) and two V halves (64 keys x its 64 B of dims), by 16-byte
// cp.async with the block ids read a window ahead. Keys past the sequence are zero-filled (their P
// is 0) and masked as prefill masks keys past a row's position.
//
// A sequence longer than kDecodeInvariantSplitKeys is not this kernel's: the mode's split kernel
// (decode.cu) writes it, and this one returns, decided on the device (CUDA graphs replay one
// launch over changing lengths).
#include "prefill_common.cuh"
#include "qwen3_kernels/launch.cuh"  // pdl_wait, pdl_launch_dependents, LaunchConfig, launch_ex
#include "qwen3_kernels/launchers.h"

namespace qwen3_kernels {
namespace prefill {
namespace {

constexpr int kTileKeys = 128;                  // the prefill kernels' key tile (softmax step)
constexpr int kWarps = 4;
constexpr int kKeysPerWarp = kTileKeys / kWarps;  // S columns of a warp: 2 K sub-tiles of 16
constexpr int kDimsPerWarp = kHeadDim / kWarps;   // o columns of a warp: 4 n8 tiles
constexpr int kRowBytes = kHeadDim * 2;           // 16-bit rows
constexpr int kUnitBytes = 4096;                  // a K sub-tile [16][256 B] or a V half [64][64 B]
constexpr int kUnitsPerTile = 4;                  // per warp: K0, K1, V0, V1
constexpr int kSlots = 6;                         // ring depth per warp: 5 units in flight
// Shared memory: the rings, then the exchange: row maxima [kWarps][16], pair sums [16 blocks][2
// rows][32 lanes], P fragments [8 k16 steps][32 lanes] (uint4).
constexpr int kRingBytes = kWarps * kSlots * kUnitBytes;
constexpr int kMaxBytes = kWarps * 16 * 4;
constexpr int kSumBytes = (kTileKeys / 8) * 2 * 32 * 4;
constexpr int kPBytes = (kTileKeys / 16) * 32 * 16;
constexpr int kSmemBytes = kRingBytes + kMaxBytes + kSumBytes + kPBytes;

// Byte offset of 16-byte chunk `chunk` of row `row` in a swizzled K sub-tile [16][256 B]: ldmatrix
// of 8 rows at one logical chunk hits 8 distinct bank groups.
__device__ __forceinline__ uint32_t k_swizzle(int row, int chunk) {
  return static_cast<uint32_t>(row * kRowBytes + ((chunk ^ (row & 7)) << 4));
}
// ... and in a V half [64][64 B] (4 chunks a row; rows 2r and 2r + 1 share a 128-byte line).
__device__ __forceinline__ uint32_t v_swizzle(int row, int chunk) {
  return static_cast<uint32_t>(row * 64 + ((chunk ^ ((row >> 1) & 3)) << 4));
}

// grid (Hkv, B), kWarps warps. p: q / out [B, Hq, D] (token b of the batch is sequence b's query),
// seq_lens_k [B] the sequences' lengths (clamped to [0, ctx_cap]), cu_seqlens_q unused.
template <typename T>
__global__ void __launch_bounds__(kWarps * 32) decode_prefill_order_kernel(const PrefillParams p,
                                                                           int ctx_cap) {
  extern __shared__ __align__(128) uint8_t smem[];
  pdl_wait();  // before any read: the previous kernel wrote q and the cache
  pdl_launch_dependents();
  const int kv_head = blockIdx.x;
  const int b = blockIdx.y;
  const int len = max(0, min(p.seq_lens_k[b], ctx_cap));
  if (len > kDecodeInvariantSplitKeys) return;  // the split kernel's (decode.cu)
  const int group = p.group;                    // <= 16 (invariant_prefill_order)
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
  const int g = lane >> 2, t4 = lane & 3;       // mma fragment coordinates

  // Q as mma A fragments (8 k16 steps over D): row r is q head kv_head * group + r; rows past
  // the group are zero.
  const T* q = static_cast<const T*>(p.q) +
               ((int64_t)b * p.num_q_heads + (int64_t)kv_head * group) * kHeadDim;
  uint32_t qa[kHeadDim / 16][4];
#pragma unroll
  for (int kk = 0; kk < kHeadDim / 16; ++kk) {
#pragma unroll
    for (int r = 0; r < 4; ++r) {
      const int row = g + (r & 1) * 8;
      const int col = kk * 16 + (r >> 1) * 8 + 2 * t4;
      qa[kk][r] = row < group ? *reinterpret_cast<const uint32_t*>(q + row * kHeadDim + col) : 0u;
    }
  }

  const int n_tiles = (len + kTileKeys - 1) / kTileKeys;
  const int n_units = n_tiles * kUnitsPerTile;
  const int32_t* table = p.block_tables + (int64_t)b * p.max_blocks;
  const int block_mask = (1 << p.block_size_log2) - 1;
  const int64_t slot_stride = (int64_t)p.num_kv_heads * kHeadDim;  // elements between slots
  const T* k_head = static_cast<const T*>(p.k_cache) + kv_head * kHeadDim;
  const T* v_head = static_cast<const T*>(p.v_cache) + kv_head * kHeadDim + warp * kDimsPerWarp;
  uint8_t* ring = smem + warp * kSlots * kUnitBytes;
  float* red_max = reinterpret_cast<float*>(smem + kRingBytes);     // [kWarps][16]
  float* pair_sums = red_max + kWarps * 16;                          // [16][2][32]
  uint4* p_frags = reinterpret_cast<uint4*>(pair_sums + (kTileKeys / 8) * 2 * 32);  // [8][32]

  // Block ids by windows of 32 sub-tiles of 16 keys: lane l holds the block of sub-tile win + l
  // (a sub-tile lies in one block: blocks hold 16 .. 256 keys), and the next window is loaded as
  // soon as the current one is entered, so no copy waits on a block-table read. The index is
  // clamped to the table (entries past the sequence are never used). Units are issued tile by
  // tile, and a tile never spreads over two windows.
  auto load_window = [&](int first) -> int {
    return __ldg(table + min(((first + lane) * 16) >> p.block_size_log2, p.max_blocks - 1));
  };
  int win = 0;
  int win_blocks = load_window(0), next_blocks = load_window(32);
  // Unit u of this warp: tile u / 4; K sub-tile 2 warp + u % 4 (u % 4 < 2), else V half u % 4 - 2.
  auto issue = [&](int u) {
    const int tile = u / kUnitsPerTile, kind = u % kUnitsPerTile;
    if (tile * (kTileKeys / 16) >= win + 32) {  // warp-uniform
      win += 32;
      win_blocks = next_blocks;
      next_blocks = load_window(win + 32);
    }
    const uint32_t dst = smem_addr(ring + (u % kSlots) * kUnitBytes);
    if (kind < 2) {  // K: 16 keys x 16 chunks; lane copies chunk lane % 16 of rows lane / 16 + 2 i
      const int sub = tile * (kTileKeys / 16) + 2 * warp + kind;
      const int key0 = sub * 16;
      const int64_t block = __shfl_sync(0xffffffffu, win_blocks, sub - win);
      const T* src = k_head + ((block << p.block_size_log2) + (key0 & block_mask)) * slot_stride +
                     (lane & 15) * 8;
#pragma unroll
      for (int i = 0; i < 8; ++i) {
        const int row = (lane >> 4) + 2 * i;
        const bool valid = key0 + row < len;
        cp_async_16(dst + k_swizzle(row, lane & 15), valid ? src + row * slot_stride : k_head,
                    valid);
      }
    } else {  // V: 64 keys x this warp's 4 chunks; chunk lane % 4 of rows lane / 4 + 8 i
      const int key_base = tile * kTileKeys + (kind - 2) * 64;
#pragma unroll
      for (int i = 0; i < 8; ++i) {
        const int row = (lane >> 2) + 8 * i;
        const int key = key_base + row;
        const int64_t block = __shfl_sync(0xffffffffu, win_blocks, (key >> 4) - win);
        const bool valid = key < len;
        const T* src = v_head + ((block << p.block_size_log2) + (key & block_mask)) * slot_stride +
                       (lane & 3) * 8;
        cp_async_16(dst + v_swizzle(row, lane & 3), valid ? src : v_head, valid);
      }
    }
  };
#pragma unroll
  for (int u = 0; u < kSlots - 1; ++u) {
    if (u < n_units) issue(u);
    cp_async_commit();  // empty groups keep the wait count uniform
  }
  // Waits for unit u, then refills the slot unit u - 1 used (every lane is past its reads).
  auto land = [&](int u) -> uint32_t {
    cp_async_wait<kSlots - 2>();
    __syncwarp();
    if (u + kSlots - 1 < n_units) issue(u + kSlots - 1);
    cp_async_commit();
    return smem_addr(ring + (u % kSlots) * kUnitBytes);
  };

  const int pos = len - 1;             // every row is the query at the sequence's last position
  const int n_full = len / kTileKeys;  // tiles below it are visible to the query whole
  float o[kDimsPerWarp / 8][4];        // dims 32 warp + 8 j + 2 t4 (+1), rows g and g + 8
#pragma unroll
  for (int j = 0; j < kDimsPerWarp / 8; ++j) o[j][0] = o[j][1] = o[j][2] = o[j][3] = 0.f;
  float row_max[2] = {-INFINITY, -INFINITY};  // raw score maxima, as softmax_step keeps them
  float row_sum[2] = {0.f, 0.f};              // this lane's part, as softmax_step keeps it

  for (int n = 0; n < n_tiles; ++n) {
    // S = Q K^T for this warp's 32 keys (n8 tiles 4 warp .. 4 warp + 3 of the tile), from -0.
    float s[kKeysPerWarp / 8][4];
#pragma unroll
    for (int j = 0; j < kKeysPerWarp / 8; ++j) s[j][0] = s[j][1] = s[j][2] = s[j][3] = -0.f;
#pragma unroll
    for (int c = 0; c < 2; ++c) {
      const uint32_t ks = land(n * kUnitsPerTile + c);
      // Matrices: keys 0-7 | d lo, keys 0-7 | d hi, keys 8-15 | d lo, keys 8-15 | d hi.
      const int key = (lane & 7) + ((lane >> 4) << 3);
      const int hi = (lane >> 3) & 1;
#pragma unroll
      for (int kk = 0; kk < kHeadDim / 16; ++kk) {
        uint32_t kf[4];
        ldmatrix_x4(kf, ks + k_swizzle(key, 2 * kk + hi));
        mma_16816<T>(s[2 * c], qa[kk], kf[0], kf[1]);
        mma_16816<T>(s[2 * c + 1], qa[kk], kf[2], kf[3]);
      }
    }
    // softmax_step's arithmetic (prefill_common.cuh), its sums and maxima shared by the warps.
    const int key0 = n * kTileKeys + warp * kKeysPerWarp;
    if (n >= n_full) {
#pragma unroll
      for (int j = 0; j < kKeysPerWarp / 8; ++j)
#pragma unroll
        for (int e = 0; e < 4; ++e)
          if (key0 + j * 8 + 2 * t4 + (e & 1) > pos) s[j][e] = -INFINITY;
    }
    float mx[2];
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      float m = -INFINITY;
#pragma unroll
      for (int j = 0; j < kKeysPerWarp / 8; ++j)
        m = fmaxf(m, fmaxf(s[j][2 * h], s[j][2 * h + 1]));
      m = fmaxf(m, __shfl_xor_sync(0xffffffffu, m, 1));
      m = fmaxf(m, __shfl_xor_sync(0xffffffffu, m, 2));
      mx[h] = m;
    }
    if (t4 == 0) {
      red_max[warp * 16 + g] = mx[0];
      red_max[warp * 16 + g + 8] = mx[1];
    }
    __syncthreads();  // every warp's maxima are in (and the last tile's P reads are done)
    float alpha[2], m_scaled[2];
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      float m = row_max[h];
#pragma unroll
      for (int w = 0; w < kWarps; ++w) m = fmaxf(m, red_max[w * 16 + g + 8 * h]);
      m_scaled[h] = m == -INFINITY ? 0.f : __fmul_rn(m, p.scale_log2);
      alpha[h] = m == row_max[h] ? 1.f : fast_exp2(fmaf(row_max[h], p.scale_log2, -m_scaled[h]));
      row_max[h] = m;
    }
    // This warp's P (k16 steps 2 warp, 2 warp + 1) and pair sums into shared memory.
#pragma unroll
    for (int j = 0; j < kKeysPerWarp / 8; ++j) {
#pragma unroll
      for (int e = 0; e < 4; ++e)
        s[j][e] = fast_exp2(fmaf(s[j][e], p.scale_log2, -m_scaled[e >> 1]));
#pragma unroll
      for (int h = 0; h < 2; ++h)
        pair_sums[((warp * 4 + j) * 2 + h) * 32 + lane] = __fadd_rn(s[j][2 * h], s[j][2 * h + 1]);
    }
#pragma unroll
    for (int c = 0; c < 2; ++c)
      p_frags[(2 * warp + c) * 32 + lane] =
          make_uint4(pack2<T>(s[2 * c][0], s[2 * c][1]), pack2<T>(s[2 * c][2], s[2 * c][3]),
                     pack2<T>(s[2 * c + 1][0], s[2 * c + 1][1]),
                     pack2<T>(s[2 * c + 1][2], s[2 * c + 1][3]));
    __syncthreads();  // P and the pair sums of all 128 keys are in (and the maxima were read)
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      row_sum[h] = __fmul_rn(row_sum[h], alpha[h]);
#pragma unroll
      for (int j = 0; j < kTileKeys / 8; ++j)
        row_sum[h] = __fadd_rn(row_sum[h], pair_sums[(j * 2 + h) * 32 + lane]);
    }
    uint4 pa[kTileKeys / 16];
#pragma unroll
    for (int kk = 0; kk < kTileKeys / 16; ++kk) pa[kk] = p_frags[kk * 32 + lane];
#pragma unroll
    for (int j = 0; j < kDimsPerWarp / 8; ++j) {
      o[j][0] *= alpha[0];
      o[j][1] *= alpha[0];
      o[j][2] *= alpha[1];
      o[j][3] *= alpha[1];
    }
    // O += P V over the 8 k16 steps of keys in order: V half c holds steps 4 c .. 4 c + 3.
#pragma unroll
    for (int c = 0; c < 2; ++c) {
      const uint32_t vs = land(n * kUnitsPerTile + 2 + c);
      // Matrices: keys 0-7 | d lo, keys 8-15 | d lo, keys 0-7 | d hi, keys 8-15 | d hi.
      const int key = (lane & 7) + (((lane >> 3) & 1) << 3);
      const int hi = lane >> 4;
#pragma unroll
      for (int kq = 0; kq < 4; ++kq) {
        const uint4 pv = pa[4 * c + kq];
        const uint32_t a[4] = {pv.x, pv.y, pv.z, pv.w};
#pragma unroll
        for (int dn = 0; dn < kDimsPerWarp / 16; ++dn) {
          uint32_t vf[4];
          ldmatrix_x4_trans(vf, vs + v_swizzle(kq * 16 + key, 2 * dn + hi));
          mma_16816<T>(o[2 * dn], a, vf[0], vf[1]);
          mma_16816<T>(o[2 * dn + 1], a, vf[2], vf[3]);
        }
      }
    }
  }
  cp_async_wait<0>();

  // Normalise as the prefill kernels do (a sequence of no key writes 0).
  float inv[2];
  inverse_row_sums(row_sum, inv);
  T* out = static_cast<T*>(p.out) +
           ((int64_t)b * p.num_q_heads + (int64_t)kv_head * group) * kHeadDim +
           warp * kDimsPerWarp + 2 * t4;
#pragma unroll
  for (int h = 0; h < 2; ++h) {
    const int row = g + 8 * h;
    if (row < group) {
#pragma unroll
      for (int j = 0; j < kDimsPerWarp / 8; ++j)
        *reinterpret_cast<uint32_t*>(out + row * kHeadDim + 8 * j) =
            pack2<T>(o[j][2 * h] * inv[h], o[j][2 * h + 1] * inv[h]);
    }
  }
}

}  // namespace

cudaError_t launch_decode_prefill_order(const PrefillParams& p, int batch, int ctx_cap,
                                        DType dtype, cudaStream_t stream) {
  if (p.group > 16 || batch > 65535 || p.num_kv_heads > 65535) return cudaErrorInvalidValue;
  if (batch == 0) return cudaSuccess;
  const DeviceInfo d = current_device_info();
  const bool pdl = d.cc_major >= 9;
  constexpr int kSmem = kSmemBytes;
  return QWEN3_DISPATCH_HALF(dtype, T, [&] {
    cudaError_t err = cudaFuncSetAttribute(decode_prefill_order_kernel<T>,
                                           cudaFuncAttributeMaxDynamicSharedMemorySize, kSmem);
    if (err != cudaSuccess) return err;
    return launch_ex(
        decode_prefill_order_kernel<T>,
        LaunchConfig(dim3(p.num_kv_heads, batch), dim3(kWarps * 32), kSmem, stream, pdl, 1), p,
        ctx_cap);
  });
}

}  // namespace prefill
}  // namespace qwen3_kernels
