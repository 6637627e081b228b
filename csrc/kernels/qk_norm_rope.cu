// qk_norm_rope: Qwen3's per-head RMSNorm (q_norm / k_norm) + neox RoPE on the packed QKV output of
// the QKV projection, with K and V written straight into the paged KV cache. One pass: qkv is read
// once, q written once, K and V written once; nothing else of size touches memory.
//
// Spec: qwen3_kernels/reference.py::qk_norm_rope (fp32 math, outputs rounded to the input dtype).
//
// head_dim is fixed at 128 (every Qwen3 model). The launcher returns cudaErrorInvalidValue for any
// other head_dim; the Python wrapper (qwen3_kernels/ops.py) runs the reference for those instead.
//
// Work split: an "item" is one (token, head) of the packed qkv row, heads ordered q, k, v.
// Eight lanes own one item; lane j holds elements [8j, 8j+8) of the first half and
// [64+8j, 64+8j+8) of the second half: two 16-byte loads, and each lane holds both elements of
// every neox pair (i, i+64) it rotates, so RoPE needs no shuffles. The RMS over the 128 elements is
// a 3-step xor-shuffle within the 8-lane group. v heads are copied through untouched.
// Each thread handles ITEMS items (2 for large batches, 1 for small ones), all qkv loads issued
// before any math, so enough bytes are in flight per SM to saturate HBM (the kernel is purely
// bandwidth bound: a few FLOP per byte).
//
// Not checked on the device (the launcher has no bounds to check against, and a check would need a
// host sync): positions must be < max_position, and slots < num_blocks * block_size.
// The launcher refuses (cudaErrorMisalignedAddress) pointers off a 16-byte boundary, and
// num_tokens * (Hq + 2*Hkv) >= 2^31 (cudaErrorInvalidValue).
#include "qwen3_kernels/common.cuh"

namespace qwen3_kernels {
namespace {

constexpr int kHeadDim = 128;
constexpr int kHalf = kHeadDim / 2;         // neox pairs (i, i + 64)
constexpr int kVec = 8;                      // 16-bit elements per 16-byte access
constexpr int kLanesPerItem = kHalf / kVec;  // 8 lanes cover one head
constexpr int kThreads = 256;

__device__ __forceinline__ float4 load_f4(const float* p) {
  return *reinterpret_cast<const float4*>(p);
}

// 8 fp32 values at p (32-byte aligned chunk of a cos_sin_cache row): two 16-byte loads.
__device__ __forceinline__ void load_f8(const float* p, float (&out)[kVec]) {
  const float4 a = load_f4(p), b = load_f4(p + 4);
  out[0] = a.x; out[1] = a.y; out[2] = a.z; out[3] = a.w;
  out[4] = b.x; out[5] = b.y; out[6] = b.z; out[7] = b.w;
}

// Sum over the 8 lanes of one item (xor offsets < 8 never leave the group). Every lane of the warp
// must call this: the mask is the whole warp.
__device__ __forceinline__ float group_sum(float v) {
#pragma unroll
  for (int o = kLanesPerItem / 2; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
  return v;
}

// What rotating one q or k head needs besides its data: its norm weight and its token's cos/sin.
template <typename T>
struct RopeOperands {
  Vec8<T> w1, w2;          // norm weight, elements [8j, 8j+8) and [64+8j, 64+8j+8)
  float c[kVec], s[kVec];  // cos / sin of the same 8 frequencies
};

template <typename T>
__device__ __forceinline__ void load_rope_operands(RopeOperands<T>& op, const T* w,
                                                   const float* cos_sin_row, int lane) {
  op.w1 = load_vec8(w + lane * kVec);
  op.w2 = load_vec8(w + kHalf + lane * kVec);
  load_f8(cos_sin_row + lane * kVec, op.c);
  load_f8(cos_sin_row + kHalf + lane * kVec, op.s);
}

template <typename T, int ITEMS, bool HOIST>
__global__ void __launch_bounds__(kThreads) qk_norm_rope_kernel(
    T* __restrict__ q_out,                     // [num_tokens, Hq, 128] contiguous
    const T* __restrict__ qkv,                 // [num_tokens, (Hq + 2*Hkv) * 128], row stride
                                               //   qkv_stride (elements)
    const T* __restrict__ q_norm_weight,       // [128]
    const T* __restrict__ k_norm_weight,       // [128]
    const float* __restrict__ cos_sin_cache,   // [max_position, 128]: cos | sin halves
    const int64_t* __restrict__ positions,     // [num_tokens]
    T* __restrict__ k_cache,                   // [num_blocks * block_size, Hkv, 128] (flat slots)
    T* __restrict__ v_cache,                   // [num_blocks * block_size, Hkv, 128]
    const int32_t* __restrict__ slot_mapping,  // [num_tokens], -1 = do not write K/V
    uint32_t num_items,                        // num_tokens * (Hq + 2*Hkv), < 2^31
    int64_t qkv_stride, int num_q_heads, int num_kv_heads, float eps) {
  const uint32_t num_heads = num_q_heads + 2 * num_kv_heads;
  const int lane = threadIdx.x % kLanesPerItem;
  // 32-bit item indices (the launcher keeps num_items < 2^31): the token / head split below is a
  // 32-bit division, several times cheaper than a 64-bit one.
  const uint32_t group = blockIdx.x * (kThreads / kLanesPerItem) + threadIdx.x / kLanesPerItem;

  // Phase 1: issue the qkv loads (and per-token scalars) of all this thread's items, before math.
  Vec8<T> lo[ITEMS], hi[ITEMS];
  int64_t token[ITEMS], pos[ITEMS];
  int head[ITEMS];
  int32_t slot[ITEMS];
  bool valid[ITEMS];
#pragma unroll
  for (int r = 0; r < ITEMS; ++r) {
    // Consecutive groups take consecutive items, so a warp reads 4 * ITEMS adjacent heads.
    const uint32_t item = group * ITEMS + r;
    valid[r] = item < num_items;
    const uint32_t tok = item / num_heads;
    token[r] = valid[r] ? tok : 0;
    head[r] = valid[r] ? static_cast<int>(item - tok * num_heads) : 0;
    if (valid[r]) {
      const T* src = qkv + token[r] * qkv_stride + head[r] * kHeadDim + lane * kVec;
      lo[r] = load_vec8(src);
      hi[r] = load_vec8(src + kHalf);
      // Small per-token loads, issued now so the cos/sin fetch below waits on one latency, not two.
      pos[r] = head[r] < num_q_heads + num_kv_heads ? positions[token[r]] : 0;
      slot[r] = head[r] >= num_q_heads ? slot_mapping[token[r]] : -1;
    } else {
      pos[r] = 0;
      slot[r] = -1;
      // Zeros keep the shuffles below well-defined for the tail; nothing is stored for them.
      *reinterpret_cast<uint4*>(&lo[r]) = make_uint4(0, 0, 0, 0);
      *reinterpret_cast<uint4*>(&hi[r]) = make_uint4(0, 0, 0, 0);
    }
  }
  // HOIST: fetch the weights and cos/sin rows now, while the qkv loads are in flight, so an item
  // waits on max(qkv, positions -> cos/sin) rather than qkv + cos/sin: shorter latency for small
  // batches, at the cost of 16 more live registers per item (fewer threads per SM).
  RopeOperands<T> rope[ITEMS];
  if constexpr (HOIST) {
#pragma unroll
    for (int r = 0; r < ITEMS; ++r)
      if (valid[r] && head[r] < num_q_heads + num_kv_heads)
        load_rope_operands(rope[r], head[r] < num_q_heads ? q_norm_weight : k_norm_weight,
                           cos_sin_cache + pos[r] * kHeadDim, lane);
  }

#pragma unroll
  for (int r = 0; r < ITEMS; ++r) {
    const bool is_q = head[r] < num_q_heads;
    const bool is_k = !is_q && head[r] < num_q_heads + num_kv_heads;

    float x1[kVec], x2[kVec];
    float ss = 0.f;
#pragma unroll
    for (int i = 0; i < kVec; ++i) {
      x1[i] = to_float(lo[r].v[i]);
      x2[i] = to_float(hi[r].v[i]);
      ss += x1[i] * x1[i] + x2[i] * x2[i];
    }
    // Computed for v heads too: the shuffle needs every lane of the warp, and branching per
    // group would make the mask data dependent; a few instructions on a bandwidth-bound op.
    ss = group_sum(ss);
    if (!valid[r]) continue;

    if (is_q || is_k) {
      const float inv_rms = rsqrtf(ss * (1.f / kHeadDim) + eps);
      // Not hoisted: L1 hits after the first head of a token (a token's heads share a block).
      if constexpr (!HOIST)
        load_rope_operands(rope[r], is_q ? q_norm_weight : k_norm_weight,
                           cos_sin_cache + pos[r] * kHeadDim, lane);
      const RopeOperands<T>& op = rope[r];

      Vec8<T> o1, o2;
#pragma unroll
      for (int i = 0; i < kVec; ++i) {
        // Same association as the reference: (x * inv_rms) * w, then rotate in fp32.
        const float a = x1[i] * inv_rms * to_float(op.w1.v[i]);
        const float b = x2[i] * inv_rms * to_float(op.w2.v[i]);
        o1.v[i] = from_float<T>(a * op.c[i] - b * op.s[i]);
        o2.v[i] = from_float<T>(b * op.c[i] + a * op.s[i]);
      }
      T* dst;
      if (is_q) {
        dst = q_out + (token[r] * num_q_heads + head[r]) * kHeadDim;
      } else {
        if (slot[r] < 0) continue;  // padded token: q is still produced, the cache is left alone
        dst = k_cache +
              (static_cast<int64_t>(slot[r]) * num_kv_heads + (head[r] - num_q_heads)) * kHeadDim;
      }
      store_vec8(dst + lane * kVec, o1);
      store_vec8(dst + kHalf + lane * kVec, o2);
    } else {
      if (slot[r] < 0) continue;
      T* dst = v_cache + (static_cast<int64_t>(slot[r]) * num_kv_heads +
                          (head[r] - num_q_heads - num_kv_heads)) * kHeadDim;
      store_vec8(dst + lane * kVec, lo[r]);
      store_vec8(dst + kHalf + lane * kVec, hi[r]);
    }
  }
}

bool aligned16(const void* p) { return reinterpret_cast<uintptr_t>(p) % 16 == 0; }

template <typename T, int ITEMS, bool HOIST>
cudaError_t launch(void* q_out, const void* qkv, const void* q_norm_weight,
                   const void* k_norm_weight, const float* cos_sin_cache,
                   const int64_t* positions, void* k_cache,
                   void* v_cache, const int32_t* slot_mapping, int64_t num_items,
                   int64_t qkv_stride, int num_q_heads, int num_kv_heads, float eps,
                   cudaStream_t stream) {
  constexpr int64_t items_per_block = kThreads / kLanesPerItem * ITEMS;
  const int64_t blocks = (num_items + items_per_block - 1) / items_per_block;
  qk_norm_rope_kernel<T, ITEMS, HOIST><<<static_cast<unsigned>(blocks), kThreads, 0, stream>>>(
      static_cast<T*>(q_out), static_cast<const T*>(qkv), static_cast<const T*>(q_norm_weight),
      static_cast<const T*>(k_norm_weight), cos_sin_cache, positions, static_cast<T*>(k_cache),
      static_cast<T*>(v_cache), slot_mapping, static_cast<uint32_t>(num_items), qkv_stride,
      num_q_heads, num_kv_heads, eps);
  return cudaGetLastError();
}

}  // namespace

cudaError_t qk_norm_rope(void* q_out, const void* qkv, const void* q_norm_weight,
                         const void* k_norm_weight, const float* cos_sin_cache,
                         const int64_t* positions, void* k_cache, void* v_cache,
                         const int32_t* slot_mapping, int64_t num_tokens, int64_t qkv_stride,
                         int num_q_heads, int num_kv_heads, int head_dim, float eps, DType dtype,
                         cudaStream_t stream) {
  if (num_tokens <= 1) qkv_stride = 0;  // one row: its stride is never used (and may be anything)
  if (head_dim != kHeadDim || num_q_heads < 1 || num_kv_heads < 1 || num_tokens < 0 ||
      qkv_stride % kVec != 0)
    return cudaErrorInvalidValue;
  // Every tensor is accessed 16 bytes at a time. Fresh allocations and row slices of them are
  // always aligned; only an odd storage offset trips this.
  const void* vector_accessed[] = {q_out,         qkv,     q_norm_weight, k_norm_weight,
                                   cos_sin_cache, k_cache, v_cache};
  for (const void* p : vector_accessed)
    if (!aligned16(p)) return cudaErrorMisalignedAddress;
  if (num_tokens == 0) return cudaSuccess;

  const int64_t num_items = num_tokens * (num_q_heads + 2 * num_kv_heads);
  if (num_items >= (int64_t{1} << 31)) return cudaErrorInvalidValue;  // ~26M tokens at 80 heads
  // Large batches: two items per thread doubles the bytes in flight (bandwidth is all that
  // counts). Small batches: one item per thread spreads the few items over more SMs, and hoisting
  // the weight / cos-sin loads takes one memory latency off the critical path (latency is what
  // counts there). Two hoisted items would need ~110 registers, halving the threads per SM.
  const bool many = num_items >= (int64_t{1} << 16);
  return QWEN3_DISPATCH_HALF(dtype, T, [&] {
    auto run = many ? launch<T, 2, false> : launch<T, 1, true>;
    return run(q_out, qkv, q_norm_weight, k_norm_weight, cos_sin_cache, positions, k_cache, v_cache,
               slot_mapping, num_items, qkv_stride, num_q_heads, num_kv_heads, eps, stream);
  });
}

}  // namespace qwen3_kernels
