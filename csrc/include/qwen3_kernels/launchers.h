// Launchers of every kernel: raw pointers + a stream, no torch headers, so the kernels build as
// plain CUDA and only csrc/torch_bindings.cpp sees tensors. The checked API (qwen3_kernels/ops.py)
// validates the tensors; the binding dispatches on the dtype and calls one of these. Each returns
// the launch's cudaError_t (cudaSuccess or the first error), so the binding can raise a clear
// message.
#pragma once

#include <cstdint>
#include <cuda_runtime.h>

namespace qwen3_kernels {

enum class DType { kFloat16, kBFloat16 };

// The KV cache's elements: the model dtype (scales 1), or e4m3 with one fp32 scale per layer for K
// and one for V (reference.quantize_kv): stored = e4m3(x / scale) saturated to +-448, read back as
// e4m3 * scale. The attention kernels fold k_scale into the softmax scale and v_scale into the
// output's normalisation, so a cached element is never multiplied by its scale one by one.
struct KvCache {
  bool fp8 = false;
  float k_scale = 1.f;
  float v_scale = 1.f;
};

// ---- activation.cu ------------------------------------------------------------------------
// out[t, i] = silu(x[t, i]) * x[t, I + i]
cudaError_t silu_and_mul(void* out,            // [T, I], row stride out_stride (elements)
                         const void* x,        // [T, 2I], row stride x_stride (elements)
                         int64_t num_tokens, int64_t intermediate, int64_t out_stride,
                         int64_t x_stride, DType dtype, cudaStream_t stream);

// ---- batch invariance -------------------------------------------------------------------------
// batch_invariant (the engine's deterministic mode): each output row's sums run in an order fixed
// by its own shape, never by the batch, so the row is a function of its own inputs alone, bit for
// bit, whatever T or B is (norm.cu, decode.cu, linear.cu; prefill runs a query token as decode
// would at its position, torch_bindings.cpp).
// Decode's splits then cover this many keys each, from key 0, up to kDecodeInvariantMaxKeys keys
// (Qwen3's max_position_embeddings; the combine holds at most 64 splits).
constexpr int kDecodeInvariantSplitKeys = 2048;
constexpr int kDecodeInvariantMaxKeys = 40960;
static_assert(kDecodeInvariantMaxKeys <= 64 * kDecodeInvariantSplitKeys, "64 splits at most");
// Where this holds (a 16-bit cache, at most 16 q heads a kv head, blocks of a power of two in
// 16..256, a device running the sm_90a prefill kernel), a query with at most
// kDecodeInvariantSplitKeys keys runs in the prefill kernel's per-row order instead, in decode
// too (kernels/attention/decode_prefill_order.cu): prefill then runs at its default speed.
bool invariant_prefill_order(bool fp8_kv, int num_q_heads, int num_kv_heads, int block_size);

// ---- norm.cu --------------------------------------------------------------------------------
// out = x * rsqrt(mean(x^2) + eps) * weight, per row
cudaError_t rms_norm(void* out,               // [T, H], row stride out_stride
                     const void* x,           // [T, H], row stride x_stride
                     const void* weight,      // [H]
                     int64_t num_tokens, int64_t hidden, int64_t out_stride, int64_t x_stride,
                     float eps, bool batch_invariant, DType dtype, cudaStream_t stream);

// residual = x + residual; x = rms_norm(residual) (in place, both)
cudaError_t fused_add_rms_norm(void* x,          // [T, H], row stride x_stride
                               void* residual,   // [T, H], row stride residual_stride
                               const void* weight,  // [H]
                               int64_t num_tokens, int64_t hidden, int64_t x_stride,
                               int64_t residual_stride, float eps, bool batch_invariant,
                               DType dtype, cudaStream_t stream);

// ---- qk_norm_rope.cu --------------------------------------------------------------------------
// Per-head RMSNorm of q and k heads, neox RoPE, K/V written to the paged cache. head_dim == 128.
cudaError_t qk_norm_rope(void* q_out,                 // [T, Hq, D] contiguous
                         const void* qkv,             // [T, (Hq + 2*Hkv) * D], row stride qkv_stride
                         const void* q_norm_weight,   // [D]
                         const void* k_norm_weight,   // [D]
                         const float* cos_sin_cache,  // [max_position, D]: cos | sin halves
                         const int64_t* positions,    // [T]
                         void* k_cache,               // [num_blocks, block_size, Hkv, D]
                         void* v_cache,               // [num_blocks, block_size, Hkv, D]
                         const int32_t* slot_mapping, // [T], -1 = skip
                         int64_t num_slots,           // num_blocks * block_size: a slot outside
                                                      // [0, num_slots) is not written
                         int64_t num_tokens, int64_t qkv_stride, int num_q_heads,
                         int num_kv_heads, int head_dim, float eps, DType dtype, KvCache kv,
                         cudaStream_t stream);

// ---- attention/ -------------------------------------------------------------------------------
// Decode: one query token per sequence; split-KV with a combine pass when B * Hkv is small.
cudaError_t paged_attention_decode(void* out,                    // [B, Hq, D]
                                   const void* q,                // [B, Hq, D]
                                   const void* k_cache,          // [num_blocks, block_size, Hkv, D]
                                   const void* v_cache,          // [num_blocks, block_size, Hkv, D]
                                   const int32_t* block_tables,  // [B, max_blocks]
                                   const int32_t* seq_lens,      // [B]
                                   float* workspace,             // [B, Hq, max_splits, D + 1]
                                   int batch, int num_q_heads, int num_kv_heads, int head_dim,
                                   int block_size, int max_blocks, int max_splits, float scale,
                                   int num_sms, bool batch_invariant, DType dtype, KvCache kv,
                                   cudaStream_t stream,
                                   // batch_invariant only: CTA c reads the K/V once for the
                                   // cta_count[c] consecutive rows from cta_first[c] (-1: none),
                                   // which share one sequence and hold at most 16 q heads; a row's
                                   // result is the same as when it runs alone
                                   const int32_t* cta_first = nullptr,  // [cta_groups]
                                   const int32_t* cta_count = nullptr,  // [cta_groups]
                                   int cta_groups = 0);

// Prefill: varlen causal, queries aligned to the end of each key sequence. tile_counter: one int32
// of device memory the call overwrites (the sm_90 kernel's persistent grid zeroes it on the stream
// and its CTAs take their work tiles from it); a call that may run concurrently with another on
// a different stream needs its own.
cudaError_t paged_attention_prefill(void* out,                    // [Tq, Hq, D]
                                    const void* q,                // [Tq, Hq, D]
                                    const void* k_cache,          // [num_blocks, block_size, Hkv, D]
                                    const void* v_cache,          // [num_blocks, block_size, Hkv, D]
                                    const int32_t* cu_seqlens_q,  // [B + 1]
                                    const int32_t* seq_lens_k,    // [B]
                                    const int32_t* block_tables,  // [B, max_blocks]
                                    int num_tokens,               // Tq
                                    int batch, int max_seqlen_q, int num_q_heads,
                                    int num_kv_heads, int head_dim, int block_size,
                                    int max_blocks, float scale, DType dtype, KvCache kv,
                                    int32_t* tile_counter,        // [1] scratch (see above)
                                    cudaStream_t stream);

// ---- gemm/ ------------------------------------------------------------------------------------
// out[M, N] = x[M, K] @ w[N, K]^T (all row-major, contiguous, 16-byte aligned; N, K % 8 == 0).
// The kernel is chosen from the shape in kernels/gemm/linear.cu (the GEMV at M = 1, the measured
// table on the Qwen3 QKV shapes, cuBLAS elsewhere and on any GPU but sm_90).
// Whether that choice is cuBLAS: the caller then runs cuBLAS itself; linear() would return
// cudaErrorNotSupported.
// batch_invariant: CUTLASS tiles without K splits, which all give the same bits, picked by shape
// (sm_90 only: elsewhere linear() returns cudaErrorNotSupported and linear_prefers_cublas false).
bool linear_prefers_cublas(int64_t m, int64_t n, int64_t k, bool batch_invariant);
// Bytes of workspace the chosen configuration needs (0 for many; stream-K partials otherwise).
size_t linear_workspace_size(int64_t m, int64_t n, int64_t k, bool batch_invariant, DType dtype);
cudaError_t linear(void* out,        // [M, N]
                   const void* x,    // [M, K]
                   const void* w,    // [N, K]
                   int64_t m, int64_t n, int64_t k,
                   void* workspace,  // linear_workspace_size(m, n, k, ...) bytes, any content
                   size_t workspace_bytes, bool batch_invariant, DType dtype,
                   cudaStream_t stream);

// out[1, I] = silu(g) * u where [g | u] = x[1, K] @ w[2I, K]^T, each rounded to the dtype (the
// MLP's gate_up projection and its activation at one token in one pass over the weight, nothing
// [1, 2I] written). The weight-streaming GEMV (kernels/gemm/linear_gemv.cu): M == 1, contiguous
// 16-byte aligned operands, 2I and K multiples of 8, sm_80+; cudaErrorNotSupported otherwise (the
// caller then runs the GEMM and silu_and_mul).
cudaError_t linear_silu_and_mul(void* out,      // [1, I]
                                const void* x,  // [1, K]
                                const void* w,  // [2I, K]: gate rows, then up rows
                                int64_t m, int64_t two_i, int64_t k, DType dtype,
                                cudaStream_t stream);

// The GEMV at one token that also sends its output row to the tensor-parallel peers (a
// row-parallel projection before the all-reduce): out = x @ w^T, and out's row, as LL packets,
// into slot `rank` of every peer's tp_all_reduce receive buffer for the all-reduce's next call,
// which must then run with pushed = true (it no longer sends this rank's row itself).
// cudaErrorInvalidValue when the sizes do not fit (world 2..8, n * 4 <= slot_bytes);
// cudaErrorNotSupported where the GEMV cannot run (N, K % 8, dtype).
cudaError_t tp_gemv_push(void* out,                  // [1, N]
                         const void* x,              // [1, K]
                         const void* w,              // [N, K]
                         int64_t n, int64_t k,
                         const int64_t* peer_ptrs,   // [world] device: every rank's receive buffer
                         const uint32_t* counters,   // [2] device: the all-reduce's call count
                         int64_t slot_bytes, int world, int rank, DType dtype,
                         cudaStream_t stream);

// ---- gemm/*fp8* : FP8 (e4m3) block-scaled projections (Qwen3-*-FP8 checkpoints) --------------
// Weights float8_e4m3fn [N, K] with fp32 weight_scale_inv [ceil(N/128), ceil(K/128)] (value =
// weight * scale of its 128 x 128 block); activations quantized per token per 128-wide group of K
// (reference.quantize_fp8: scale = max(|group|, 1e-10) / 448). Hopper (sm_90) only:
// cudaErrorNotSupported elsewhere (the Python wrapper then runs the reference).

// x [T, K] (row stride x_stride) -> out [T, K] e4m3 (contiguous) and x_scales[t, g] at
// x_scales + t * scale_stride_t + g * scale_stride_g (any layout; the GEMM reads token-contiguous).
cudaError_t quantize_fp8(void* out, float* x_scales, const void* x, int64_t t, int64_t k,
                         int64_t x_stride, int64_t scale_stride_t, int64_t scale_stride_g,
                         DType dtype, cudaStream_t stream);

// out[M, N] = quantize_fp8(x)[M, K] @ dequant(w)[N, K]^T, rounded to bf16 (kernels/gemm/
// linear_fp8.cu picks the kernel: the FP8 GEMV at M == 1, which quantizes x itself; above,
// quantize_fp8 into the workspace and the CUTLASS block-scaled GEMM). x, out contiguous bf16;
// K % 16 == 0, N % 8 == 0; pointers 16-byte aligned.
size_t linear_fp8_workspace_size(int64_t m, int64_t n, int64_t k);
cudaError_t linear_fp8(void* out,                      // [M, N] bf16
                       const void* x,                  // [M, K] bf16
                       const void* w,                  // [N, K] e4m3
                       const float* weight_scale_inv,  // [ceil(N/128), ceil(K/128)]
                       int64_t m, int64_t n, int64_t k,
                       void* workspace,  // linear_fp8_workspace_size(m, n, k) bytes, any content
                       size_t workspace_bytes, cudaStream_t stream);

// out[1, I] = silu_and_mul(linear_fp8(x, w)) at one token in one pass of the FP8 GEMV (w is the
// gate rows, then the up rows; each product rounded to bf16 before the activation, as the
// unfused pair). x, out bf16; K % 16 == 0, 2I % 16 == 0; x, w 16-byte aligned. Above one token
// the caller runs linear_fp8 and silu_and_mul.
cudaError_t linear_fp8_silu_and_mul(void* out,                      // [1, I] bf16
                                    const void* x,                  // [1, K] bf16
                                    const void* w,                  // [2I, K] e4m3
                                    const float* weight_scale_inv,  // [ceil(2I/128), ceil(K/128)]
                                    int64_t two_i, int64_t k, cudaStream_t stream);

// The same with x already quantized (xq e4m3 [M, K], x_scales token-contiguous: scale (t, g) at
// x_scales[g * scale_stride + t], scale_stride >= M and a multiple of 4): the weight-streaming pass
// up to a few tokens (linear_fp8.cu), the CUTLASS GEMM above.
size_t linear_fp8_quantized_workspace_size(int64_t m, int64_t n, int64_t k);
cudaError_t linear_fp8_quantized(void* out,                      // [M, N] bf16
                                 const void* xq,                 // [M, K] e4m3
                                 const float* x_scales,          // [ceil(K/128), scale_stride]
                                 int64_t scale_stride,
                                 const void* w,                  // [N, K] e4m3
                                 const float* weight_scale_inv,  // [ceil(N/128), ceil(K/128)]
                                 int64_t m, int64_t n, int64_t k,
                                 void* workspace,  // linear_fp8_quantized_workspace_size bytes
                                 size_t workspace_bytes, cudaStream_t stream);

// The producers of a quantized x (the FP8 projections' input in one pass, quantize_fp8's values bit
// for bit): rms_norm_fp8 = quantize_fp8(rms_norm(x)); fused_add_rms_norm_fp8: residual += x (x is
// left as it is) and out = quantize_fp8(rms_norm(residual)) (norm.cu; H % 128 == 0, 16-byte
// aligned rows); silu_and_mul_fp8 = quantize_fp8(silu_and_mul(x)) (gemm/quantize_fp8.cu; x
// [T, 2I], I % 16 == 0). out [T, H] e4m3 contiguous; x_scales[t, g] at x_scales + t *
// scale_stride_t + g * scale_stride_g.
cudaError_t rms_norm_fp8(void* out, float* x_scales, const void* x, const void* weight,
                         int64_t num_tokens, int64_t hidden, int64_t x_stride,
                         int64_t scale_stride_t, int64_t scale_stride_g, float eps, DType dtype,
                         cudaStream_t stream);
cudaError_t fused_add_rms_norm_fp8(void* out, float* x_scales, const void* x, void* residual,
                                   const void* weight, int64_t num_tokens, int64_t hidden,
                                   int64_t x_stride, int64_t residual_stride,
                                   int64_t scale_stride_t, int64_t scale_stride_g, float eps,
                                   DType dtype, cudaStream_t stream);
cudaError_t silu_and_mul_fp8(void* out, float* x_scales, const void* x, int64_t num_tokens,
                             int64_t intermediate, int64_t x_stride, int64_t scale_stride_t,
                             int64_t scale_stride_g, DType dtype, cudaStream_t stream);

// ---- custom_all_reduce.cu --------------------------------------------------------------------
// One-shot tensor-parallel all-reduce over peer (NVLink) memory: s = sum over ranks of x in rank
// order (fp32, rounded to the dtype); add_rms_norm: residual += s, x = rms_norm(residual) * weight,
// else x = s. Every rank calls it in the same sequence (the call count lives in counters).
// cudaErrorInvalidValue when the sizes do not fit (world 2..8, H % 8 == 0, H <= 32768,
// num_tokens * H * 4 <= slot_bytes, slot_bytes % 32 == 0).
cudaError_t tp_all_reduce(void* x,                   // [T, H] contiguous, 16-byte aligned; in place
                          void* residual,            // [T, H] contiguous (add_rms_norm; else unused)
                          const void* weight,        // [H] (add_rms_norm; else unused)
                          const int64_t* peer_ptrs,  // [world] device: every rank's receive buffer
                          uint32_t* counters,        // [2] device, zeroed at setup: call count, CTAs done
                          const int32_t* abort_flag, // [1] mapped pinned host memory (device
                                                     // address): != 0 = a peer is gone, stop waiting
                          int64_t num_tokens, int64_t hidden,
                          int64_t slot_bytes,        // bytes of one (half, rank) slot of a buffer
                          int world, int rank, bool add_rms_norm, float eps, DType dtype,
                          cudaStream_t stream,
                          bool pushed = false);      // x's rows were sent by tp_gemv_push (T = 1)

// ---- sample.cu --------------------------------------------------------------------------------
// out[r] = argmax_i score[r, i] (ties: lowest i), score = logits / T - log(E), E ~ Exp(1) from the
// counter hash of (seed_keys[r], i) for T > 0, and score = logits for T <= 0 (greedy).
enum class LogitsDType { kFloat16, kBFloat16, kFloat32 };
constexpr int kMaxSampleSplits = 32;

// CTAs per row: enough to cover the SMs twice over at small batch, chunks of >= 4096 logits
inline int sample_tokens_splits(int64_t num_rows, int64_t vocab, int num_sms) {
  int64_t s = num_rows > 0 ? (2 * static_cast<int64_t>(num_sms) + num_rows - 1) / num_rows : 1;
  if (s > vocab / 4096) s = vocab / 4096;
  if (s > kMaxSampleSplits) s = kMaxSampleSplits;
  return s < 1 ? 1 : static_cast<int>(s);
}

cudaError_t sample_tokens(int64_t* out,                // [N]
                          const void* logits,          // [N, V], row stride logits_stride
                          const float* temperatures,   // [N]; <= 0: greedy
                          const int64_t* seed_keys,    // [N, 3]: seed lo, seed hi, counter
                          float* workspace,            // [2 * N * splits] (splits > 1)
                          int64_t num_rows, int64_t vocab, int64_t logits_stride, int splits,
                          LogitsDType dtype, cudaStream_t stream);

}  // namespace qwen3_kernels

