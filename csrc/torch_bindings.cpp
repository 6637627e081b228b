// Every schema of torch.ops.qwen3_kernels and the tensor checks in front of each CUDA launcher.
// Host wrappers: checks -> device guard -> current stream -> launcher (dtype dispatch inside) ->
// launch check. The Python wrappers (qwen3_kernels/ops.py) check the same contracts with friendlier
// messages; these checks protect callers of torch.ops.qwen3_kernels.* directly.
// c10/cuda only (not ATen/cuda/CUDAContext.h, which pulls cuBLAS / cuSPARSE headers), so this file
// also syntax-checks on a machine without them (tests/test_build.py).
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#include <torch/extension.h>
#include <torch/library.h>

#include <string>
#include <type_traits>
#include <vector>

#include "qwen3_kernels/launchers.h"

namespace {

using qwen3_kernels::DType;

// Error messages are assembled here from strings (integers through std::to_string), then raised
// with TORCH_CHECK(false, message). Why not TORCH_CHECK(cond, "...", some_int, ...) directly: on
// the H200 image (torch 2.11+cu130), every failing check whose message streamed an integer or a
// shape from this extension segfaulted inside the throw, while messages made only of strings
// raised normally (tests/test_*_cuda.py raw-op error tests, 2026-11-29). Building the text without
// iostream number formatting sidesteps that, and it only runs on the failure path.
void append(std::string& s, const char* v) { s += v; }
void append(std::string& s, const std::string& v) { s += v; }
void append(std::string& s, double v) { s += std::to_string(v); }
void append(std::string& s, at::ScalarType v) { s += c10::toString(v); }
void append(std::string& s, const c10::Device& v) { s += v.str(); }
void append(std::string& s, c10::IntArrayRef v) {
  s += "[";
  for (size_t i = 0; i < v.size(); ++i) s += (i ? ", " : "") + std::to_string(v[i]);
  s += "]";
}
template <typename T, std::enable_if_t<std::is_integral_v<T>, int> = 0>
void append(std::string& s, T v) { s += std::to_string(v); }

template <typename... Args>
[[noreturn]] void fail(const Args&... args) {
  std::string msg;
  (append(msg, args), ...);
  TORCH_CHECK(false, msg);
}

#define QK_CHECK(cond, ...)            \
  do {                                 \
    if (C10_UNLIKELY(!(cond))) fail(__VA_ARGS__); \
  } while (0)

DType half_dtype(const at::Tensor& t, const char* op, const char* name) {
  if (t.scalar_type() == at::kHalf) return DType::kFloat16;
  if (t.scalar_type() == at::kBFloat16) return DType::kBFloat16;
  fail("qwen3_kernels.", op, ": ", name, " must be float16 or bfloat16, got ", t.scalar_type());
}

void check_cuda(const at::Tensor& t, const at::Tensor& like, const char* op, const char* name) {
  QK_CHECK(t.is_cuda(), "qwen3_kernels.", op, ": ", name, " must be a CUDA tensor, got ",
              t.device());
  QK_CHECK(t.device() == like.device(), "qwen3_kernels.", op, ": ", name, " is on ",
              t.device(), ", expected ", like.device());
}

void check_dtype(const at::Tensor& t, at::ScalarType want, const char* op, const char* name) {
  QK_CHECK(t.scalar_type() == want, "qwen3_kernels.", op, ": ", name, " must be ", want,
              ", got ", t.scalar_type());
}

void check_dim(const at::Tensor& t, int64_t ndim, const char* op, const char* name) {
  QK_CHECK(t.dim() == ndim, "qwen3_kernels.", op, ": ", name, " must have ", ndim,
              " dims, got shape ", t.sizes());
}

// Rows may be strided (a view into a wider buffer) but each row must be dense. Kernels take a
// 16-byte vector path when rows are aligned and a scalar path otherwise.
void check_rows(const at::Tensor& t, const char* op, const char* name) {
  QK_CHECK(t.dim() == 2 && (t.size(1) <= 1 || t.stride(1) == 1), "qwen3_kernels.", op, ": ",
              name, " must be 2-D with a unit stride in its last dim, got shape ", t.sizes(),
              " strides ", t.strides());
}

void check_contiguous(const at::Tensor& t, const char* op, const char* name) {
  QK_CHECK(t.is_contiguous(), "qwen3_kernels.", op, ": ", name,
              " must be contiguous, got strides ", t.strides());
}

void check_launch(cudaError_t err, const char* op) {
  QK_CHECK(err == cudaSuccess, "qwen3_kernels.", op, ": CUDA launch failed: ",
              cudaGetErrorString(err));
}

// ---------------------------------------------------------------------------------------------
// silu_and_mul / rms_norm / fused_add_rms_norm
// ---------------------------------------------------------------------------------------------

void silu_and_mul(at::Tensor& out, const at::Tensor& x) {
  const char* op = "silu_and_mul";
  check_cuda(x, x, op, "x");
  check_cuda(out, x, op, "out");
  DType dt = half_dtype(x, op, "x");
  check_dtype(out, x.scalar_type(), op, "out");
  check_rows(x, op, "x");
  check_rows(out, op, "out");
  QK_CHECK(x.size(1) % 2 == 0, "qwen3_kernels.", op,
              ": x's last dim (2 * intermediate) must be even, got ", x.size(1));
  QK_CHECK(out.size(0) == x.size(0) && out.size(1) * 2 == x.size(1), "qwen3_kernels.", op,
              ": out must be [", x.size(0), ", ", x.size(1) / 2, "], got ", out.sizes());
  if (x.size(0) == 0) return;
  const c10::cuda::CUDAGuard guard(x.device());
  check_launch(qwen3_kernels::silu_and_mul(out.data_ptr(), x.data_ptr(), x.size(0), out.size(1),
                                           out.stride(0), x.stride(0), dt,
                                           c10::cuda::getCurrentCUDAStream()),
               op);
}

void check_norm_args(const at::Tensor& x, const at::Tensor& weight, double eps, const char* op) {
  check_cuda(x, x, op, "x");
  check_cuda(weight, x, op, "weight");
  half_dtype(x, op, "x");
  check_dtype(weight, x.scalar_type(), op, "weight");
  check_rows(x, op, "x");
  check_dim(weight, 1, op, "weight");
  check_contiguous(weight, op, "weight");
  QK_CHECK(weight.size(0) == x.size(1), "qwen3_kernels.", op, ": weight must be [", x.size(1),
              "], got ", weight.sizes());
  QK_CHECK(eps > 0, "qwen3_kernels.", op, ": eps must be positive, got ", eps);
}

void rms_norm(at::Tensor& out, const at::Tensor& x, const at::Tensor& weight, double eps) {
  const char* op = "rms_norm";
  check_norm_args(x, weight, eps, op);
  check_cuda(out, x, op, "out");
  check_dtype(out, x.scalar_type(), op, "out");
  check_rows(out, op, "out");
  QK_CHECK(out.sizes() == x.sizes(), "qwen3_kernels.", op, ": out must be ", x.sizes(),
              ", got ", out.sizes());
  if (x.size(0) == 0) return;
  const c10::cuda::CUDAGuard guard(x.device());
  check_launch(qwen3_kernels::rms_norm(out.data_ptr(), x.data_ptr(), weight.data_ptr(), x.size(0),
                                       x.size(1), out.stride(0), x.stride(0), (float)eps,
                                       half_dtype(x, op, "x"), c10::cuda::getCurrentCUDAStream()),
               op);
}

void fused_add_rms_norm(at::Tensor& x, at::Tensor& residual, const at::Tensor& weight,
                        double eps) {
  const char* op = "fused_add_rms_norm";
  check_norm_args(x, weight, eps, op);
  check_cuda(residual, x, op, "residual");
  check_dtype(residual, x.scalar_type(), op, "residual");
  check_rows(residual, op, "residual");
  QK_CHECK(residual.sizes() == x.sizes(), "qwen3_kernels.", op, ": residual must be ",
              x.sizes(), ", got ", residual.sizes());
  if (x.size(0) == 0) return;
  const c10::cuda::CUDAGuard guard(x.device());
  check_launch(qwen3_kernels::fused_add_rms_norm(
                   x.data_ptr(), residual.data_ptr(), weight.data_ptr(), x.size(0), x.size(1),
                   x.stride(0), residual.stride(0), (float)eps, half_dtype(x, op, "x"),
                   c10::cuda::getCurrentCUDAStream()),
               op);
}

// ---------------------------------------------------------------------------------------------
// qk_norm_rope
// ---------------------------------------------------------------------------------------------

void check_kv_cache(const at::Tensor& k_cache, const at::Tensor& v_cache, const at::Tensor& like,
                    const char* op) {
  check_cuda(k_cache, like, op, "k_cache");
  check_cuda(v_cache, like, op, "v_cache");
  check_dtype(k_cache, like.scalar_type(), op, "k_cache");
  check_dtype(v_cache, like.scalar_type(), op, "v_cache");
  check_dim(k_cache, 4, op, "k_cache");
  check_contiguous(k_cache, op, "k_cache");
  check_contiguous(v_cache, op, "v_cache");
  QK_CHECK(v_cache.sizes() == k_cache.sizes(), "qwen3_kernels.", op,
              ": v_cache must have k_cache's shape ", k_cache.sizes(), ", got ", v_cache.sizes());
  int64_t bs = k_cache.size(1);
  QK_CHECK(bs >= 16 && bs <= 256 && (bs & (bs - 1)) == 0, "qwen3_kernels.", op,
              ": block_size must be 16, 32, 64, 128 or 256, got ", bs);
  QK_CHECK(k_cache.size(3) == 128, "qwen3_kernels.", op,
              ": the CUDA kernel supports head_dim 128 only, got ", k_cache.size(3),
              " (the Python wrapper runs the reference for other head dims)");
}

void qk_norm_rope(at::Tensor& q_out, const at::Tensor& qkv, const at::Tensor& q_norm_weight,
                  const at::Tensor& k_norm_weight, const at::Tensor& cos_sin_cache,
                  const at::Tensor& positions, at::Tensor& k_cache, at::Tensor& v_cache,
                  const at::Tensor& slot_mapping, int64_t num_q_heads, int64_t num_kv_heads,
                  double eps) {
  const char* op = "qk_norm_rope";
  check_cuda(qkv, qkv, op, "qkv");
  DType dt = half_dtype(qkv, op, "qkv");
  check_rows(qkv, op, "qkv");
  QK_CHECK(qkv.stride(0) % 8 == 0 && reinterpret_cast<uintptr_t>(qkv.data_ptr()) % 16 == 0,
              "qwen3_kernels.", op, ": qkv rows must be 16-byte aligned (row stride a multiple "
              "of 8 elements), got stride ", qkv.stride(0));
  check_kv_cache(k_cache, v_cache, qkv, op);
  const int64_t d = k_cache.size(3), t = qkv.size(0);
  QK_CHECK(num_kv_heads >= 1 && num_q_heads % num_kv_heads == 0 && num_q_heads >= 1,
              "qwen3_kernels.", op, ": num_q_heads (", num_q_heads,
              ") must be a positive multiple of num_kv_heads (", num_kv_heads, ")");
  QK_CHECK(k_cache.size(2) == num_kv_heads, "qwen3_kernels.", op, ": k_cache has ",
              k_cache.size(2), " kv heads, num_kv_heads is ", num_kv_heads);
  QK_CHECK(qkv.size(1) == (num_q_heads + 2 * num_kv_heads) * d, "qwen3_kernels.", op,
              ": qkv must be [T, ", (num_q_heads + 2 * num_kv_heads) * d, "], got ", qkv.sizes());
  for (auto* w : {&q_norm_weight, &k_norm_weight}) {
    check_cuda(*w, qkv, op, "q_norm_weight / k_norm_weight");
    check_dtype(*w, qkv.scalar_type(), op, "q_norm_weight / k_norm_weight");
    QK_CHECK(w->dim() == 1 && w->size(0) == d && w->is_contiguous(), "qwen3_kernels.", op,
                ": q_norm_weight / k_norm_weight must be contiguous [", d, "], got ", w->sizes());
  }
  check_cuda(cos_sin_cache, qkv, op, "cos_sin_cache");
  check_dtype(cos_sin_cache, at::kFloat, op, "cos_sin_cache");
  check_contiguous(cos_sin_cache, op, "cos_sin_cache");
  QK_CHECK(cos_sin_cache.dim() == 2 && cos_sin_cache.size(1) == d, "qwen3_kernels.", op,
              ": cos_sin_cache must be [max_position, ", d, "], got ", cos_sin_cache.sizes());
  check_cuda(positions, qkv, op, "positions");
  check_dtype(positions, at::kLong, op, "positions");
  QK_CHECK(positions.dim() == 1 && positions.size(0) == t && positions.is_contiguous(),
              "qwen3_kernels.", op, ": positions must be contiguous [", t, "], got ",
              positions.sizes());
  check_cuda(slot_mapping, qkv, op, "slot_mapping");
  check_dtype(slot_mapping, at::kInt, op, "slot_mapping");
  QK_CHECK(slot_mapping.dim() == 1 && slot_mapping.size(0) == t && slot_mapping.is_contiguous(),
              "qwen3_kernels.", op, ": slot_mapping must be contiguous [", t, "], got ",
              slot_mapping.sizes());
  check_cuda(q_out, qkv, op, "q_out");
  check_dtype(q_out, qkv.scalar_type(), op, "q_out");
  check_contiguous(q_out, op, "q_out");
  QK_CHECK(q_out.dim() == 3 && q_out.size(0) == t && q_out.size(1) == num_q_heads &&
                  q_out.size(2) == d,
              "qwen3_kernels.", op, ": q_out must be [", t, ", ", num_q_heads, ", ", d, "], got ",
              q_out.sizes());
  QK_CHECK(eps > 0, "qwen3_kernels.", op, ": eps must be positive, got ", eps);
  if (t == 0) return;
  const c10::cuda::CUDAGuard guard(qkv.device());
  check_launch(qwen3_kernels::qk_norm_rope(
                   q_out.data_ptr(), qkv.data_ptr(), q_norm_weight.data_ptr(),
                   k_norm_weight.data_ptr(), cos_sin_cache.data_ptr<float>(),
                   positions.data_ptr<int64_t>(), k_cache.data_ptr(), v_cache.data_ptr(),
                   slot_mapping.data_ptr<int32_t>(), t, qkv.stride(0), (int)num_q_heads,
                   (int)num_kv_heads, (int)d, (float)eps, dt, c10::cuda::getCurrentCUDAStream()),
               op);
}

// ---------------------------------------------------------------------------------------------
// paged attention
// ---------------------------------------------------------------------------------------------

void check_attention_args(const at::Tensor& out, const at::Tensor& q, const at::Tensor& k_cache,
                          const at::Tensor& v_cache, const at::Tensor& block_tables,
                          int64_t num_seqs, const char* op) {
  check_cuda(q, q, op, "q");
  half_dtype(q, op, "q");
  check_dim(q, 3, op, "q");
  check_contiguous(q, op, "q");
  check_kv_cache(k_cache, v_cache, q, op);
  QK_CHECK(q.size(2) == k_cache.size(3), "qwen3_kernels.", op, ": q's head_dim ", q.size(2),
              " differs from the cache's ", k_cache.size(3));
  QK_CHECK(q.size(1) % k_cache.size(2) == 0, "qwen3_kernels.", op, ": q heads (", q.size(1),
              ") must be a multiple of kv heads (", k_cache.size(2), ")");
  check_cuda(out, q, op, "out");
  check_dtype(out, q.scalar_type(), op, "out");
  check_contiguous(out, op, "out");
  QK_CHECK(out.sizes() == q.sizes(), "qwen3_kernels.", op, ": out must be ", q.sizes(),
              ", got ", out.sizes());
  check_cuda(block_tables, q, op, "block_tables");
  check_dtype(block_tables, at::kInt, op, "block_tables");
  check_dim(block_tables, 2, op, "block_tables");
  check_contiguous(block_tables, op, "block_tables");
  QK_CHECK(block_tables.size(0) == num_seqs, "qwen3_kernels.", op, ": block_tables must have ",
              num_seqs, " rows, got ", block_tables.size(0));
}

void paged_attention_decode(at::Tensor& out, const at::Tensor& q, const at::Tensor& k_cache,
                            const at::Tensor& v_cache, const at::Tensor& block_tables,
                            const at::Tensor& seq_lens, double scale, at::Tensor& workspace) {
  const char* op = "paged_attention_decode";
  check_attention_args(out, q, k_cache, v_cache, block_tables, q.size(0), op);
  check_cuda(seq_lens, q, op, "seq_lens");
  check_dtype(seq_lens, at::kInt, op, "seq_lens");
  QK_CHECK(seq_lens.dim() == 1 && seq_lens.size(0) == q.size(0) && seq_lens.is_contiguous(),
              "qwen3_kernels.", op, ": seq_lens must be contiguous [", q.size(0), "], got ",
              seq_lens.sizes());
  check_cuda(workspace, q, op, "workspace");
  check_dtype(workspace, at::kFloat, op, "workspace");
  check_contiguous(workspace, op, "workspace");
  QK_CHECK(workspace.dim() == 4 && workspace.size(0) == q.size(0) &&
                  workspace.size(1) == q.size(1) && workspace.size(3) == q.size(2) + 1 &&
                  workspace.size(2) >= 1,
              "qwen3_kernels.", op, ": workspace must be [", q.size(0), ", ", q.size(1),
              ", max_splits, ", q.size(2) + 1, "] float32, got ", workspace.sizes());
  QK_CHECK(block_tables.size(1) >= 1, "qwen3_kernels.", op,
              ": block_tables needs at least one column, got ", block_tables.sizes());
  if (q.size(0) == 0) return;
  const c10::cuda::CUDAGuard guard(q.device());
  int num_sms = 0;
  cudaDeviceGetAttribute(&num_sms, cudaDevAttrMultiProcessorCount, q.get_device());
  check_launch(qwen3_kernels::paged_attention_decode(
                   out.data_ptr(), q.data_ptr(), k_cache.data_ptr(), v_cache.data_ptr(),
                   block_tables.data_ptr<int32_t>(), seq_lens.data_ptr<int32_t>(),
                   workspace.data_ptr<float>(), (int)q.size(0), (int)q.size(1),
                   (int)k_cache.size(2), (int)q.size(2), (int)k_cache.size(1),
                   (int)block_tables.size(1), (int)workspace.size(2), (float)scale, num_sms,
                   half_dtype(q, op, "q"), c10::cuda::getCurrentCUDAStream()),
               op);
}

void paged_attention_prefill(at::Tensor& out, const at::Tensor& q, const at::Tensor& k_cache,
                             const at::Tensor& v_cache, const at::Tensor& cu_seqlens_q,
                             const at::Tensor& seq_lens_k, const at::Tensor& block_tables,
                             int64_t max_seqlen_q, double scale) {
  const char* op = "paged_attention_prefill";
  check_cuda(cu_seqlens_q, q, op, "cu_seqlens_q");
  check_dtype(cu_seqlens_q, at::kInt, op, "cu_seqlens_q");
  QK_CHECK(cu_seqlens_q.dim() == 1 && cu_seqlens_q.size(0) >= 1 && cu_seqlens_q.is_contiguous(),
              "qwen3_kernels.", op, ": cu_seqlens_q must be contiguous [B + 1], got ",
              cu_seqlens_q.sizes());
  const int64_t b = cu_seqlens_q.size(0) - 1;
  check_attention_args(out, q, k_cache, v_cache, block_tables, b, op);
  check_cuda(seq_lens_k, q, op, "seq_lens_k");
  check_dtype(seq_lens_k, at::kInt, op, "seq_lens_k");
  QK_CHECK(seq_lens_k.dim() == 1 && seq_lens_k.size(0) == b && seq_lens_k.is_contiguous(),
              "qwen3_kernels.", op, ": seq_lens_k must be contiguous [", b, "], got ",
              seq_lens_k.sizes());
  QK_CHECK(max_seqlen_q >= 0, "qwen3_kernels.", op, ": max_seqlen_q must be >= 0, got ",
              max_seqlen_q);
  if (q.size(0) == 0 || b == 0 || max_seqlen_q == 0) return;
  const c10::cuda::CUDAGuard guard(q.device());
  check_launch(qwen3_kernels::paged_attention_prefill(
                   out.data_ptr(), q.data_ptr(), k_cache.data_ptr(), v_cache.data_ptr(),
                   cu_seqlens_q.data_ptr<int32_t>(), seq_lens_k.data_ptr<int32_t>(),
                   block_tables.data_ptr<int32_t>(), (int)b, (int)max_seqlen_q, (int)q.size(1),
                   (int)k_cache.size(2), (int)q.size(2), (int)k_cache.size(1),
                   (int)block_tables.size(1), (float)scale, half_dtype(q, op, "q"),
                   c10::cuda::getCurrentCUDAStream()),
               op);
}

// ---------------------------------------------------------------------------------------------
// linear
// ---------------------------------------------------------------------------------------------

// The operand checks linear and linear_silu_and_mul share. x [m, k], weight [n, k], out
// [m, n / out_div]: one half dtype on x's device, contiguous, 16-byte aligned starts; n and k
// positive multiples of 8 (n_name says what the weight's rows are in the message). Returns the dtype.
DType check_linear_operands(const at::Tensor& out, const at::Tensor& x, const at::Tensor& weight,
                            int64_t out_div, const char* n_name, const char* op) {
  check_cuda(x, x, op, "x");
  check_cuda(weight, x, op, "weight");
  check_cuda(out, x, op, "out");
  const DType dt = half_dtype(x, op, "x");
  check_dtype(weight, x.scalar_type(), op, "weight");
  check_dtype(out, x.scalar_type(), op, "out");
  check_dim(x, 2, op, "x");
  check_dim(weight, 2, op, "weight");
  check_contiguous(x, op, "x");
  check_contiguous(weight, op, "weight");
  check_contiguous(out, op, "out");
  const int64_t m = x.size(0), k = x.size(1), n = weight.size(0);
  QK_CHECK(weight.size(1) == k, "qwen3_kernels.", op, ": x is [", m, ", ", k,
           "] but weight is ", weight.sizes(), ": inner dims differ");
  QK_CHECK(k % 8 == 0 && n % 8 == 0 && k > 0 && n > 0, "qwen3_kernels.", op, ": K and ", n_name,
           " must be positive multiples of 8, got K=", k, " ", n_name, "=", n);
  QK_CHECK(out.dim() == 2 && out.size(0) == m && out.size(1) == n / out_div, "qwen3_kernels.", op,
           ": out must be [", m, ", ", n / out_div, "], got ", out.sizes());
  const at::Tensor* operands[] = {&x, &weight, &out};
  for (const at::Tensor* t : operands) {
    QK_CHECK(reinterpret_cast<uintptr_t>(t->data_ptr()) % 16 == 0, "qwen3_kernels.", op,
             ": x, weight and out must start 16-byte aligned; got a view at offset ",
             t->storage_offset());
  }
  return dt;
}

// Hopper runs our CUTLASS / hand-written kernels (kernels/gemm/) where the choice table measured
// them faster than cuBLAS, and cuBLAS (at::mm_out) where it did not; any other GPU gets cuBLAS:
// the same result, so the op works everywhere the extension loads.
void linear(at::Tensor& out, const at::Tensor& x, const at::Tensor& weight) {
  const char* op = "linear";
  const DType dt = check_linear_operands(out, x, weight, 1, "N", op);
  const int64_t m = x.size(0), k = x.size(1), n = weight.size(0);
  if (m == 0) return;
  const c10::cuda::CUDAGuard guard(x.device());
  if (qwen3_kernels::linear_prefers_cublas(m, n, k)) {  // measured faster there (the table)
    at::mm_out(out, x, weight.t());
    return;
  }
  // Stream-K partials where the chosen configuration needs them: from the caching allocator on
  // the current stream, so this stays CUDA-graph capturable.
  const size_t ws_bytes = qwen3_kernels::linear_workspace_size(m, n, k, dt);
  at::Tensor ws;
  if (ws_bytes > 0) ws = at::empty({static_cast<int64_t>(ws_bytes)}, x.options().dtype(at::kByte));
  const cudaError_t err = qwen3_kernels::linear(
      out.data_ptr(), x.data_ptr(), weight.data_ptr(), m, n, k,
      ws_bytes > 0 ? ws.data_ptr() : nullptr, ws_bytes, dt, c10::cuda::getCurrentCUDAStream());
  if (err == cudaErrorNotSupported) {
    int major = 0, minor = 0;
    cudaDeviceGetAttribute(&major, cudaDevAttrComputeCapabilityMajor, x.get_device());
    cudaDeviceGetAttribute(&minor, cudaDevAttrComputeCapabilityMinor, x.get_device());
    QK_CHECK(!(major == 9 && minor == 0), "qwen3_kernels.", op,
                ": the chosen configuration (the table in csrc/kernels/gemm/linear.cu, or "
                "QWEN3_LINEAR_FORCE) cannot run M=", m, " N=", n, " K=", k);
    at::mm_out(out, x, weight.t());
    return;
  }
  check_launch(err, op);
}

// linear_silu_and_mul: the MLP's gate_up projection and its activation. Up to
// linear_silu_and_mul_max_tokens tokens one weight-streaming pass (the GEMV with silu_and_mul at
// its end); above, or where that kernel does not run, cuBLAS into a [T, 2I] temporary and then
// silu_and_mul: the same values either way (up to the GEMM's summation order).
void linear_silu_and_mul(at::Tensor& out, const at::Tensor& x, const at::Tensor& weight) {
  const char* op = "linear_silu_and_mul";
  // the weight's rows are gate then up: 2I of them
  const DType dt = check_linear_operands(out, x, weight, 2, "2I", op);
  const int64_t m = x.size(0), k = x.size(1), two_i = weight.size(0);
  if (m == 0) return;
  const c10::cuda::CUDAGuard guard(x.device());
  const cudaStream_t stream = c10::cuda::getCurrentCUDAStream();
  const cudaError_t err = qwen3_kernels::linear_silu_and_mul(out.data_ptr(), x.data_ptr(),
                                                             weight.data_ptr(), m, two_i, k, dt,
                                                             stream);
  if (err != cudaErrorNotSupported) {
    check_launch(err, op);
    return;
  }
  cudaGetLastError();  // not a launch failure: the GEMV does not take this problem
  const at::Tensor gate_up = at::mm(x, weight.t());  // [m, 2I]
  check_launch(qwen3_kernels::silu_and_mul(out.data_ptr(), gate_up.data_ptr(), m, two_i / 2,
                                           out.stride(0), gate_up.stride(0), dt, stream),
               op);
}

// ---------------------------------------------------------------------------------------------
// sample_tokens
// ---------------------------------------------------------------------------------------------

void sample_tokens(at::Tensor& out, const at::Tensor& logits, const at::Tensor& temperatures,
                   const at::Tensor& seed_keys) {
  const char* op = "sample_tokens";
  check_cuda(logits, logits, op, "logits");
  check_cuda(out, logits, op, "out");
  check_cuda(temperatures, logits, op, "temperatures");
  check_cuda(seed_keys, logits, op, "seed_keys");
  qwen3_kernels::LogitsDType dt = qwen3_kernels::LogitsDType::kFloat32;
  if (logits.scalar_type() == at::kHalf) {
    dt = qwen3_kernels::LogitsDType::kFloat16;
  } else if (logits.scalar_type() == at::kBFloat16) {
    dt = qwen3_kernels::LogitsDType::kBFloat16;
  } else {
    QK_CHECK(logits.scalar_type() == at::kFloat, "qwen3_kernels.", op,
             ": logits must be float32, float16 or bfloat16, got ", logits.scalar_type());
  }
  check_rows(logits, op, "logits");
  const int64_t rows = logits.size(0), vocab = logits.size(1);
  QK_CHECK(vocab >= 1 && vocab <= (int64_t{1} << 30), "qwen3_kernels.", op,
           ": logits' vocab dim must be in [1, 2^30], got ", vocab);
  check_dtype(out, at::kLong, op, "out");
  check_contiguous(out, op, "out");
  QK_CHECK(out.dim() == 1 && out.size(0) == rows, "qwen3_kernels.", op, ": out must be [", rows,
           "], got ", out.sizes());
  check_dtype(temperatures, at::kFloat, op, "temperatures");
  check_contiguous(temperatures, op, "temperatures");
  QK_CHECK(temperatures.dim() == 1 && temperatures.size(0) == rows, "qwen3_kernels.", op,
           ": temperatures must be [", rows, "], got ", temperatures.sizes());
  check_dtype(seed_keys, at::kLong, op, "seed_keys");
  check_contiguous(seed_keys, op, "seed_keys");
  QK_CHECK(seed_keys.dim() == 2 && seed_keys.size(0) == rows && seed_keys.size(1) == 3,
           "qwen3_kernels.", op, ": seed_keys must be [", rows, ", 3], got ", seed_keys.sizes());
  if (rows == 0) return;
  const c10::cuda::CUDAGuard guard(logits.device());
  int num_sms = 0;
  cudaDeviceGetAttribute(&num_sms, cudaDevAttrMultiProcessorCount, logits.get_device());
  const int splits = qwen3_kernels::sample_tokens_splits(rows, vocab, num_sms);
  at::Tensor workspace;
  if (splits > 1) workspace = at::empty({2 * rows * splits}, logits.options().dtype(at::kFloat));
  check_launch(qwen3_kernels::sample_tokens(
                   out.data_ptr<int64_t>(), logits.data_ptr(), temperatures.data_ptr<float>(),
                   seed_keys.data_ptr<int64_t>(),
                   splits > 1 ? workspace.data_ptr<float>() : nullptr, rows, vocab,
                   logits.stride(0), splits, dt, c10::cuda::getCurrentCUDAStream()),
               op);
}

// ---------------------------------------------------------------------------------------------
// tp_all_reduce / tp_all_reduce_add_rms_norm (kernels/custom_all_reduce.cu)
// ---------------------------------------------------------------------------------------------

// buffer: this rank's receive buffer (uint8, peer-writable: torch symmetric memory), split into
// 2 halves x world slots; peer_ptrs [world] int64 (device): every rank's buffer as mapped here;
// counters [2] int32 (device, zeroed at setup); abort_flag [1] int32 in pinned host memory, which
// the kernel reads over PCIe (its device address from cudaHostGetDevicePointer). Returns the
// bytes of one slot.
// abort_flag: nullptr for tp_gemv_push, which never waits
int64_t check_tp_all_reduce_args(const at::Tensor& x, const at::Tensor& buffer,
                                 const at::Tensor& peer_ptrs, const at::Tensor& counters,
                                 const at::Tensor* abort_flag, int64_t rank, const char* op) {
  check_cuda(x, x, op, "x");
  half_dtype(x, op, "x");
  check_dim(x, 2, op, "x");
  check_contiguous(x, op, "x");
  QK_CHECK(x.size(1) % 8 == 0 && x.size(1) > 0 && x.size(1) <= 32768 &&
               reinterpret_cast<uintptr_t>(x.data_ptr()) % 16 == 0,
           "qwen3_kernels.", op, ": x must be [T, H] with H a multiple of 8 up to 32768 and "
           "16-byte aligned, got ", x.sizes());
  check_cuda(buffer, x, op, "buffer");
  check_dtype(buffer, at::kByte, op, "buffer");
  check_contiguous(buffer, op, "buffer");
  check_cuda(peer_ptrs, x, op, "peer_ptrs");
  check_dtype(peer_ptrs, at::kLong, op, "peer_ptrs");
  check_contiguous(peer_ptrs, op, "peer_ptrs");
  const int64_t world = peer_ptrs.numel();
  QK_CHECK(peer_ptrs.dim() == 1 && world >= 2 && world <= 8, "qwen3_kernels.", op,
           ": peer_ptrs must be [world] with world in 2..8, got ", peer_ptrs.sizes());
  QK_CHECK(rank >= 0 && rank < world, "qwen3_kernels.", op, ": rank must be in [0, ", world,
           "), got ", rank);
  check_cuda(counters, x, op, "counters");
  check_dtype(counters, at::kInt, op, "counters");
  check_contiguous(counters, op, "counters");
  QK_CHECK(counters.dim() == 1 && counters.size(0) == 2, "qwen3_kernels.", op,
           ": counters must be [2] int32, got ", counters.sizes());
  QK_CHECK(abort_flag == nullptr ||
               (abort_flag->device().is_cpu() && abort_flag->is_pinned() &&
                abort_flag->scalar_type() == at::kInt && abort_flag->numel() >= 1),
           "qwen3_kernels.", op, ": abort_flag must be a pinned CPU int32 tensor of one element "
           "(torch.zeros(1, dtype=torch.int32, pin_memory=True)), got ", abort_flag->scalar_type(),
           " ", abort_flag->sizes(), " on ", abort_flag->device(),
           abort_flag->device().is_cpu() && !abort_flag->is_pinned() ? " (not pinned)" : "");
  const int64_t slot_bytes = buffer.numel() / (2 * world) / 32 * 32;
  QK_CHECK(x.size(0) * x.size(1) * 4 <= slot_bytes, "qwen3_kernels.", op, ": x ", x.sizes(),
           " needs ", x.size(0) * x.size(1) * 4, " bytes per slot, the buffer's slots hold ",
           slot_bytes, " (", world, " ranks x 2 halves)");
  return slot_bytes;
}

void run_tp_all_reduce(at::Tensor& x, at::Tensor* residual, const at::Tensor* weight, double eps,
                       at::Tensor& buffer, const at::Tensor& peer_ptrs, at::Tensor& counters,
                       const at::Tensor& abort_flag, int64_t rank, bool pushed, const char* op) {
  const int64_t slot_bytes =
      check_tp_all_reduce_args(x, buffer, peer_ptrs, counters, &abort_flag, rank, op);
  QK_CHECK(!pushed || x.size(0) == 1, "qwen3_kernels.", op, ": pushed=True needs one row (the ",
           "row tp_gemv_push sent), got x ", x.sizes());
  if (x.size(0) == 0) return;  // every rank alike: no launch, the call count stays
  const c10::cuda::CUDAGuard guard(x.device());
  void* abort_dev = nullptr;  // the pinned word's address on the device (mapped host memory)
  const cudaError_t mapped = cudaHostGetDevicePointer(&abort_dev, abort_flag.data_ptr(), 0);
  if (mapped != cudaSuccess) cudaGetLastError();
  QK_CHECK(mapped == cudaSuccess, "qwen3_kernels.", op, ": abort_flag's pinned memory is not "
           "mapped into the device's address space: ", cudaGetErrorString(mapped));
  check_launch(qwen3_kernels::tp_all_reduce(
                   x.data_ptr(), residual ? residual->data_ptr() : nullptr,
                   weight ? weight->data_ptr() : nullptr, peer_ptrs.data_ptr<int64_t>(),
                   reinterpret_cast<uint32_t*>(counters.data_ptr<int32_t>()),
                   static_cast<const int32_t*>(abort_dev), x.size(0),
                   x.size(1), slot_bytes, static_cast<int>(peer_ptrs.numel()),
                   static_cast<int>(rank), residual != nullptr, static_cast<float>(eps),
                   half_dtype(x, op, "x"), c10::cuda::getCurrentCUDAStream(), pushed),
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
  const char* op = "tp_all_reduce_add_rms_norm";
  check_norm_args(x, weight, eps, op);
  check_cuda(residual, x, op, "residual");
  check_dtype(residual, x.scalar_type(), op, "residual");
  check_contiguous(residual, op, "residual");
  QK_CHECK(residual.sizes() == x.sizes(), "qwen3_kernels.", op, ": residual must be ",
           x.sizes(), ", got ", residual.sizes());
  QK_CHECK(reinterpret_cast<uintptr_t>(residual.data_ptr()) % 16 == 0 &&
               reinterpret_cast<uintptr_t>(weight.data_ptr()) % 16 == 0,
           "qwen3_kernels.", op, ": residual and weight must start 16-byte aligned");
  run_tp_all_reduce(x, &residual, &weight, eps, buffer, peer_ptrs, counters, abort_flag, rank,
                    pushed, op);
}

// tp_gemv_push: a row-parallel projection at one token whose output row also goes straight to the
// peers' all-reduce buffers (linear_gemv.cu); the all-reduce after it runs with pushed=True.
void tp_gemv_push(at::Tensor& out, const at::Tensor& x, const at::Tensor& weight,
                  at::Tensor& buffer, const at::Tensor& peer_ptrs, const at::Tensor& counters,
                  int64_t rank) {
  const char* op = "tp_gemv_push";
  const DType dt = check_linear_operands(out, x, weight, 1, "N", op);
  QK_CHECK(x.size(0) == 1, "qwen3_kernels.", op, ": x must be one token [1, K], got ", x.sizes());
  // the all-reduce's own checks, on the row this call sends (out)
  const int64_t slot_bytes =
      check_tp_all_reduce_args(out, buffer, peer_ptrs, counters, nullptr, rank, op);
  const c10::cuda::CUDAGuard guard(x.device());
  check_launch(qwen3_kernels::tp_gemv_push(
                   out.data_ptr(), x.data_ptr(), weight.data_ptr(), weight.size(0), x.size(1),
                   peer_ptrs.data_ptr<int64_t>(),
                   reinterpret_cast<const uint32_t*>(counters.data_ptr<int32_t>()), slot_bytes,
                   static_cast<int>(peer_ptrs.numel()), static_cast<int>(rank), dt,
                   c10::cuda::getCurrentCUDAStream()),
               op);
}

}  // namespace

TORCH_LIBRARY(qwen3_kernels, ops) {
  // out = silu(x[:, :I]) * x[:, I:]
  ops.def("silu_and_mul(Tensor! out, Tensor x) -> ()");
  ops.impl("silu_and_mul", torch::kCUDA, &silu_and_mul);
  // out = x * rsqrt(mean(x^2) + eps) * weight
  ops.def("rms_norm(Tensor! out, Tensor x, Tensor weight, float eps) -> ()");
  ops.impl("rms_norm", torch::kCUDA, &rms_norm);
  // residual += x; x = rms_norm(residual)
  ops.def("fused_add_rms_norm(Tensor! x, Tensor! residual, Tensor weight, float eps) -> ()");
  ops.impl("fused_add_rms_norm", torch::kCUDA, &fused_add_rms_norm);
  // q/k per-head RMSNorm + neox RoPE on packed qkv; K/V into the paged cache at slot_mapping
  ops.def(
      "qk_norm_rope(Tensor! q_out, Tensor qkv, Tensor q_norm_weight, Tensor k_norm_weight, "
      "Tensor cos_sin_cache, Tensor positions, Tensor! k_cache, Tensor! v_cache, "
      "Tensor slot_mapping, int num_q_heads, int num_kv_heads, float eps) -> ()");
  ops.impl("qk_norm_rope", torch::kCUDA, &qk_norm_rope);
  // one query token per sequence over its paged context; split-KV through workspace
  ops.def(
      "paged_attention_decode(Tensor! out, Tensor q, Tensor k_cache, Tensor v_cache, "
      "Tensor block_tables, Tensor seq_lens, float scale, Tensor! workspace) -> ()");
  ops.impl("paged_attention_decode", torch::kCUDA, &paged_attention_decode);
  // varlen causal prefill over paged keys, queries aligned to the end of each key sequence
  ops.def(
      "paged_attention_prefill(Tensor! out, Tensor q, Tensor k_cache, Tensor v_cache, "
      "Tensor cu_seqlens_q, Tensor seq_lens_k, Tensor block_tables, int max_seqlen_q, "
      "float scale) -> ()");
  ops.impl("paged_attention_prefill", torch::kCUDA, &paged_attention_prefill);
  // out = x @ weight^T (CUTLASS sm90)
  ops.def("linear(Tensor! out, Tensor x, Tensor weight) -> ()");
  ops.impl("linear", torch::kCUDA, &linear);
  // out = silu(g) * u, [g | u] = x @ weight^T (weight [2I, K]: gate rows, then up rows)
  ops.def("linear_silu_and_mul(Tensor! out, Tensor x, Tensor weight) -> ()");
  ops.impl("linear_silu_and_mul", torch::kCUDA, &linear_silu_and_mul);
  // one token per row: argmax of logits / T - log(E), E ~ Exp(1) hashed from seed_keys; T <= 0 greedy
  ops.def("sample_tokens(Tensor! out, Tensor logits, Tensor temperatures, Tensor seed_keys) -> ()");
  ops.impl("sample_tokens", torch::kCUDA, &sample_tokens);
  // x = sum of x over the TP ranks (one-shot over peer memory; buffer [bytes] uint8 this rank's
  // receive buffer, peer_ptrs [world] int64, counters [2] int32: the device-side call count,
  // abort_flag [1] int32 pinned host: set when a peer died, the kernel then stops waiting)
  // pushed: x's one row was already sent by tp_gemv_push (this call only waits and adds)
  ops.def(
      "tp_all_reduce(Tensor! x, Tensor! buffer, Tensor peer_ptrs, Tensor! counters, "
      "Tensor abort_flag, int rank, bool pushed=False) -> ()");
  ops.impl("tp_all_reduce", torch::kCUDA, &tp_all_reduce);
  // the same, then residual += x; x = rms_norm(residual) (x, residual [T, H]; weight [H])
  ops.def(
      "tp_all_reduce_add_rms_norm(Tensor! x, Tensor! residual, Tensor weight, float eps, "
      "Tensor! buffer, Tensor peer_ptrs, Tensor! counters, Tensor abort_flag, int rank, "
      "bool pushed=False) -> ()");
  ops.impl("tp_all_reduce_add_rms_norm", torch::kCUDA, &tp_all_reduce_add_rms_norm);
  // out [1, N] = x [1, K] @ weight [N, K]^T, and out's row into the peers' buffers (above) for
  // the all-reduce's next call, which then runs with pushed=True
  ops.def(
      "tp_gemv_push(Tensor! out, Tensor x, Tensor weight, Tensor! buffer, Tensor peer_ptrs, "
      "Tensor counters, int rank) -> ()");
  ops.impl("tp_gemv_push", torch::kCUDA, &tp_gemv_push);
}

// Importable as qwen3_kernels._C; loading it runs the registration above.
PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {}
