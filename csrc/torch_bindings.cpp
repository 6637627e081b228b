// The CUDA implementations of the torch.ops.qwen3_kernels schemas, which qwen3_kernels/ops.py
// defines (the one copy of each schema). Each host wrapper: device guard -> current stream ->
// launcher (kernels/, raw pointers) with the dtype it dispatches on -> launch check. No tensor
// checks: the checked API is qwen3_kernels.<op> (ops.py), and a raw torch.ops.qwen3_kernels.*
// call is an unchecked launch, as vLLM's _C ops are (ops.py's docstring says why).
// c10/cuda only (not ATen/cuda/CUDAContext.h, which pulls cuBLAS / cuSPARSE headers), so this file
// also syntax-checks on a machine without them (tests/test_build.py).
#include <algorithm>

#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#include <torch/extension.h>
#include <torch/library.h>

#include "qwen3_kernels/launchers.h"

namespace {

using qwen3_kernels::DType;

// The 16-bit dtype the kernels run; a clear error for any other (the wrappers run the reference
// for fp32 before they get here).
DType half_dtype(const at::Tensor& t, const char* op) {
  if (t.scalar_type() == at::kHalf) return DType::kFloat16;
  if (t.scalar_type() == at::kBFloat16) return DType::kBFloat16;
  TORCH_CHECK(false, "qwen3_kernels.", op, ": the CUDA kernel runs float16 or bfloat16, got ",
              c10::toString(t.scalar_type()));
}

// The KV cache's element type and scales: an e4m3 cache carries its per-layer scales; a cache in
// the model dtype has scales 1 (ops.py refuses any other).
qwen3_kernels::KvCache kv_cache(const at::Tensor& k_cache, double k_scale, double v_scale) {
  qwen3_kernels::KvCache kv;
  kv.fp8 = k_cache.scalar_type() == at::kFloat8_e4m3fn;
  kv.k_scale = static_cast<float>(k_scale);
  kv.v_scale = static_cast<float>(v_scale);
  return kv;
}

void check_launch(cudaError_t err, const char* op) {
  TORCH_CHECK(err == cudaSuccess, "qwen3_kernels.", op, ": CUDA launch failed: ",
              cudaGetErrorString(err));
}

cudaStream_t stream() { return c10::cuda::getCurrentCUDAStream(); }

int num_sms(const at::Tensor& like) {
  int n = 0;
  cudaDeviceGetAttribute(&n, cudaDevAttrMultiProcessorCount, like.get_device());
  return n;
}

// ---- silu_and_mul / rms_norm / fused_add_rms_norm -----------------------------------------------

void silu_and_mul(at::Tensor& out, const at::Tensor& x) {
  const char* op = "silu_and_mul";
  const DType dt = half_dtype(x, op);
  if (x.size(0) == 0) return;
  const c10::cuda::CUDAGuard guard(x.device());
  check_launch(qwen3_kernels::silu_and_mul(out.data_ptr(), x.data_ptr(), x.size(0), out.size(1),
                                           out.stride(0), x.stride(0), dt, stream()),
               op);
}

void rms_norm(at::Tensor& out, const at::Tensor& x, const at::Tensor& weight, double eps,
              bool batch_invariant) {
  const char* op = "rms_norm";
  const DType dt = half_dtype(x, op);
  if (x.size(0) == 0) return;
  const c10::cuda::CUDAGuard guard(x.device());
  check_launch(qwen3_kernels::rms_norm(out.data_ptr(), x.data_ptr(), weight.data_ptr(), x.size(0),
                                       x.size(1), out.stride(0), x.stride(0),
                                       static_cast<float>(eps), batch_invariant, dt, stream()),
               op);
}

void fused_add_rms_norm(at::Tensor& x, at::Tensor& residual, const at::Tensor& weight,
                        double eps, bool batch_invariant) {
  const char* op = "fused_add_rms_norm";
  const DType dt = half_dtype(x, op);
  if (x.size(0) == 0) return;
  const c10::cuda::CUDAGuard guard(x.device());
  check_launch(qwen3_kernels::fused_add_rms_norm(x.data_ptr(), residual.data_ptr(),
                                                 weight.data_ptr(), x.size(0), x.size(1),
                                                 x.stride(0), residual.stride(0),
                                                 static_cast<float>(eps), batch_invariant, dt,
                                                 stream()),
               op);
}

// ---- qk_norm_rope -------------------------------------------------------------------------------

void qk_norm_rope(at::Tensor& q_out, const at::Tensor& qkv, const at::Tensor& q_norm_weight,
                  const at::Tensor& k_norm_weight, const at::Tensor& cos_sin_cache,
                  const at::Tensor& positions, at::Tensor& k_cache, at::Tensor& v_cache,
                  const at::Tensor& slot_mapping, int64_t num_q_heads, int64_t num_kv_heads,
                  double eps, double k_scale, double v_scale) {
  const char* op = "qk_norm_rope";
  const DType dt = half_dtype(qkv, op);
  const int64_t t = qkv.size(0);
  if (t == 0) return;
  const c10::cuda::CUDAGuard guard(qkv.device());
  check_launch(qwen3_kernels::qk_norm_rope(
                   q_out.data_ptr(), qkv.data_ptr(), q_norm_weight.data_ptr(),
                   k_norm_weight.data_ptr(), cos_sin_cache.data_ptr<float>(),
                   positions.data_ptr<int64_t>(), k_cache.data_ptr(), v_cache.data_ptr(),
                   slot_mapping.data_ptr<int32_t>(), k_cache.size(0) * k_cache.size(1), t,
                   qkv.stride(0),
                   static_cast<int>(num_q_heads), static_cast<int>(num_kv_heads),
                   static_cast<int>(k_cache.size(3)), static_cast<float>(eps), dt,
                   kv_cache(k_cache, k_scale, v_scale), stream()),
               op);
}

// ---- paged attention ----------------------------------------------------------------------------

void paged_attention_decode(at::Tensor& out, const at::Tensor& q, const at::Tensor& k_cache,
                            const at::Tensor& v_cache, const at::Tensor& block_tables,
                            const at::Tensor& seq_lens, double scale, at::Tensor& workspace,
                            double k_scale, double v_scale, bool batch_invariant) {
  const char* op = "paged_attention_decode";
  const DType dt = half_dtype(q, op);
  if (q.size(0) == 0) return;
  const c10::cuda::CUDAGuard guard(q.device());
  check_launch(qwen3_kernels::paged_attention_decode(
                   out.data_ptr(), q.data_ptr(), k_cache.data_ptr(), v_cache.data_ptr(),
                   block_tables.data_ptr<int32_t>(), seq_lens.data_ptr<int32_t>(),
                   workspace.data_ptr<float>(), static_cast<int>(q.size(0)),
                   static_cast<int>(q.size(1)), static_cast<int>(k_cache.size(2)),
                   static_cast<int>(q.size(2)), static_cast<int>(k_cache.size(1)),
                   static_cast<int>(block_tables.size(1)), static_cast<int>(workspace.size(2)),
                   static_cast<float>(scale), num_sms(q), batch_invariant, dt,
                   kv_cache(k_cache, k_scale, v_scale), stream()),
               op);
}

// Batch-invariant prefill of the rows the prefill kernel does not run in decode's order (past
// kDecodeInvariantSplitKeys keys, or all where invariant_prefill_order does not hold): each query
// token runs as the decode query at its position would (the decode kernel's fixed splits,
// launchers.h), so its output depends neither on the batch, nor on how the prompt was chunked,
// nor on whether prefill or decode computed it (a preempted sequence's recompute). Each token is
// a row of a decode batch: its sequence's block-table row and the keys up to itself. A CTA takes
// up to 16 / group consecutive tokens of one sequence (cta_first / cta_count) and reads their keys
// once; each row's result is the one it gets alone.
// Tokens run in chunks so the split workspace stays under 64 MiB.
void prefill_as_decode(at::Tensor& out, const at::Tensor& q, const at::Tensor& k_cache,
                       const at::Tensor& v_cache, const at::Tensor& cu_seqlens_q,
                       const at::Tensor& seq_lens_k, const at::Tensor& block_tables, double scale,
                       DType dt, qwen3_kernels::KvCache kv) {
  const char* op = "paged_attention_prefill";
  const int64_t tq = q.size(0), hq = q.size(1), d = q.size(2), hkv = k_cache.size(2);
  const int64_t nseq = cu_seqlens_q.size(0) - 1;
  const at::Tensor ends = cu_seqlens_q.slice(0, 1, nseq + 1);       // [B] int32
  const at::Tensor tok = at::arange(tq, cu_seqlens_q.options());    // [Tq] int32
  const at::Tensor seq = at::searchsorted(ends, tok, /*out_int32=*/false, /*right=*/true);
  // token t of sequence s sees keys 0 ..= seq_lens_k[s] - ends[s] + t
  const at::Tensor lens =
      (seq_lens_k.index_select(0, seq) - ends.index_select(0, seq) + tok + 1).to(at::kInt);
  const at::Tensor tables = block_tables.index_select(0, seq);      // [Tq, max_blocks]
  // Tokens a CTA takes: 16 rows of q heads; a token opens a CTA at its sequence's first token and
  // every per_cta tokens after (and at a chunk's first token, below).
  const int64_t group_heads = hq / hkv;
  const int64_t per_cta = group_heads <= 16 ? 16 / group_heads : 1;
  const at::Tensor opens =
      at::remainder(tok - cu_seqlens_q.index_select(0, seq), per_cta).eq(0);  // [Tq] bool
  const int64_t block_size = k_cache.size(1), max_blocks = block_tables.size(1);
  const int64_t max_ctx =
      std::min<int64_t>(max_blocks * block_size, qwen3_kernels::kDecodeInvariantMaxKeys);
  const int64_t splits = std::max<int64_t>(
      1, (max_ctx + qwen3_kernels::kDecodeInvariantSplitKeys - 1) /
             qwen3_kernels::kDecodeInvariantSplitKeys);
  const int64_t per_token = hq * splits * (d + 1);  // floats
  const int64_t chunk = std::max<int64_t>(1, std::min<int64_t>(tq, (int64_t{64} << 20) / 4 / per_token));
  at::Tensor ws = at::empty({chunk, hq, splits, d + 1}, q.options().dtype(at::kFloat));
  const int64_t row = hq * d * q.element_size();  // bytes of one token's q / out
  for (int64_t t0 = 0; t0 < tq; t0 += chunk) {
    const int64_t n = std::min(chunk, tq - t0);
    // The chunk's CTAs: group ids from the opening tokens, each group's first token and count
    // (no host sync; at most n / per_cta + nseq + 1 groups, unused ones first = -1).
    at::Tensor open = opens.slice(0, t0, t0 + n).clone();
    open.slice(0, 0, 1).fill_(true);
    const at::Tensor gid = open.cumsum(0) - 1;                            // [n] int64
    const int64_t groups = std::min<int64_t>(n, n / per_cta + nseq + 1);
    const at::Tensor local = at::arange(n, cu_seqlens_q.options());     // [n] int32
    const at::Tensor first = at::full({groups}, -1, cu_seqlens_q.options())
                                 .scatter_reduce_(0, gid, local, "amin", /*include_self=*/false);
    const at::Tensor count =
        at::zeros({groups}, cu_seqlens_q.options()).scatter_add_(0, gid, at::ones_like(local));
    check_launch(qwen3_kernels::paged_attention_decode(
                     static_cast<char*>(out.data_ptr()) + t0 * row,
                     static_cast<const char*>(q.data_ptr()) + t0 * row, k_cache.data_ptr(),
                     v_cache.data_ptr(), tables.data_ptr<int32_t>() + t0 * max_blocks,
                     lens.data_ptr<int32_t>() + t0, ws.data_ptr<float>(), static_cast<int>(n),
                     static_cast<int>(hq), static_cast<int>(hkv), static_cast<int>(d),
                     static_cast<int>(block_size), static_cast<int>(max_blocks),
                     static_cast<int>(splits), static_cast<float>(scale), num_sms(q), true, dt, kv,
                     stream(), first.data_ptr<int32_t>(), count.data_ptr<int32_t>(),
                     static_cast<int>(groups)),
                 op);
  }
}

void paged_attention_prefill(at::Tensor& out, const at::Tensor& q, const at::Tensor& k_cache,
                             const at::Tensor& v_cache, const at::Tensor& cu_seqlens_q,
                             const at::Tensor& seq_lens_k, const at::Tensor& block_tables,
                             int64_t max_seqlen_q, double scale, double k_scale,
                             double v_scale, bool batch_invariant) {
  const char* op = "paged_attention_prefill";
  const DType dt = half_dtype(q, op);
  const int64_t b = cu_seqlens_q.size(0) - 1;
  if (q.size(0) == 0 || b == 0 || max_seqlen_q == 0) return;
  const c10::cuda::CUDAGuard guard(q.device());
  const qwen3_kernels::KvCache kv = kv_cache(k_cache, k_scale, v_scale);
  // The deterministic mode: where invariant_prefill_order holds, the rows at positions below
  // kDecodeInvariantSplitKeys take the default kernel (decode runs them in its order), then the
  // rows past it, if the block table reaches them, run as decode (which leaves the others alone).
  // Elsewhere every row runs as decode.
  const bool prefill_kernel =
      !batch_invariant ||
      qwen3_kernels::invariant_prefill_order(kv.fp8, static_cast<int>(q.size(1)),
                                             static_cast<int>(k_cache.size(2)),
                                             static_cast<int>(k_cache.size(1)));
  if (prefill_kernel) {
    // the sm_90 kernel's work counter: one int of scratch the launch zeroes on the stream
    at::Tensor tile_counter = at::empty({1}, q.options().dtype(at::kInt));
    check_launch(qwen3_kernels::paged_attention_prefill(
                   out.data_ptr(), q.data_ptr(), k_cache.data_ptr(), v_cache.data_ptr(),
                   cu_seqlens_q.data_ptr<int32_t>(), seq_lens_k.data_ptr<int32_t>(),
                   block_tables.data_ptr<int32_t>(), static_cast<int>(q.size(0)),
                   static_cast<int>(b), static_cast<int>(max_seqlen_q), static_cast<int>(q.size(1)),
                   static_cast<int>(k_cache.size(2)), static_cast<int>(q.size(2)),
                   static_cast<int>(k_cache.size(1)), static_cast<int>(block_tables.size(1)),
                   static_cast<float>(scale), dt, kv, tile_counter.data_ptr<int32_t>(),
                   stream()),
                 op);
  }
  if (batch_invariant && (!prefill_kernel || block_tables.size(1) * k_cache.size(1) >
                                                qwen3_kernels::kDecodeInvariantSplitKeys))
    prefill_as_decode(out, q, k_cache, v_cache, cu_seqlens_q, seq_lens_k, block_tables, scale, dt,
                      kv);
}

// ---- linear -------------------------------------------------------------------------------------

// kernels/gemm/linear.cu picks the kernel from the shape; where it picks cuBLAS (or the GPU is
// not sm_90) this runs at::mm_out: the same result, so the op works wherever the extension loads.
// batch_invariant: CUTLASS tiles that all give the same bits (sm_90; linear.cu refuses elsewhere).
void linear(at::Tensor& out, const at::Tensor& x, const at::Tensor& weight, bool batch_invariant) {
  const char* op = "linear";
  const DType dt = half_dtype(x, op);
  const int64_t m = x.size(0), k = x.size(1), n = weight.size(0);
  if (m == 0) return;
  const c10::cuda::CUDAGuard guard(x.device());
  if (qwen3_kernels::linear_prefers_cublas(m, n, k, batch_invariant)) {
    at::mm_out(out, x, weight.t());
    return;
  }
  // Stream-K partials where the chosen configuration needs them: from the caching allocator on
  // the current stream, so this stays CUDA-graph capturable.
  const size_t ws_bytes = qwen3_kernels::linear_workspace_size(m, n, k, batch_invariant, dt);
  at::Tensor ws;
  if (ws_bytes > 0) ws = at::empty({static_cast<int64_t>(ws_bytes)}, x.options().dtype(at::kByte));
  check_launch(qwen3_kernels::linear(out.data_ptr(), x.data_ptr(), weight.data_ptr(), m, n, k,
                                     ws_bytes > 0 ? ws.data_ptr() : nullptr, ws_bytes,
                                     batch_invariant, dt, stream()),
               op);
}

// The MLP's gate_up projection and its activation: at one token one weight-streaming pass (the
// GEMV with silu_and_mul at its end); above, cuBLAS into a [T, 2I] temporary and then
// silu_and_mul: the same values either way (up to the GEMM's summation order).
void linear_silu_and_mul(at::Tensor& out, const at::Tensor& x, const at::Tensor& weight) {
  const char* op = "linear_silu_and_mul";
  const DType dt = half_dtype(x, op);
  const int64_t m = x.size(0), k = x.size(1), two_i = weight.size(0);
  if (m == 0) return;
  const c10::cuda::CUDAGuard guard(x.device());
  if (m == 1) {
    check_launch(qwen3_kernels::linear_silu_and_mul(out.data_ptr(), x.data_ptr(),
                                                    weight.data_ptr(), m, two_i, k, dt, stream()),
                 op);
    return;
  }
  const at::Tensor gate_up = at::mm(x, weight.t());  // [m, 2I]
  check_launch(qwen3_kernels::silu_and_mul(out.data_ptr(), gate_up.data_ptr(), m, two_i / 2,
                                           out.stride(0), gate_up.stride(0), dt, stream()),
               op);
}

// ---- FP8 (e4m3) block-scaled projections ----------------------------------------------------------

void quantize_fp8(at::Tensor& out, at::Tensor& x_scales, const at::Tensor& x) {
  const char* op = "quantize_fp8";
  const DType dt = half_dtype(x, op);
  if (x.size(0) == 0) return;
  const c10::cuda::CUDAGuard guard(x.device());
  check_launch(qwen3_kernels::quantize_fp8(out.data_ptr(), x_scales.data_ptr<float>(),
                                           x.data_ptr(), x.size(0), x.size(1), x.stride(0),
                                           x_scales.stride(0), x_scales.stride(1), dt, stream()),
               op);
}

// The producers of the FP8 projections' quantized input (rms_norm_fp8, fused_add_rms_norm_fp8 in
// norm.cu; silu_and_mul_fp8 in gemm/quantize_fp8.cu).
void rms_norm_fp8(at::Tensor& out, at::Tensor& x_scales, const at::Tensor& x,
                  const at::Tensor& weight, double eps) {
  const char* op = "rms_norm_fp8";
  const DType dt = half_dtype(x, op);
  if (x.size(0) == 0) return;
  const c10::cuda::CUDAGuard guard(x.device());
  check_launch(qwen3_kernels::rms_norm_fp8(out.data_ptr(), x_scales.data_ptr<float>(),
                                           x.data_ptr(), weight.data_ptr(), x.size(0), x.size(1),
                                           x.stride(0), x_scales.stride(0), x_scales.stride(1),
                                           static_cast<float>(eps), dt, stream()),
               op);
}

void fused_add_rms_norm_fp8(at::Tensor& out, at::Tensor& x_scales, const at::Tensor& x,
                            at::Tensor& residual, const at::Tensor& weight, double eps) {
  const char* op = "fused_add_rms_norm_fp8";
  const DType dt = half_dtype(x, op);
  if (x.size(0) == 0) return;
  const c10::cuda::CUDAGuard guard(x.device());
  check_launch(qwen3_kernels::fused_add_rms_norm_fp8(
                   out.data_ptr(), x_scales.data_ptr<float>(), x.data_ptr(), residual.data_ptr(),
                   weight.data_ptr(), x.size(0), x.size(1), x.stride(0), residual.stride(0),
                   x_scales.stride(0), x_scales.stride(1), static_cast<float>(eps), dt, stream()),
               op);
}

void silu_and_mul_fp8(at::Tensor& out, at::Tensor& x_scales, const at::Tensor& x) {
  const char* op = "silu_and_mul_fp8";
  const DType dt = half_dtype(x, op);
  if (x.size(0) == 0) return;
  const c10::cuda::CUDAGuard guard(x.device());
  check_launch(qwen3_kernels::silu_and_mul_fp8(out.data_ptr(), x_scales.data_ptr<float>(),
                                               x.data_ptr(), x.size(0), out.size(1), x.stride(0),
                                               x_scales.stride(0), x_scales.stride(1), dt,
                                               stream()),
               op);
}

// kernels/gemm/linear_fp8.cu picks the kernel from the shape; its workspace (the quantized
// activations and their scales above one token) comes from the caching allocator on the current
// stream, so the op stays CUDA-graph capturable. With x_scales, x is already quantized (e4m3,
// the scales token-contiguous: x_scales.stride(0) == 1).
void linear_fp8(at::Tensor& out, const at::Tensor& x, const at::Tensor& weight,
                const at::Tensor& weight_scale_inv, const std::optional<at::Tensor>& x_scales) {
  const char* op = "linear_fp8";
  const int64_t m = x.size(0), k = x.size(1), n = weight.size(0);
  if (x_scales.has_value()) {
    if (m == 0) return;
    const c10::cuda::CUDAGuard guard(x.device());
    const size_t ws_bytes = qwen3_kernels::linear_fp8_quantized_workspace_size(m, n, k);
    at::Tensor ws;
    if (ws_bytes > 0)
      ws = at::empty({static_cast<int64_t>(ws_bytes)}, x.options().dtype(at::kByte));
    check_launch(qwen3_kernels::linear_fp8_quantized(
                     out.data_ptr(), x.data_ptr(), x_scales->data_ptr<float>(),
                     x_scales->stride(1), weight.data_ptr(), weight_scale_inv.data_ptr<float>(),
                     m, n, k, ws_bytes > 0 ? ws.data_ptr() : nullptr, ws_bytes, stream()),
                 op);
    return;
  }
  TORCH_CHECK(x.scalar_type() == at::kBFloat16, "qwen3_kernels.linear_fp8: the CUDA kernel runs "
              "bfloat16 activations, got ", c10::toString(x.scalar_type()));
  if (m == 0) return;
  const c10::cuda::CUDAGuard guard(x.device());
  const size_t ws_bytes = qwen3_kernels::linear_fp8_workspace_size(m, n, k);
  at::Tensor ws;
  if (ws_bytes > 0) ws = at::empty({static_cast<int64_t>(ws_bytes)}, x.options().dtype(at::kByte));
  check_launch(qwen3_kernels::linear_fp8(out.data_ptr(), x.data_ptr(), weight.data_ptr(),
                                         weight_scale_inv.data_ptr<float>(), m, n, k,
                                         ws_bytes > 0 ? ws.data_ptr() : nullptr, ws_bytes,
                                         stream()),
               op);
}

// The FP8 MLP's gate_up projection and its activation: at one token one pass of the FP8 GEMV
// (silu_and_mul at its end); above, linear_fp8 into a [T, 2I] temporary and then silu_and_mul:
// the same values either way (up to the GEMM's summation order).
void linear_fp8_silu_and_mul(at::Tensor& out, const at::Tensor& x, const at::Tensor& weight,
                             const at::Tensor& weight_scale_inv) {
  const char* op = "linear_fp8_silu_and_mul";
  TORCH_CHECK(x.scalar_type() == at::kBFloat16, "qwen3_kernels.", op, ": the CUDA kernel runs "
              "bfloat16 activations, got ", c10::toString(x.scalar_type()));
  const int64_t m = x.size(0), k = x.size(1), two_i = weight.size(0);
  if (m == 0) return;
  const c10::cuda::CUDAGuard guard(x.device());
  if (m == 1) {
    check_launch(qwen3_kernels::linear_fp8_silu_and_mul(out.data_ptr(), x.data_ptr(),
                                                        weight.data_ptr(),
                                                        weight_scale_inv.data_ptr<float>(), two_i,
                                                        k, stream()),
                 op);
    return;
  }
  at::Tensor gate_up = at::empty({m, two_i}, x.options());
  linear_fp8(gate_up, x, weight, weight_scale_inv, std::nullopt);
  check_launch(qwen3_kernels::silu_and_mul(out.data_ptr(), gate_up.data_ptr(), m, two_i / 2,
                                           out.stride(0), gate_up.stride(0), DType::kBFloat16,
                                           stream()),
               op);
}

// ---- sample_tokens ------------------------------------------------------------------------------

void sample_tokens(at::Tensor& out, const at::Tensor& logits, const at::Tensor& temperatures,
                   const at::Tensor& seed_keys) {
  const char* op = "sample_tokens";
  qwen3_kernels::LogitsDType dt = qwen3_kernels::LogitsDType::kFloat32;
  if (logits.scalar_type() == at::kHalf) {
    dt = qwen3_kernels::LogitsDType::kFloat16;
  } else if (logits.scalar_type() == at::kBFloat16) {
    dt = qwen3_kernels::LogitsDType::kBFloat16;
  } else {
    TORCH_CHECK(logits.scalar_type() == at::kFloat, "qwen3_kernels.", op,
                ": logits must be float32, float16 or bfloat16, got ",
                c10::toString(logits.scalar_type()));
  }
  const int64_t rows = logits.size(0), vocab = logits.size(1);
  if (rows == 0) return;
  const c10::cuda::CUDAGuard guard(logits.device());
  const int splits = qwen3_kernels::sample_tokens_splits(rows, vocab, num_sms(logits));
  at::Tensor workspace;
  if (splits > 1) workspace = at::empty({2 * rows * splits}, logits.options().dtype(at::kFloat));
  check_launch(qwen3_kernels::sample_tokens(
                   out.data_ptr<int64_t>(), logits.data_ptr(), temperatures.data_ptr<float>(),
                   seed_keys.data_ptr<int64_t>(),
                   splits > 1 ? workspace.data_ptr<float>() : nullptr, rows, vocab,
                   logits.stride(0), splits, dt, stream()),
               op);
}

// ---- tp_all_reduce / tp_all_reduce_add_rms_norm / tp_gemv_push (custom_all_reduce.cu) -----------

// Bytes of one slot of the receive buffer: 2 halves x world slots (ops.tp_all_reduce_buffer_bytes).
int64_t slot_bytes(const at::Tensor& buffer, const at::Tensor& peer_ptrs) {
  return buffer.numel() / (2 * peer_ptrs.numel()) / 32 * 32;
}

void run_tp_all_reduce(at::Tensor& x, at::Tensor* residual, const at::Tensor* weight, double eps,
                       at::Tensor& buffer, const at::Tensor& peer_ptrs, at::Tensor& counters,
                       const at::Tensor& abort_flag, int64_t rank, bool pushed, const char* op) {
  const DType dt = half_dtype(x, op);
  if (x.size(0) == 0) return;  // every rank alike: no launch, the call count stays
  const c10::cuda::CUDAGuard guard(x.device());
  void* abort_dev = nullptr;  // the pinned word's address on the device (mapped host memory)
  const cudaError_t mapped = cudaHostGetDevicePointer(&abort_dev, abort_flag.data_ptr(), 0);
  if (mapped != cudaSuccess) cudaGetLastError();
  TORCH_CHECK(mapped == cudaSuccess, "qwen3_kernels.", op, ": abort_flag's pinned memory is not "
              "mapped into the device's address space: ", cudaGetErrorString(mapped));
  check_launch(qwen3_kernels::tp_all_reduce(
                   x.data_ptr(), residual ? residual->data_ptr() : nullptr,
                   weight ? weight->data_ptr() : nullptr, peer_ptrs.data_ptr<int64_t>(),
                   reinterpret_cast<uint32_t*>(counters.data_ptr<int32_t>()),
                   static_cast<const int32_t*>(abort_dev), x.size(0), x.size(1),
                   slot_bytes(buffer, peer_ptrs), static_cast<int>(peer_ptrs.numel()),
                   static_cast<int>(rank), residual != nullptr, static_cast<float>(eps), dt,
                   stream(), pushed),
               op);
}

void tp_all_reduce(at::Tensor& x, at::Tensor& buffer, const at::Tensor& peer_ptrs,
                   at::Tensor& counters, const at::Tensor& abort_flag, int64_t rank,
                   bool pushed) {
  run_tp_all_reduce(x, nullptr, nullptr, 0.0, buffer, peer_ptrs, counters, abort_flag, rank,
                    pushed, "tp_all_reduce");
}

void tp_all_reduce_add_rms_norm(at::Tensor& x, at::Tensor& residual, const at::Tensor& weight,
                                double eps, at::Tensor& buffer, const at::Tensor& peer_ptrs,
                                at::Tensor& counters, const at::Tensor& abort_flag,
                                int64_t rank, bool pushed) {
  run_tp_all_reduce(x, &residual, &weight, eps, buffer, peer_ptrs, counters, abort_flag, rank,
                    pushed, "tp_all_reduce_add_rms_norm");
}

// A row-parallel projection at one token whose output row also goes straight to the peers'
// all-reduce buffers (linear_gemv.cu); the all-reduce after it runs with pushed=True.
void tp_gemv_push(at::Tensor& out, const at::Tensor& x, const at::Tensor& weight,
                  at::Tensor& buffer, const at::Tensor& peer_ptrs, const at::Tensor& counters,
                  int64_t rank) {
  const char* op = "tp_gemv_push";
  const DType dt = half_dtype(x, op);
  const c10::cuda::CUDAGuard guard(x.device());
  check_launch(qwen3_kernels::tp_gemv_push(
                   out.data_ptr(), x.data_ptr(), weight.data_ptr(), weight.size(0), x.size(1),
                   peer_ptrs.data_ptr<int64_t>(),
                   reinterpret_cast<const uint32_t*>(counters.data_ptr<int32_t>()),
                   slot_bytes(buffer, peer_ptrs), static_cast<int>(peer_ptrs.numel()),
                   static_cast<int>(rank), dt, stream()),
               op);
}

}  // namespace

TORCH_LIBRARY_IMPL(qwen3_kernels, CUDA, m) {
  m.impl("silu_and_mul", &silu_and_mul);
  m.impl("rms_norm", &rms_norm);
  m.impl("fused_add_rms_norm", &fused_add_rms_norm);
  m.impl("qk_norm_rope", &qk_norm_rope);
  m.impl("paged_attention_decode", &paged_attention_decode);
  m.impl("paged_attention_prefill", &paged_attention_prefill);
  m.impl("linear", &linear);
  m.impl("linear_silu_and_mul", &linear_silu_and_mul);
  m.impl("quantize_fp8", &quantize_fp8);
  m.impl("linear_fp8", &linear_fp8);
  m.impl("linear_fp8_silu_and_mul", &linear_fp8_silu_and_mul);
  m.impl("rms_norm_fp8", &rms_norm_fp8);
  m.impl("fused_add_rms_norm_fp8", &fused_add_rms_norm_fp8);
  m.impl("silu_and_mul_fp8", &silu_and_mul_fp8);
  m.impl("sample_tokens", &sample_tokens);
  m.impl("tp_all_reduce", &tp_all_reduce);
  m.impl("tp_all_reduce_add_rms_norm", &tp_all_reduce_add_rms_norm);
  m.impl("tp_gemv_push", &tp_gemv_push);
}

// Importable as qwen3_kernels._C; loading it runs the registration above (ops.py defines the
// schemas first).
PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {}
