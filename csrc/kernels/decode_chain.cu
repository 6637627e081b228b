// decode_chain: one token (batch 1) from a layer's attention output to the next layer's packed
// QKV in one persistent kernel, so the weights stream without the gaps between launches.
//
//   o      = attn @ W_o^T                                   [H]   (o_proj)
//   r1     = residual + o;  h = rms_norm(r1) * w_post        [H]   (post_attention_layernorm)
//   act    = silu(h @ W_gate^T) * (h @ W_up^T)               [I]   (gate_up_proj + silu_and_mul)
//   d      = act @ W_down^T                                 [H]   (down_proj)
//   r2     = r1 + d;    x = rms_norm(r2) * w_next           [H]   (next input_layernorm, or the
//                                                                  model's final norm)
//   out    = x @ W_qkv^T (the next layer's qkv_proj), or x when there is no next layer
//   residual <- r2
// Every intermediate is rounded to the dtype where the unfused ops store it, so the chain computes
// what the six launches it replaces compute (reference.decode_chain), up to summation order.
//
// Why one kernel: at batch 1 a decode step is a pass over the weights (Qwen3-8B: 15.1 GB, 3.5 ms at
// the read ceiling), and between the unfused launches the memory system idles: each GEMV's ramp and
// tail, each norm's launch (eleventh session: ~400 us of a 4.56 ms step). Here each warp keeps its
// weight loads in flight across the stage boundaries: a stage's input is needed only to multiply,
// not to load the weight, so the next stage's first loads are on their way while the grid waits
// at the barrier and the norms are rebuilt.
//
// Shape of the kernel:
//   - One CTA of 16 warps per SM (grid = SM count); all CTAs must be resident at once for the grid
//     barriers, which one CTA per SM and nothing else running guarantees in stream order (the
//     kernel never triggers its dependents early).
//   - Every warp owns whole outputs (rows of a weight; gate_up: the pair of rows u and I + u) over
//     the full K: no split-K, no partial sums between warps. Output u of a stage goes to warp
//     u mod (16 x grid), a fixed list known before the kernel starts.
//   - The weights stream as the GEMV streams them (linear_gemv.cu): 16-byte register loads
//     (load_stream: L1 bypassed, 256-byte L2 lines), a lane's 8 loads of a step (4 KB of one row
//     per warp) issued before it multiplies the step before, so 8-16 loads per lane are in
//     flight, across stage boundaries too.
//   - Stages are separated by grid barriers (an arrival count and a generation word in the
//     workspace). After a barrier every CTA rebuilds the next stage's input in shared memory
//     itself (the norms are 4096-wide: redundant work on 132 SMs is cheaper than one more barrier).
//   - x (the stage's input) sits in shared memory as the dtype; each lane reads 16 bytes of it per
//     16 bytes of weight.
//
// Launch variants (QWEN3_CHAIN_VARIANT; qwen3_chain_set_variant for the benchmarks):
//   auto  a plain launch
//   pdl   programmatic dependent launch: each warp's first step of W_o is requested before
//         griddepcontrol.wait, while the kernel before finishes (the weights are never written by
//         it); everything else waits.
//   coop  a cooperative launch: the driver refuses a grid that cannot be resident at once (an
//         error instead of a hang); otherwise the plain launch.
// A wait that lasts 5 s (a lost arrival, a CTA that never became resident) traps: the launch
// fails with an error instead of holding the GPU. QWEN3_CHAIN_DEBUG (read once, bits): 1 such a
// wait gives up instead, the CTA returns and leaves its state in the workspace's barrier words;
// 2 skip the multiply, 4 skip the grid barriers (wrong outputs: timing only); 8 per-CTA globaltimer
// stamps of every stage (benchmarks/decode_chain_stages.py reads them).
//
// Measured (H200, 2026-12-01, thirteenth to fifteenth sessions; benchmarks/RESULTS.md): correct
// (FA3 rule at the 0.6B / 8B / 32B sizes, bit-identical across calls, graphs and variants). A
// Qwen3-8B layer: 110.4-111.1 us against 108.6-109.6 for the six launches it replaces; in the
// engine at batch 1 (QWEN3_DECODE_CHAIN=1) 217.1-217.7 against 219.7-220.1 decode tok/s without
// the chain, so the model runs it only when asked. Earlier forms, all slower and removed: each
// warp streaming its rows through a ring of 8 KB TMA bulk copies in shared memory (131.2-132.9
// us; DRAM at 56% of peak by ncu against the GEMV's 78%), and units drawn from atomic ticket
// counters instead of the fixed lists (135.7 with the ring, 115.8 with register loads; commits
// 318d354, fb44ecc); equal unit counts per CTA did not shorten the stages either (fifteenth). With
// the GEMV's streaming the chain is at par. The attention kernels between the chains stream no
// weight, but hiding them is not enough: without any attention the engine reaches 235 tok/s
// (fifteenth session), so the stages themselves must stream faster (their slowest CTA ends 6-15
// us after the median one; RESULTS.md).
#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <algorithm>
#include <cstdlib>

#include "qwen3_kernels/common.cuh"
#include "qwen3_kernels/launchers.h"
#include "qwen3_kernels/tuning.cuh"

namespace qwen3_kernels {
namespace {

constexpr int kWarps = 16;
constexpr int kThreads = 32 * kWarps;
constexpr int kSlice = 256;       // columns of one 16-byte load across a warp
constexpr int kStepSlices = 8;    // a step: 8 loads per lane, 2048 columns of one row
// sm_90's opt-in limit per block is 227 KB for dynamic + static shared memory together (block_sum's
// partials are static): 1 KB is left for them.
constexpr int kMaxSmem = 226 * 1024;
// count at byte 0, generation at 128, the watchdog's words from 256 (see grid_barrier), the
// debug stamps from 4096
constexpr int64_t kBarrierBytes = 16384;
[[maybe_unused]] constexpr unsigned long long kWatchdogNs = 5000000000ull;

enum Variant { kAuto, kPdl, kCoop, kNumVariants };
constexpr const char* kVariantNames[kNumVariants] = {"auto", "pdl", "coop"};

VariantKnob<kNumVariants>& knob() {
  static VariantKnob<kNumVariants> k("QWEN3_CHAIN_VARIANT", kVariantNames);
  return k;
}

int64_t align256(int64_t b) { return (b + 255) / 256 * 256; }

// Workspace: the barrier words, then o [H], act [I], d [H] as the dtype (the stage outputs every
// CTA reads after a barrier).
struct WorkspaceLayout {
  int64_t o, act, d, total;
  WorkspaceLayout(int64_t hidden, int64_t inter) {
    o = kBarrierBytes;
    act = o + align256(2 * hidden);
    d = act + align256(2 * inter);
    total = d + align256(2 * hidden);
  }
};

template <typename T>
struct ChainArgs {
  T* out;                  // [N] (the next qkv) or [H] (no next layer)
  const T* attn;           // [Q]
  T* residual;             // [H], in: before the layer's attention add; out: r2
  const T* post_norm_w;    // [H]
  const T* next_norm_w;    // [H]
  const T* w[4];           // per stage: W_o [H, Q], W_gate_up [2I, H], W_down [H, I], W_qkv [N, H]
  int k[4];                // per stage: the input length (columns of w)
  int units[4];            // per stage: outputs (gate_up: I, two rows each)
  int num_stages;          // 4, or 3 without a next qkv
  int hidden, inter, max_k;
  float eps;
  uint32_t* barrier;       // [0]: arrivals, [32]: generation
  T* o_buf;                // [H]
  T* act_buf;              // [I]
  T* d_buf;                // [H]
  int debug;               // QWEN3_CHAIN_DEBUG (see the top of the file)
};

__device__ __forceinline__ unsigned long long globaltimer() {
  unsigned long long t;
  asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t));
  return t;
}

__device__ __forceinline__ uint32_t load_acquire(const uint32_t* p) {
  uint32_t v;
  asm volatile("ld.acquire.gpu.global.u32 %0, [%1];" : "=r"(v) : "l"(p) : "memory");
  return v;
}

// Every CTA arrives, the last one resets the count and advances the generation; the others wait
// for the generation to move. The CTA's writes before the barrier are visible to every CTA's reads
// after it (bar.sync, then a gpu-scope fence around the atomics, as cooperative groups' grid sync).
// Returns false when the wait gave up (debug only; otherwise the watchdog traps). Words from byte
// 256: [64] CTAs that gave up, [65] the arrival count one of them saw; [256 + b]: the last barrier
// CTA b entered (1-based), for QWEN3_CHAIN_DEBUG=1 runs.
__device__ bool grid_barrier(uint32_t* barrier, int which, int debug) {
  __shared__ int gave_up;
  __syncthreads();
  if (threadIdx.x == 0) {
    gave_up = 0;
    uint32_t* count = barrier;
    uint32_t* generation = barrier + 32;
    if (debug) atomicExch(barrier + 256 + blockIdx.x, static_cast<uint32_t>(which));
    const uint32_t gen = load_acquire(generation);  // read before arriving: it cannot move yet
    __threadfence();
    if (atomicAdd(count, 1u) == gridDim.x - 1) {
      atomicExch(count, 0u);
      __threadfence();
      atomicAdd(generation, 1u);
    } else {
      const unsigned long long start = globaltimer();
      while (load_acquire(generation) == gen) {
        __nanosleep(64);
        if (globaltimer() - start > kWatchdogNs) {
          if (!debug) __trap();
          atomicAdd(barrier + 64, 1u);
          atomicExch(barrier + 65, load_acquire(count));
          gave_up = 1;
          break;
        }
      }
    }
    __threadfence();
  }
  __syncthreads();
  return gave_up == 0;
}

// Where a warp is in its list of steps: stage s, unit u (its output), row r of the unit (gate_up:
// 0 gate, 1 up), step c of the row. The loads and the multiplies walk the same list, one apart.
struct Cursor {
  int s, u, r, c;
};

// Steps in a row of k columns (the last one may be shorter).
__device__ __forceinline__ int steps_of(int k) {
  return (k / kSlice + kStepSlices - 1) / kStepSlices;
}

// The first unit of this warp at or after stage s (s == num_stages: past the end).
template <typename T>
__device__ __forceinline__ void settle(Cursor& cur, const ChainArgs<T>& a, int warp_id) {
  while (cur.s < a.num_stages && cur.u >= a.units[cur.s]) {
    ++cur.s;
    cur.u = warp_id;
  }
}

template <typename T>
__device__ __forceinline__ void advance(Cursor& cur, const ChainArgs<T>& a, int warp_id, int num_warps) {
  if (++cur.c < steps_of(a.k[cur.s])) return;
  cur.c = 0;
  if (++cur.r < (cur.s == 1 ? 2 : 1)) return;
  cur.r = 0;
  cur.u += num_warps;
  settle(cur, a, warp_id);
}

// Stage input from global memory: dst[0:n] = src (n % 8 == 0); L2 only (another CTA wrote it).
template <typename T>
__device__ __forceinline__ void copy_in(T* dst, const T* src, int n) {
  for (int v = threadIdx.x; v < n / 8; v += blockDim.x)
    *reinterpret_cast<uint4*>(dst + 8 * v) = __ldcg(reinterpret_cast<const uint4*>(src + 8 * v));
}

// res = round(res + add); x = round(rms_norm(res) * w); the whole CTA. The same thread writes and
// reads back each 8-element group, and block_sum's barriers order the rest.
template <typename T>
__device__ void add_norm(T* x, T* res, const T* add, const T* w, int h, float eps) {
  float ss = 0.f;
  for (int v = threadIdx.x; v < h / 8; v += blockDim.x) {
    float fr[8], fa[8];
    const uint4 rv = *reinterpret_cast<const uint4*>(res + 8 * v);
    to_float8<T>(rv, fr);
    to_float8<T>(__ldcg(reinterpret_cast<const uint4*>(add + 8 * v)), fa);
    Vec8<T> out;
#pragma unroll
    for (int e = 0; e < 8; ++e) {
      out.v[e] = from_float<T>(fr[e] + fa[e]);
      const float r = to_float(out.v[e]);
      ss += r * r;
    }
    store_vec8(res + 8 * v, out);
  }
  const float inv = rsqrtf(block_sum(ss) / h + eps);
  for (int v = threadIdx.x; v < h / 8; v += blockDim.x) {
    float fr[8], fw[8];
    to_float8<T>(*reinterpret_cast<const uint4*>(res + 8 * v), fr);
    to_float8<T>(*reinterpret_cast<const uint4*>(w + 8 * v), fw);
    Vec8<T> out;
#pragma unroll
    for (int e = 0; e < 8; ++e) out.v[e] = from_float<T>(fr[e] * inv * fw[e]);
    store_vec8(x + 8 * v, out);
  }
}

// Builds stage s's input in x_s (after the barrier that ends stage s - 1), and at s ==
// num_stages the kernel's own outputs (the residual; out when there is no next qkv).
template <typename T>
__device__ void build_input(int s, const ChainArgs<T>& a, T* x_s, T* res_s) {
  if (s == 1) {
    add_norm(x_s, res_s, a.o_buf, a.post_norm_w, a.hidden, a.eps);
  } else if (s == 2) {
    copy_in(x_s, a.act_buf, a.inter);
  } else {  // s == 3: the next layer's input norm (also the end when there is no qkv)
    add_norm(x_s, res_s, a.d_buf, a.next_norm_w, a.hidden, a.eps);
    if (blockIdx.x == 0) {
      for (int v = threadIdx.x; v < a.hidden / 8; v += blockDim.x) {
        *reinterpret_cast<uint4*>(a.residual + 8 * v) = *reinterpret_cast<const uint4*>(res_s + 8 * v);
        if (a.num_stages == 3)
          *reinterpret_cast<uint4*>(a.out + 8 * v) = *reinterpret_cast<const uint4*>(x_s + 8 * v);
      }
    }
  }
  __syncthreads();
}

template <typename T>
__device__ __forceinline__ void load_step(uint4 (&buf)[kStepSlices], const Cursor& cur,
                                          const ChainArgs<T>& a, int lane) {
  if (cur.s >= a.num_stages) return;
  const int k = a.k[cur.s];
  const int row = cur.u + (cur.r ? a.units[cur.s] : 0);
  const T* src = a.w[cur.s] + static_cast<int64_t>(row) * k + cur.c * kStepSlices * kSlice + lane * 8;
  const int n = min(kStepSlices, k / kSlice - cur.c * kStepSlices);
#pragma unroll
  for (int i = 0; i < kStepSlices; ++i)
    if (i < n) buf[i] = load_stream(src + i * kSlice);
}

// The grid barrier that ends stage s - 1, then stage s's input (stamps: see decode_chain_kernel).
template <typename T>
__device__ __forceinline__ bool next_stage(int s, const ChainArgs<T>& a, T* x_s, T* res_s,
                                           unsigned long long* stamps, bool stamp) {
  if (stamp) stamps[2 * s - 1] = globaltimer();
  if (a.debug & 4) {
    __syncthreads();
  } else if (!grid_barrier(a.barrier, s, a.debug & 1)) {
    return false;
  }
  if (stamp) stamps[2 * s] = globaltimer();
  build_input(s, a, x_s, res_s);
  return true;
}

template <typename T>
__global__ void __launch_bounds__(kThreads, 1) decode_chain_kernel(const ChainArgs<T> a) {
  extern __shared__ __align__(16) char smem[];
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  const int warp_id = blockIdx.x * kWarps + warp;
  const int num_warps = gridDim.x * kWarps;
  // QWEN3_CHAIN_DEBUG bit 3: thread 0 of each CTA stores globaltimer stamps at byte 4096 + 80 *
  // blockIdx.x: [0] the first stage's start (inputs in shared memory), [2s - 1] stage s - 1's end
  // before its barrier, [2s] stage s's start after it, [8] kernel entry, [9] exit.
  unsigned long long* stamps =
      reinterpret_cast<unsigned long long*>(reinterpret_cast<char*>(a.barrier) + 4096) + 10 * blockIdx.x;
  const bool stamp = (a.debug & 8) && threadIdx.x == 0;
  if (stamp) stamps[8] = globaltimer();
  T* x_s = reinterpret_cast<T*>(smem);  // [max_k] the stage's input
  T* res_s = x_s + (a.max_k + 7) / 8 * 8;  // [H] the residual

  // The warp's first step: weights only, so before the PDL wait.
  Cursor prod{0, warp_id, 0, 0};
  settle(prod, a, warp_id);
  uint4 next[kStepSlices];
  load_step(next, prod, a, lane);
  pdl_wait();  // attn and residual are the previous kernels' outputs
  for (int v = threadIdx.x; v < a.k[0] / 8; v += kThreads)
    *reinterpret_cast<uint4*>(x_s + 8 * v) = *reinterpret_cast<const uint4*>(a.attn + 8 * v);
  for (int v = threadIdx.x; v < a.hidden / 8; v += kThreads)
    *reinterpret_cast<uint4*>(res_s + 8 * v) = *reinterpret_cast<const uint4*>(a.residual + 8 * v);
  __syncthreads();
  if (stamp) stamps[0] = globaltimer();

  int stage = 0;
  float acc0 = 0.f, acc1 = 0.f;  // gate (or the one row), up
  float sum[2] = {0.f, 0.f};     // two FMA chains, added up every 4096 columns (two steps)
  while (prod.s < a.num_stages) {
    const Cursor cur = prod;  // this step; its weights are in `next`
    for (; stage < cur.s; ) {  // every stage boundary, also those of stages without a unit here
      if (!next_stage(++stage, a, x_s, res_s, stamps, stamp)) return;
    }
    uint4 now[kStepSlices];
#pragma unroll
    for (int i = 0; i < kStepSlices; ++i) now[i] = next[i];
    advance(prod, a, warp_id, num_warps);
    load_step(next, prod, a, lane);  // in flight while this step multiplies
    const int k = a.k[cur.s], nst = steps_of(k);
    const T* xs = x_s + cur.c * kStepSlices * kSlice + lane * 8;
    const int n = min(kStepSlices, k / kSlice - cur.c * kStepSlices);
#pragma unroll
    for (int i = 0; i < kStepSlices; ++i) {
      if (i < n && !(a.debug & 2)) {
        const uint4 xv = *reinterpret_cast<const uint4*>(xs + i * kSlice);
        float wf[8], xf[8];
        to_float8<T>(now[i], wf);
        to_float8<T>(xv, xf);
#pragma unroll
        for (int e = 0; e < 8; ++e) sum[i & 1] = fmaf(wf[e], xf[e], sum[i & 1]);
      }
    }
    if ((cur.c & 1) || cur.c == nst - 1) {  // two steps (or the row) done
      if (cur.r == 0) acc0 += sum[0] + sum[1]; else acc1 += sum[0] + sum[1];
      sum[0] = sum[1] = 0.f;
    }
    if (cur.c == nst - 1 && cur.r == (cur.s == 1 ? 1 : 0)) {  // the unit is done
      float y = warp_sum(acc0);
      if (cur.s == 1) {
        const float g = to_float(from_float<T>(y));
        const float up = to_float(from_float<T>(warp_sum(acc1)));
        y = g / (1.0f + __expf(-g)) * up;
      }
      T* const dst = cur.s == 0 ? a.o_buf : cur.s == 1 ? a.act_buf : cur.s == 2 ? a.d_buf : a.out;
      if (lane == 0) dst[cur.u] = from_float<T>(y);
      acc0 = acc1 = 0.f;
    }
  }
  while (stage < a.num_stages - 1) {  // the boundaries after this warp's last unit
    if (!next_stage(++stage, a, x_s, res_s, stamps, stamp)) return;
  }
  if (stamp) stamps[2 * a.num_stages - 1] = globaltimer();
  if (a.num_stages == 3) {  // no next qkv: the final norm is the output
    if (!grid_barrier(a.barrier, 3, a.debug & 1)) return;
    if (blockIdx.x == 0) build_input(3, a, x_s, res_s);
  }
  if (stamp) stamps[9] = globaltimer();
}

// Dynamic shared memory: the stage's input [max_k] and the residual [H], 16-bit values.
size_t smem_bytes(int64_t max_k, int64_t hidden) {
  return static_cast<size_t>((max_k + 7) / 8 * 8 + (hidden + 7) / 8 * 8) * 2;
}

template <typename T>
cudaError_t launch(const ChainArgs<T>& a, int grid, int variant, cudaStream_t stream) {
  const size_t smem = smem_bytes(a.max_k, a.hidden);
  auto kernel = decode_chain_kernel<T>;
  static const cudaError_t attr =
      cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, kMaxSmem);
  if (attr != cudaSuccess) return attr;
  LaunchConfig cfg(dim3(grid), dim3(kThreads), smem, stream, variant == kPdl, 1);
  cudaLaunchAttribute coop;
  if (variant == kCoop) {  // the driver checks that the whole grid can be resident at once
    coop.id = cudaLaunchAttributeCooperative;
    coop.val.cooperative = 1;
    cfg.cfg.attrs = &coop;
    cfg.cfg.numAttrs = 1;
  }
  return launch_ex(kernel, cfg, a);
}

}  // namespace

int64_t decode_chain_workspace_bytes(int64_t hidden, int64_t inter) {
  return WorkspaceLayout(hidden, inter).total;
}

bool decode_chain_shape_ok(int64_t hidden, int64_t q_dim, int64_t inter) {
  const int64_t dims[] = {hidden, q_dim, inter};
  for (int64_t d : dims)
    if (d <= 0 || d % kSlice != 0 || d > (1 << 20)) return false;
  return smem_bytes(std::max(hidden, std::max(q_dim, inter)), hidden) <= static_cast<size_t>(kMaxSmem);
}

cudaError_t decode_chain(void* out, const void* attn, void* residual, const void* o_weight,
                         const void* post_norm_weight, const void* gate_up_weight,
                         const void* down_weight, const void* next_norm_weight,
                         const void* next_qkv_weight, int64_t qkv_n, void* workspace,
                         int64_t hidden, int64_t q_dim,
                         int64_t inter, float eps, DType dtype, cudaStream_t stream) {
  const DeviceInfo dev = current_device_info();
  if (dev.cc_major != 9 || !decode_chain_shape_ok(hidden, q_dim, inter)) return cudaErrorNotSupported;
  const int64_t max_k = std::max(hidden, std::max(q_dim, inter));
  const int variant = knob().get();
  static const int debug = [] {  // QWEN3_CHAIN_DEBUG: bit 0 a stuck barrier records and returns; 1-3 timing (kernel)
    const char* e = std::getenv("QWEN3_CHAIN_DEBUG");
    return e != nullptr ? std::atoi(e) : 0;
  }();
  const WorkspaceLayout ws(hidden, inter);
  char* base = static_cast<char*>(workspace);
  return QWEN3_DISPATCH_HALF(dtype, T, [&] {
    ChainArgs<T> a{};
    a.out = static_cast<T*>(out);
    a.attn = static_cast<const T*>(attn);
    a.residual = static_cast<T*>(residual);
    a.post_norm_w = static_cast<const T*>(post_norm_weight);
    a.next_norm_w = static_cast<const T*>(next_norm_weight);
    a.w[0] = static_cast<const T*>(o_weight);
    a.w[1] = static_cast<const T*>(gate_up_weight);
    a.w[2] = static_cast<const T*>(down_weight);
    a.w[3] = static_cast<const T*>(next_qkv_weight);
    a.k[0] = static_cast<int>(q_dim);
    a.k[1] = a.k[3] = static_cast<int>(hidden);
    a.k[2] = static_cast<int>(inter);
    a.units[0] = a.units[2] = static_cast<int>(hidden);
    a.units[1] = static_cast<int>(inter);
    a.units[3] = next_qkv_weight != nullptr ? static_cast<int>(qkv_n) : 0;
    a.num_stages = next_qkv_weight != nullptr ? 4 : 3;
    a.hidden = static_cast<int>(hidden);
    a.inter = static_cast<int>(inter);
    a.max_k = static_cast<int>(max_k);
    a.eps = eps;
    a.barrier = reinterpret_cast<uint32_t*>(base);
    a.o_buf = reinterpret_cast<T*>(base + ws.o);
    a.act_buf = reinterpret_cast<T*>(base + ws.act);
    a.d_buf = reinterpret_cast<T*>(base + ws.d);
    a.debug = debug;
    return launch<T>(a, dev.num_sms, variant, stream);
  });
}

}  // namespace qwen3_kernels

QWEN3_TUNING_HOOKS(qwen3_chain, qwen3_kernels::knob())
