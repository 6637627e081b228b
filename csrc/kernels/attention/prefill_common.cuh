// Shared by the paged_attention_prefill kernels (prefill.cu: mma.sync, sm_80+; prefill_sm90_ws.cu:
// wgmma, sm_90a): the kernel parameters and the head_dim (PTX wrappers: qwen3_kernels/mma.cuh).
#pragma once

#include "qwen3_kernels/common.cuh"
#include "qwen3_kernels/mma.cuh"

namespace qwen3_kernels {
namespace prefill {

constexpr int kHeadDim = 128;

struct PrefillParams {
  void* out;                    // [Tq, Hq, D]
  const void* q;                // [Tq, Hq, D]
  const void* k_cache;          // [num_blocks, block_size, Hkv, D]
  const void* v_cache;          // [num_blocks, block_size, Hkv, D]
  const int32_t* cu_seqlens_q;  // [B + 1]
  const int32_t* seq_lens_k;    // [B]
  const int32_t* block_tables;  // [B, max_blocks]
  int num_q_heads;
  int num_kv_heads;
  int group;                    // num_q_heads / num_kv_heads
  int block_size_log2;          // block_size is a power of two (16..256)
  int max_blocks;
  float scale_log2;             // softmax scale * k_scale * log2(e): scores go straight into exp2
  float v_scale;                // the output's factor (1 but for an fp8 cache)
  int32_t* tile_counter;        // [1] scratch: the sm_90 persistent grid's work counter (the
                                // launch zeroes it on the stream)
};

// ---- PTX wrappers -----------------------------------------------------------------------------

__device__ __forceinline__ float fast_exp2(float x) {
  float y;
  asm("ex2.approx.ftz.f32 %0, %1;\n" : "=f"(y) : "f"(x));
  return y;
}

// ---- the kernels' shared steps (inlined: the same instructions as when written out in place) ----

// Issues the cp.async copies of a Q tile: packed rows row0 .. row0 + kTileRows - 1 (rows past
// `rows` are zero-filled). This thread copies 16-byte chunk ld_chunk of tile rows ld_row +
// kRowsPerPass i, to s_q + dst_offset(r) for tile row r (each kernel has its own swizzle).
// kUnroll: unroll factor of the loop over the kTileRows / kRowsPerPass rows.
template <typename T, int kTileRows, int kRowsPerPass, int kUnroll, typename DstOffset>
__device__ __forceinline__ void load_q_tile(const PrefillParams& p, uint32_t s_q, int q_start,
                                            int kv_head, int group, int row0, int rows,
                                            int ld_row, int ld_chunk, DstOffset dst_offset) {
  const T* q = static_cast<const T*>(p.q);
#pragma unroll kUnroll
  for (int i = 0; i < kTileRows / kRowsPerPass; ++i) {
    const int r = ld_row + i * kRowsPerPass;
    const int pr = row0 + r;
    const bool valid = pr < rows;
    const int token = pr / group;
    const int head = kv_head * group + (pr - token * group);
    const T* src = valid ? q + ((int64_t)(q_start + token) * p.num_q_heads + head) * kHeadDim +
                               ld_chunk * 8
                         : q;
    cp_async_16(s_q + dst_offset(r), src, valid);
  }
}

// Copies 16-byte chunk `chunk` of a staged output row (at staged(), in shared memory) to packed row
// pr of out: the last step of the kernels that stage their output tile in shared memory.
template <typename T, typename Staged>
__device__ __forceinline__ void store_out_chunk(const PrefillParams& p, T* out, int q_start,
                                                int kv_head, int group, int pr, int chunk,
                                                Staged staged) {
  const int token = pr / group;
  const int head = kv_head * group + (pr - token * group);
  *reinterpret_cast<uint4*>(out + ((int64_t)(q_start + token) * p.num_q_heads + head) * kHeadDim +
                            chunk * 8) = *reinterpret_cast<const uint4*>(staged());
}

// One online-softmax step over key tile n (kTiles * 8 keys from n * kTiles * 8) of this lane's two
// rows h = 0, 1 (rows g and g + 8 of its warp's 16). s: the tile's scores in the mma accumulator
// layout, s[4 j + e] = row g + 8 (e >> 1), key 8 j + 2 t4 + (e & 1); on return, P (unnormalised,
// base 2, scale folded into one FMA). Tiles from n_full on reach the diagonal: keys past a row's
// absolute position pos[h] are masked. row_max holds raw (unscaled) score maxima, row_sum this
// lane's part of the sums (the quad is summed at the end). rescale(h, alpha) is called with the
// factor for row h's accumulated output as soon as it is known.
// Every operation is spelled out (fmaf, __fmul_rn, __fadd_rn: nothing left for the compiler to
// contract or reuse), so each kernel that inlines this step computes the same bits for a row: the
// deterministic mode rests on the wgmma kernel, the mma.sync kernels and decode agreeing. Left to
// the compiler, prefill.cu computed alpha from a separate product and difference, and
// prefill_sm90_ws.cu from a product kept from the previous tile: ~1 output in 3,500 differed
// (H200, benchmarks/prefill_ab).
template <int kTiles, typename Rescale>
__device__ __forceinline__ void softmax_step(float (&s)[4 * kTiles], int n, int n_full,
                                             const int (&pos)[2], int t4, float scale_log2,
                                             float (&row_max)[2], float (&row_sum)[2],
                                             Rescale rescale) {
  constexpr int kKeys = 8 * kTiles;
  if (n >= n_full) {  // a tile on the diagonal (or past the sequence's last key)
#pragma unroll
    for (int j = 0; j < kTiles; ++j) {
#pragma unroll
      for (int e = 0; e < 4; ++e) {
        const int key = n * kKeys + j * 8 + 2 * t4 + (e & 1);
        if (key > pos[e >> 1]) s[4 * j + e] = -INFINITY;
      }
    }
  }
#pragma unroll
  for (int h = 0; h < 2; ++h) {
    float mx = row_max[h];
#pragma unroll
    for (int j = 0; j < kTiles; ++j) mx = fmaxf(mx, fmaxf(s[4 * j + 2 * h], s[4 * j + 2 * h + 1]));
    mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, 1));
    mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, 2));
    // A row that has seen only masked keys keeps max -inf; subtracting 0 instead keeps
    // exp2(-inf - (-inf)) from turning into NaN.
    const float m_scaled = mx == -INFINITY ? 0.f : __fmul_rn(mx, scale_log2);
    // An unchanged max rescales by exactly 1: computed, the FMA-contracted difference of the two
    // products is their rounding error, and exp2 of it can differ from 1 by an ulp, so a tile
    // the row sees nothing of (masked past its position: an M block's rows end at different
    // keys) would change its bits, and a query's result would depend on its chunk and batch.
    const float alpha =
        mx == row_max[h] ? 1.f : fast_exp2(fmaf(row_max[h], scale_log2, -m_scaled));
    row_max[h] = mx;
    row_sum[h] = __fmul_rn(row_sum[h], alpha);
    rescale(h, alpha);
#pragma unroll
    for (int j = 0; j < kTiles; ++j) {
      float& s0 = s[4 * j + 2 * h];
      float& s1 = s[4 * j + 2 * h + 1];
      s0 = fast_exp2(fmaf(s0, scale_log2, -m_scaled));
      s1 = fast_exp2(fmaf(s1, scale_log2, -m_scaled));
      row_sum[h] = __fadd_rn(row_sum[h], __fadd_rn(s0, s1));
    }
  }
}

// 1 / (row sum) of this lane's two rows, summed over the quad; 0 for a row that saw no key (only
// possible for invalid inputs), which then writes 0.
__device__ __forceinline__ void inverse_row_sums(const float (&row_sum)[2], float (&inv)[2]) {
#pragma unroll
  for (int h = 0; h < 2; ++h) {
    float l = row_sum[h];
    l += __shfl_xor_sync(0xffffffffu, l, 1);
    l += __shfl_xor_sync(0xffffffffu, l, 2);
    inv[h] = l > 0.f ? 1.f / l : 0.f;
  }
}

// Online softmax: scales a warpgroup's 64 x 128 output accumulator (a thread's wgmma fragment
// o[64]: rows g and g + 8 of its warp, two columns each of 16 n8 tiles) by its rows' alpha.
__device__ __forceinline__ void rescale_rows(float (&o)[64], const float (&alpha)[2]) {
#pragma unroll
  for (int j = 0; j < kHeadDim / 8; ++j) {
    o[4 * j + 0] *= alpha[0];
    o[4 * j + 1] *= alpha[0];
    o[4 * j + 2] *= alpha[1];
    o[4 * j + 3] *= alpha[1];
  }
}

// Host side of the warp-specialised wgmma kernel (prefill_sm90_ws.cu). sm90_available() is true
// when the current device runs its sm_90a code (an H100/H200 with this binary built for sm_90a);
// launch_sm90_ws() returns cudaErrorNotSupported otherwise. fp8_kv: the cache is e4m3 (k_scale
// folded into scale_log2, v_scale the output's factor). persistent: one CTA per SM walking the
// work tiles, else one CTA per work tile.
bool sm90_available();
cudaError_t launch_sm90_ws(const PrefillParams& p, int num_tokens, int batch, int max_seqlen_q,
                           DType dtype, bool fp8_kv, bool persistent, cudaStream_t stream);

// The deterministic mode's decode of the sequences of at most kDecodeInvariantSplitKeys keys, in
// these kernels' per-row order (decode_prefill_order.cu): q / out [B, Hq, D], seq_lens_k [B]
// clamped to [0, ctx_cap], cu_seqlens_q unused; group <= 16, a 16-bit cache.
cudaError_t launch_decode_prefill_order(const PrefillParams& p, int batch, int ctx_cap,
                                        DType dtype, cudaStream_t stream);

}  // namespace prefill
}  // namespace qwen3_kernels
