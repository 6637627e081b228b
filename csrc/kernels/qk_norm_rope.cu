// qk_norm_rope: Qwen3's per-head RMSNorm (q_norm / k_norm) + neox RoPE on the packed QKV output of
// the QKV projection, with K and V written straight into the paged KV cache. One pass: qkv is read
// once, q written once, K and V written once; nothing else of size touches memory.
//
// Spec: qwen3_kernels/reference.py::qk_norm_rope (fp32 math, outputs rounded to the input dtype).
//
// head_dim is fixed at 128 (every Qwen3 model). The launcher returns cudaErrorInvalidValue for any
// other head_dim; the Python wrapper (qwen3_kernels/ops.py) runs the reference for those instead.
//
// Lane layout shared by every variant: eight lanes own one head; lane j holds elements
// [8j, 8j+8) of the first half and [64+8j, 64+8j+8) of the second half (two 16-byte accesses), so
// each lane holds both elements of every neox pair (i, i+64) it rotates and RoPE needs no
// shuffles. The RMS over the 128 elements is a 3-step xor-shuffle within the 8-lane group. Lane j
// needs the same 8 cos/sin values and weight elements for every head of a token, which the
// token-major variants exploit.
//
// Two kernels, picked from the shape in qk_norm_rope() at the bottom of the file: token_pdl for
// >= 2^16 (token, head) items, item below (numbers from python benchmarks/bench_qk_norm_rope.py,
// H200, Hq/Hkv 32/8):
//   item    An "item" is one (token, head); consecutive 8-lane groups take consecutive items, ITEMS
//           per thread (2 for large batches, 1 for small ones, which also hoists the cos/sin and
//           weight loads). Measured on H200 at T=16384, Hq/Hkv 32/8: 113 us, 3.63 TB/s, 84% of
//           the read ceiling. Why not more: ~61 registers -> 64 B of qkv in flight per thread, and
//           each item fetches its cos/sin row (and weights) only after its qkv arrived, from L1
//           for most heads but from L2/HBM for the first head of a token in a CTA: a second,
//           dependent memory latency during which the CTA has no qkv bytes in flight. Each q/k
//           item also re-reads 512 B of cos/sin and 256 B of weight through L1 for 256 B of data.
//   token   One CTA per token; group g takes heads g, g+G, g+2G, ... (at most 4): 128 B of qkv
//           in flight per thread at 64 registers. The cos/sin row and both weights are staged in
//           shared memory once per token instead of once per head; all qkv loads are issued
//           before the thread waits on the position -> cos/sin chain.
//   token_pdl  token launched with PDL (sm_90): waits (griddepcontrol.wait) before its first read,
//           so its launch and first CTAs overlap the kernel before (the QKV GEMM in a model, the
//           previous call in a benchmark). H200, T=16384, 8B heads: 100.75 us (4.08 TB/s) against
//           token's 101.50 without PDL (best of 4, alternating); at T <= 256 0.5-0.7 us under
//           token. With L2 hints on top (qkv evict-first, the shared cos/sin table evict-last) it
//           was 3-4% slower (104.2-104.8 us), so there are none.
// Tried and removed (the code is in git history, e.g. 2d49bf4): token8 (at
// most 8 heads a thread, ~120 registers: 111.3 us at T=16384), pipe / pipe4 (a CTA walks a run of
// tokens, the next token's cos/sin row fetched by cp.async while its qkv loads fly: 116.4 us),
// bulk / bulk2 / bulk8 (sm_90 bulk copies through a ring of 2-8 shared-memory stages, q / K / V
// leaving as bulk stores: 113.9 us), token_cs (streaming cache operators: 106.3 us); token then
// took 103.7-105.4 us without PDL.
// Every variant does the same fp32 math per element and rounds once (norm_rope / the item loop).
//
// KV cache in e4m3 (KV = uint8_t, an fp8 cache; launchers.h KvCache): K is quantized from its fp32
// value after the rotation, V from qkv's value, each as x * (1 / scale) rounded to the nearest e4m3
// and saturated (reference.quantize_kv; the reciprocal rounded to fp32 once, on the host), 8 bytes
// a lane where the 16-bit cache takes 16; q is unchanged.
//
// Not checked on the device (the launcher has no bounds to check against, and a check would need a
// host sync): positions must be < max_position, and slots < num_blocks * block_size.
// The launcher refuses (cudaErrorMisalignedAddress) pointers off a 16-byte boundary, and
// num_tokens * (Hq + 2*Hkv) >= 2^31 (cudaErrorInvalidValue).
#include "qwen3_kernels/common.cuh"
#include "qwen3_kernels/e4m3.cuh"
#include "qwen3_kernels/launch.cuh"
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

// One lane's 8 elements of a q, K or V row, from fp32: rounded to the 16-bit dtype, or quantized
// to e4m3 as x * inv_scale (an fp8 cache).
template <typename T>
__device__ __forceinline__ void store_kv8(T* dst, const float (&f)[kVec], float /*inv_scale*/) {
  Vec8<T> o;
#pragma unroll
  for (int i = 0; i < kVec; ++i) o.v[i] = from_float<T>(f[i]);
  store_vec8(dst, o);
}
__device__ __forceinline__ void store_kv8(uint8_t* dst, const float (&f)[kVec], float inv_scale) {
  uint32_t q[2] = {0u, 0u};
#pragma unroll
  for (int i = 0; i < kVec / 2; ++i)
    q[i / 2] |= fp8::e4m3x2_scaled(f[2 * i], f[2 * i + 1], inv_scale) << (16 * (i % 2));
  *reinterpret_cast<uint2*>(dst) = make_uint2(q[0], q[1]);
}
// A lane's V elements (qkv's 16-bit values): copied as they are into a 16-bit cache, quantized
// into an fp8 one.
template <typename T>
__device__ __forceinline__ void store_v(T* dst, const Vec8<T>& lo, const Vec8<T>& hi, float) {
  store_vec8(dst, lo);
  store_vec8(dst + kHalf, hi);
}
template <typename T>
__device__ __forceinline__ void store_v(uint8_t* dst, const Vec8<T>& lo, const Vec8<T>& hi,
                                        float inv_scale) {
  float f1[kVec], f2[kVec];
#pragma unroll
  for (int i = 0; i < kVec; ++i) {
    f1[i] = to_float(lo.v[i]);
    f2[i] = to_float(hi.v[i]);
  }
  store_kv8(dst, f1, inv_scale);
  store_kv8(dst + kHalf, f2, inv_scale);
}

template <typename T, typename KV, int ITEMS, bool HOIST>
__global__ void __launch_bounds__(kThreads) qk_norm_rope_kernel(
    T* __restrict__ q_out,                     // [num_tokens, Hq, 128] contiguous
    const T* __restrict__ qkv,                 // [num_tokens, (Hq + 2*Hkv) * 128], row stride
                                               //   qkv_stride (elements)
    const T* __restrict__ q_norm_weight,       // [128]
    const T* __restrict__ k_norm_weight,       // [128]
    const float* __restrict__ cos_sin_cache,   // [max_position, 128]: cos | sin halves
    const int64_t* __restrict__ positions,     // [num_tokens]
    KV* __restrict__ k_cache,                  // [num_blocks * block_size, Hkv, 128] (flat slots)
    KV* __restrict__ v_cache,                  // [num_blocks * block_size, Hkv, 128]
    const int32_t* __restrict__ slot_mapping,  // [num_tokens], -1 = do not write K/V
    int64_t num_slots,                         // a slot outside [0, num_slots) is not written
    uint32_t num_items,                        // num_tokens * (Hq + 2*Hkv), < 2^31
    int64_t qkv_stride, int num_q_heads, int num_kv_heads, float eps, float inv_k_scale,
    float inv_v_scale) {
  // Launched with PDL on sm_90 (launch_item): scheduled while the QKV GEMM drains, and nothing is
  // read before it has finished; the attention after it may launch at once (its own wait waits
  // for this grid). No-ops for a plain launch.
  pdl_launch_dependents();
  pdl_wait();
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
      if (slot[r] >= num_slots) slot[r] = -1;  // never a write outside the cache (unchecked calls)
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
      float o1[kVec], o2[kVec];
#pragma unroll
      for (int i = 0; i < kVec; ++i) {
        // Same association as the reference: (x * inv_rms) * w, then rotate in fp32.
        const float a = x1[i] * inv_rms * to_float(op.w1.v[i]);
        const float b = x2[i] * inv_rms * to_float(op.w2.v[i]);
        o1[i] = a * op.c[i] - b * op.s[i];
        o2[i] = b * op.c[i] + a * op.s[i];
      }
      if (is_q) {
        T* dst = q_out + (token[r] * num_q_heads + head[r]) * kHeadDim;
        store_kv8(dst + lane * kVec, o1, 1.f);
        store_kv8(dst + kHalf + lane * kVec, o2, 1.f);
      } else {
        if (slot[r] < 0) continue;  // padded token: q is still produced, the cache is left alone
        KV* dst = k_cache + (static_cast<int64_t>(slot[r]) * num_kv_heads +
                             (head[r] - num_q_heads)) * kHeadDim;
        store_kv8(dst + lane * kVec, o1, inv_k_scale);
        store_kv8(dst + kHalf + lane * kVec, o2, inv_k_scale);
      }
    } else {
      if (slot[r] < 0) continue;
      KV* dst = v_cache + (static_cast<int64_t>(slot[r]) * num_kv_heads +
                           (head[r] - num_q_heads - num_kv_heads)) * kHeadDim;
      store_v(dst + lane * kVec, lo[r], hi[r], inv_v_scale);
    }
  }
}

// Per-lane norm + rotation of one q or k head: (x * inv_rms) * w, then the neox pair rotation, in
// fp32, the same association as the item kernel and the reference.
template <typename T>
__device__ __forceinline__ void norm_rope(const Vec8<T>& lo, const Vec8<T>& hi, float inv_rms,
                                          const Vec8<T>& w1, const Vec8<T>& w2,
                                          const float (&c)[kVec], const float (&s)[kVec],
                                          float (&o1)[kVec], float (&o2)[kVec]) {
#pragma unroll
  for (int i = 0; i < kVec; ++i) {
    const float a = to_float(lo.v[i]) * inv_rms * to_float(w1.v[i]);
    const float b = to_float(hi.v[i]) * inv_rms * to_float(w2.v[i]);
    o1[i] = a * c[i] - b * s[i];
    o2[i] = b * c[i] + a * s[i];
  }
}

template <typename T>
__device__ __forceinline__ float sum_squares(const Vec8<T>& lo, const Vec8<T>& hi) {
  float ss = 0.f;
#pragma unroll
  for (int i = 0; i < kVec; ++i) {
    const float a = to_float(lo.v[i]), b = to_float(hi.v[i]);
    ss += a * a + b * b;
  }
  return ss;
}

template <typename T>
__device__ __forceinline__ Vec8<T> zero_vec8() {
  Vec8<T> r;
  *reinterpret_cast<uint4*>(&r) = make_uint4(0, 0, 0, 0);
  return r;
}

// ---- token: one CTA per token ----------------------------------------------------------------

constexpr int kTokenMaxThreads = 256;
constexpr int kHeadsPerThread = 4;  // 128 B of qkv in flight per thread at 64 registers

// Held to 64 registers (bf16 needs 64 anyway; fp16 would take 78 and lose a sixth of the CTAs per
// SM for a few bytes of spill). kPdl: launched with PDL (sm_90), waiting before the first read.
template <typename T, typename KV, bool kPdl>
__global__ void __launch_bounds__(kTokenMaxThreads, 4) qk_norm_rope_token_kernel(
    T* __restrict__ q_out,                     // [num_tokens, Hq, 128] contiguous
    const T* __restrict__ qkv,                 // [num_tokens, (Hq + 2*Hkv) * 128], row stride
                                               //   qkv_stride (elements)
    const T* __restrict__ q_norm_weight,       // [128]
    const T* __restrict__ k_norm_weight,       // [128]
    const float* __restrict__ cos_sin_cache,   // [max_position, 128]: cos | sin halves
    const int64_t* __restrict__ positions,     // [num_tokens]
    KV* __restrict__ k_cache,                  // [num_blocks * block_size, Hkv, 128] (flat slots)
    KV* __restrict__ v_cache,                  // [num_blocks * block_size, Hkv, 128]
    const int32_t* __restrict__ slot_mapping,  // [num_tokens], -1 = do not write K/V
    int64_t num_slots,                         // a slot outside [0, num_slots) is not written
    int64_t qkv_stride, int num_q_heads, int num_kv_heads, float eps, float inv_k_scale,
    float inv_v_scale) {
  // The token's cos/sin row and both weights, staged once per CTA: in registers they would cost
  // 32 per thread (spills or half the occupancy); a shared-memory read per head is ~30 cycles, off
  // the memory critical path.
  __shared__ __align__(16) float cs_s[kHeadDim];      // cos | sin
  __shared__ __align__(16) T w_s[2][kHeadDim];        // q_norm, k_norm
  const int num_heads = num_q_heads + 2 * num_kv_heads;
  const int num_qk = num_q_heads + num_kv_heads;
  const int lane = threadIdx.x % kLanesPerItem;
  const int group = threadIdx.x / kLanesPerItem;
  const int num_groups = blockDim.x / kLanesPerItem;  // >= heads / kHeadsPerThread (launcher)
  const int64_t token = blockIdx.x;
  if constexpr (kPdl) {
    // The attention may launch at once (its own wait waits for this grid), and the kernels after
    // it in turn: o_proj's weight then streams during this chain.
    pdl_launch_dependents();
    pdl_wait();  // qkv is the previous kernel's output
  }

  // Issue order: the position first (the cos/sin fetch waits on it), then every qkv load, then
  // the cos/sin and weight loads, so the position's latency hides under the qkv loads and the
  // thread waits on one memory latency in all.
  const int64_t pos = positions[token];
  const int32_t slot_in = slot_mapping[token];
  // never a write outside the cache (an unchecked call's slot past it is skipped like -1)
  const int32_t slot = slot_in < num_slots ? slot_in : -1;
  const T* row = qkv + token * qkv_stride + lane * kVec;
  Vec8<T> lo[kHeadsPerThread], hi[kHeadsPerThread];
#pragma unroll
  for (int r = 0; r < kHeadsPerThread; ++r) {
    const int h = group + r * num_groups;
    if (h < num_heads) {
      lo[r] = load_vec8(row + h * kHeadDim);
      hi[r] = load_vec8(row + h * kHeadDim + kHalf);
    } else {  // zeros keep the shuffles well-defined; nothing is stored for them
      lo[r] = zero_vec8<T>();
      hi[r] = zero_vec8<T>();
    }
  }
  // 64 16-byte chunks: 32 of cos/sin, 16 of each weight.
  for (int i = threadIdx.x; i < 64; i += blockDim.x) {
    uint4 v;
    if (i < 32)
      v = *reinterpret_cast<const uint4*>(cos_sin_cache + pos * kHeadDim + i * 4);
    else
      v = *reinterpret_cast<const uint4*>((i < 48 ? q_norm_weight : k_norm_weight) +
                                          (i % 16) * kVec);
    if (i < 32)
      *reinterpret_cast<uint4*>(cs_s + i * 4) = v;
    else
      *reinterpret_cast<uint4*>(&w_s[i >= 48][(i % 16) * kVec]) = v;
  }
  __syncthreads();
  // This lane's 16-byte column of the token's q row and of its K / V cache rows (32-bit head
  // offsets from here on).
  const int64_t kv_offset = static_cast<int64_t>(slot < 0 ? 0 : slot) * num_kv_heads * kHeadDim;
  T* q_row = q_out + token * num_q_heads * kHeadDim + lane * kVec;
  KV* k_row = k_cache + kv_offset + lane * kVec;
  KV* v_row = v_cache + kv_offset + lane * kVec;

#pragma unroll
  for (int r = 0; r < kHeadsPerThread; ++r) {
    const int h = group + r * num_groups;
    // Every lane shuffles (the mask is the whole warp), including lanes past the last head.
    const float ss = group_sum(sum_squares(lo[r], hi[r]));
    if (h >= num_heads) continue;
    if (h < num_qk) {
      const bool is_q = h < num_q_heads;
      if (!is_q && slot < 0) continue;  // padded token: q is still produced, the cache left alone
      const float inv_rms = rsqrtf(ss * (1.f / kHeadDim) + eps);
      float c[kVec], s[kVec];
      load_f8(cs_s + lane * kVec, c);
      load_f8(cs_s + kHalf + lane * kVec, s);
      const T* w = w_s[is_q ? 0 : 1];
      float o1[kVec], o2[kVec];
      norm_rope(lo[r], hi[r], inv_rms, load_vec8(w + lane * kVec),
                load_vec8(w + kHalf + lane * kVec), c, s, o1, o2);
      if (is_q) {
        T* dst = q_row + h * kHeadDim;
        store_kv8(dst, o1, 1.f);
        store_kv8(dst + kHalf, o2, 1.f);
      } else {
        KV* dst = k_row + (h - num_q_heads) * kHeadDim;
        store_kv8(dst, o1, inv_k_scale);
        store_kv8(dst + kHalf, o2, inv_k_scale);
      }
    } else {
      if (slot < 0) continue;
      store_v(v_row + (h - num_qk) * kHeadDim, lo[r], hi[r], inv_v_scale);
    }
  }
}

// ---- launch -----------------------------------------------------------------------------------

struct Args {
  void* q_out;
  const void* qkv;
  const void* q_norm_weight;
  const void* k_norm_weight;
  const float* cos_sin_cache;
  const int64_t* positions;
  void* k_cache;
  void* v_cache;
  const int32_t* slot_mapping;
  int64_t num_slots, num_tokens, qkv_stride;
  int num_q_heads, num_kv_heads;
  float eps;
  KvCache kv;
  cudaStream_t stream;
  int num_heads() const { return num_q_heads + 2 * num_kv_heads; }
};

template <typename T, typename KV, int ITEMS, bool HOIST>
cudaError_t launch_item(const Args& a) {
  const int64_t num_items = a.num_tokens * a.num_heads();
  if (num_items >= (int64_t{1} << 31)) return cudaErrorInvalidValue;  // ~26M tokens at 80 heads
  constexpr int64_t items_per_block = kThreads / kLanesPerItem * ITEMS;
  const int64_t blocks = (num_items + items_per_block - 1) / items_per_block;
  // PDL on sm_90: the decode step's small launches (this one is 1..2 CTAs at batch 1) then hide
  // behind the GEMM before them.
  const bool pdl = current_device_info().cc_major >= 9;
  return launch_ex(qk_norm_rope_kernel<T, KV, ITEMS, HOIST>,
                   dim3(static_cast<unsigned>(blocks)), dim3(kThreads), a.stream, pdl, 1,
                   static_cast<T*>(a.q_out), static_cast<const T*>(a.qkv),
                   static_cast<const T*>(a.q_norm_weight), static_cast<const T*>(a.k_norm_weight),
                   a.cos_sin_cache, a.positions, static_cast<KV*>(a.k_cache),
                   static_cast<KV*>(a.v_cache), a.slot_mapping, a.num_slots,
                   static_cast<uint32_t>(num_items), a.qkv_stride, a.num_q_heads,
                   a.num_kv_heads, a.eps, 1.f / a.kv.k_scale, 1.f / a.kv.v_scale);
}

// Groups of 8 lanes a token-major CTA needs for at most hpt heads each, in whole warps.
int token_groups(int num_heads, int hpt) {
  const int groups = (num_heads + hpt - 1) / hpt;
  return (groups + 3) / 4 * 4;
}

// Launched with PDL on sm_90 (token_pdl; the kernel's kPdl makes it wait before its first read).
template <typename T, typename KV>
cudaError_t launch_token(const Args& a) {
  const int threads = token_groups(a.num_heads(), kHeadsPerThread) * kLanesPerItem;
  if (a.num_tokens > 0x7fffffff || threads > kTokenMaxThreads) return cudaErrorInvalidValue;
  const bool pdl = current_device_info().cc_major >= 9;
  return launch_ex(qk_norm_rope_token_kernel<T, KV, true>,
                   dim3(static_cast<unsigned>(a.num_tokens)), dim3(threads), a.stream, pdl, 1,
                   static_cast<T*>(a.q_out), static_cast<const T*>(a.qkv),
                   static_cast<const T*>(a.q_norm_weight), static_cast<const T*>(a.k_norm_weight),
                   a.cos_sin_cache, a.positions, static_cast<KV*>(a.k_cache),
                   static_cast<KV*>(a.v_cache), a.slot_mapping, a.num_slots, a.qkv_stride,
                   a.num_q_heads, a.num_kv_heads, a.eps, 1.f / a.kv.k_scale, 1.f / a.kv.v_scale);
}

}  // namespace

cudaError_t qk_norm_rope(void* q_out, const void* qkv, const void* q_norm_weight,
                         const void* k_norm_weight, const float* cos_sin_cache,
                         const int64_t* positions, void* k_cache, void* v_cache,
                         const int32_t* slot_mapping, int64_t num_slots, int64_t num_tokens,
                         int64_t qkv_stride,
                         int num_q_heads, int num_kv_heads, int head_dim, float eps, DType dtype,
                         KvCache kv, cudaStream_t stream) {
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
  const int num_heads = num_q_heads + 2 * num_kv_heads;
  if (num_tokens * num_heads >= (int64_t{1} << 31)) return cudaErrorInvalidValue;

  const Args a{q_out,      qkv,         q_norm_weight, k_norm_weight, cos_sin_cache,
               positions,  k_cache,     v_cache,       slot_mapping,  num_slots,
               num_tokens, qkv_stride,  num_q_heads,   num_kv_heads,  eps, kv, stream};
  // Large batches are bandwidth bound, small ones latency bound (see the item kernel's ITEMS).
  const bool many = num_tokens * num_heads >= (int64_t{1} << 16);

  // The H200 sweeps (bench_qk_norm_rope.py, 32/8 heads): at T=16384 token 105.4 us (3.90 TB/s)
  // vs item 112.8, and token_pdl 100.75 vs token 101.50 (alternating); at T <= 256 item (1.3-3.3
  // us) beats every token-major kernel (2.2-4.9 us). The token kernel needs a token's head groups
  // in one CTA of <= 256 threads (<= 128 heads: every Qwen3 model has <= 80, Hq + 2 Hkv); past
  // that the item kernel runs.
  const bool token =
      many && token_groups(num_heads, kHeadsPerThread) * kLanesPerItem <= kTokenMaxThreads;
  // The cache's element type: the model dtype, or e4m3 bytes (an fp8 cache).
  auto launch = [&](auto t_tag, auto kv_tag) {
    using T = decltype(t_tag);
    using KV = decltype(kv_tag);
    if (token) return launch_token<T, KV>(a);
    // Large batches: two items per thread doubles the bytes in flight. Small batches: one item
    // per thread spreads the few items over more SMs, and hoisting the weight / cos-sin loads
    // takes one memory latency off the critical path (latency is what counts there). Two hoisted
    // items would need ~110 registers, halving the threads per SM.
    return many ? launch_item<T, KV, 2, false>(a) : launch_item<T, KV, 1, true>(a);
  };
  return QWEN3_DISPATCH_HALF(dtype, T, [&] {
    return kv.fp8 ? launch(T(), uint8_t()) : launch(T(), T());
  });
}

}  // namespace qwen3_kernels
