// tp_all_reduce / tp_all_reduce_add_rms_norm: a one-shot tensor-parallel all-reduce of a few rows
// over NVLink peer memory, optionally fused with the residual add + RMSNorm that follows every
// row-parallel projection in Qwen3:
//     s = sum over ranks r (in rank order, fp32) of x_r, rounded to the storage dtype
//     plain: x = s        fused: residual = residual + s (rounded); x = rms_norm(residual) * weight
//
// Why: Qwen3-8B TP-2 decode does 72 all-reduces of one [1, 4096] bf16 row a step; NCCL takes
// 12.9 us each inside a CUDA graph and the fused norm is another kernel after it. Here one kernel
// pushes this rank's rows straight into every peer's receive buffer and reduces what arrives.
//
// Buffers. Every rank owns one receive buffer that all peers can write (torch symmetric memory,
// CUDA IPC mappings; no multicast). peer_ptrs[r] is rank r's buffer as mapped in this process.
// Layout, in bytes: [2 halves][world slots][slot_bytes], slot s of half h holds the rows that rank
// s sent in a call of parity h. A row of H elements is H / 2 packets of 8 bytes (below).
//
// Packets (LL, "low latency", as NCCL's LL protocol): each 8-byte packet is 4 data bytes (two
// bf16 / fp16 values) in its low half and a 4-byte flag in its high half, written by ONE aligned
// 64-bit st.relaxed.sys and read by ONE aligned 64-bit ld.relaxed.sys. Memory model (PTX ISA,
// "Memory Consistency Model"): aligned accesses of up to 64 bits are single-copy atomic, and for
// a vector access (we use .v2.b64) that holds per 64-bit element. So a reader that observes a
// packet whose flag is this call's flag observes the whole 64-bit value that one store wrote: the
// data next to the flag is this call's data. No fence and no separate barrier is needed: the flag
// travels in the same access as the data, and nothing else is published. The .sys scope (strong,
// morally strong between the two GPUs) keeps the polling load from being served by a stale L1
// line and the store from being held back indefinitely. We never rely on a 16-byte access being
// atomic as a whole: a v2.b64 may tear between its two packets, and each carries its own flag.
//
// Epochs (CUDA-graph safe: a replay repeats the same kernel arguments, so the call number cannot
// come from the host). counters[0] is this rank's call count c (device memory, zeroed at setup):
// every CTA reads it at the start, and the last CTA to finish (counters[1] counts finished CTAs)
// advances it, so the next kernel in stream order sees c + 1; a grid of one CTA advances it right
// after reading it. Every rank makes the same sequence of calls (TP ranks run the same model), so
// c agrees across ranks without any exchange. A call writes and reads half c & 1 with flag c + 1
// (never 0: the buffer starts zeroed, so a packet never written can never pass; c skips
// 0xFFFFFFFF, keeping the parity alternating).
//
// Why reusing a half is safe: rank A's call c + 2 writes half c & 1 of rank B's buffer, which B
// reads in its call c. A starts call c + 2 only after its call c + 1 has finished (stream order;
// no PDL trigger precedes the wait below), and call c + 1 finishes only after every peer's rows of
// call c + 1 arrived, B's included; B writes those at the start of its own call c + 1, which begins
// only after B's call c finished, reads included (stream order again). So A's writes of call c + 2
// come after B's reads of call c. Stale packets of call c - 2 in a half carry flag c - 1 != c + 1.
// Calls with 0 rows launch nothing and advance nothing, on every rank alike.
//
// Pushed calls (pushed = true, one row; the TP decode default): the GEMV before (tp_gemv_push,
// linear_gemv.cu) already stored this rank's row into the peers' buffers, each warp as soon as
// its outputs were summed, so the row's NVLink trip overlaps the GEMV's tail instead of following
// this kernel's start; this kernel skips its own push and only waits, adds and normalises. The
// GEMV reads the count after its PDL wait, when every earlier call has finished (so it reads c),
// and this call reads and advances it only after the GEMV has finished (its own wait): both agree
// on c. The reuse argument above holds with "B writes those at the start of its call c + 1"
// replaced by "B's GEMV before call c + 1 writes those", which runs after B's call c finished
// (stream order through the kernels between them, each waiting on the one before).
//
// Deadlock freedom: a CTA first writes all of its rows to every peer, then waits. The grid is at
// most one CTA per SM, so every CTA of a rank can be resident; each one's writes never wait on
// anything, hence every awaited packet is eventually written. A dead peer never writes:
//   - abort_flag (pinned host memory, read over PCIe every kAbortEvery polls, so never on the
//     fast path) is set by the host when it learns that a peer died (the engine's worker watch):
//     the kernel then stops waiting and returns normally with meaningless sums, and so does every
//     later call after its first kAbortEvery polls (~ms), so the stream
//     (a CUDA graph's replay included) drains and the host can raise its error. A trap would
//     instead poison the CUDA context, and torch's NCCL watchdog thread, seeing that error
//     first, terminates the process (measured on two H200s).
//   - after kSpinLimit polls of one packet without an abort the kernel traps: the launch fails
//     (the process sees an error) instead of spinning on the GPU forever.
//
// Determinism: every rank adds the same dtype values in the same (rank) order in fp32 and rounds
// the same way, so all ranks get bit-identical x and residual (TP ranks must agree). The sum is
// rounded to the storage dtype before the residual add, exactly as all_reduce + fused_add_rms_norm
// would (at world size 2 that is NCCL's sum too).
//
// Measured (an all-reduce latency probe on branch experiment/one-off-probes, two H200s, graph
// replays of 72 calls, one [1, 4096] bf16 row): 2.7 us plain and 3.8 us fused with the norm, against 3.8 and 4.1 before a one-CTA
// grid advanced the count at its start and loaded its row beside it.
//
// The launch: on sm_90 with programmatic dependent launch (the CTAs are scheduled while the
// projection before drains, and wait (griddepcontrol.wait) before any access); a plain launch
// before sm_90. The plain launch on sm_90 is kept on branch experiment/kernel-launch-variants.
#include <algorithm>
#include <type_traits>

#include "qwen3_kernels/common.cuh"
#include "qwen3_kernels/launch.cuh"

namespace qwen3_kernels {
namespace {

constexpr int kMaxWorld = 8;
constexpr int kMaxVecsPerThread = 4;            // 16-byte vectors (8 elements) per thread
constexpr long long kSpinLimit = 1LL << 26;     // polls of one packet before a trap
constexpr int kAbortEvery = 1 << 12;             // polls between two reads of abort_flag

// One aligned 16-byte store of two packets; each 64-bit element is single-copy atomic.
__device__ __forceinline__ void store_packets(char* p, uint64_t a, uint64_t b) {
  asm volatile("st.relaxed.sys.global.v2.b64 [%0], {%1, %2};\n" ::"l"(p), "l"(a), "l"(b) : "memory");
}
__device__ __forceinline__ void load_packets(const char* p, uint64_t& a, uint64_t& b) {
  asm volatile("ld.relaxed.sys.global.v2.b64 {%0, %1}, [%2];\n" : "=l"(a), "=l"(b) : "l"(p) : "memory");
}
__device__ __forceinline__ uint32_t load_u32_volatile(const uint32_t* p) {
  return *reinterpret_cast<const volatile uint32_t*>(p);
}
// The host's abort word (mapped pinned memory): a system-scope load, never a cached copy.
__device__ __forceinline__ int load_abort(const int32_t* p) {
  int v;
  asm volatile("ld.relaxed.sys.global.s32 %0, [%1];\n" : "=r"(v) : "l"(p) : "memory");
  return v;
}

__device__ __forceinline__ uint64_t packet(uint32_t data, uint32_t flag) {
  return static_cast<uint64_t>(data) | (static_cast<uint64_t>(flag) << 32);
}

// The call count after c: skips 0xFFFFFFFF so that the flag c + 1 is never 0 (parity still
// alternates: 0xFFFFFFFE is even, 1 is odd).
__device__ __forceinline__ uint32_t next_call(uint32_t c) { return c == 0xFFFFFFFEu ? 1u : c + 1u; }

template <typename T>
__device__ __forceinline__ void add_words(float (&acc)[8], const uint32_t (&w)[4], bool first) {
#pragma unroll
  for (int i = 0; i < 4; ++i) {
    T pair[2];
    *reinterpret_cast<uint32_t*>(pair) = w[i];
    const float a = to_float(pair[0]), b = to_float(pair[1]);
    acc[2 * i] = first ? a : acc[2 * i] + a;
    acc[2 * i + 1] = first ? b : acc[2 * i + 1] + b;
  }
}

// grid: min(rows, SMs) CTAs, row r handled by CTA r % gridDim.x; each thread holds kVecs 16-byte
// vectors of a row (vector idx = threadIdx.x + j * blockDim.x).
template <typename T, bool kNorm, int kVecs, bool kPdl>
__global__ void __launch_bounds__(1024)
tp_all_reduce_kernel(T* __restrict__ x,                  // [rows, H] contiguous: partial in, result out
                     T* __restrict__ residual,           // [rows, H] contiguous (kNorm)
                     const T* __restrict__ weight,       // [H] (kNorm)
                     const int64_t* __restrict__ peer_ptrs,  // [world]: each rank's receive buffer
                     uint32_t* counters,                 // [2]: call count, CTAs finished
                     const int32_t* abort_flag,          // [1] host (mapped): != 0 = stop waiting
                     int64_t rows, int64_t hidden, int64_t slot_bytes, int world, int rank,
                     float eps, bool pushed) {
  if constexpr (kPdl) {
    // Nothing (not even the call count) is touched before the previous kernel has finished: it
    // may be this op's previous call, whose last CTA advances the count.
    pdl_wait();
    pdl_launch_dependents();
  }
  // This CTA's first row (grid <= rows) is loaded while thread 0 fetches the call count: two
  // independent L2 round trips instead of two in a row.
  const int nvec = static_cast<int>(hidden / 8);
  uint4 first[kVecs];
#pragma unroll
  for (int j = 0; j < kVecs; ++j) {
    const int idx = threadIdx.x + j * blockDim.x;
    if (idx < nvec) first[j] = *reinterpret_cast<const uint4*>(x + blockIdx.x * hidden + idx * 8);
  }
  __shared__ uint32_t s_call;
  if (threadIdx.x == 0) {
    const uint32_t c = load_u32_volatile(counters);
    s_call = c;
    // One CTA (a decode step's single row): it alone reads the count, so it advances it at once
    // and the end of the kernel needs no barrier, fence or atomic (the next call reads it only
    // after this grid has finished: stream order, or griddepcontrol.wait).
    if (gridDim.x == 1) counters[0] = next_call(c);
  }
  // dest[k]: the buffer of rank (rank + k) % world, k = 1 .. world - 1, in that order so that the
  // ranks do not all hit one GPU first (indexed by the unrolled k only: stays in registers)
  char* dest[kMaxWorld];
#pragma unroll
  for (int k = 1; k < kMaxWorld; ++k) {
    const int p = rank + k < world ? rank + k : rank + k - world;
    dest[k] = k < world ? reinterpret_cast<char*>(peer_ptrs[p]) : nullptr;
  }
  const char* mine = reinterpret_cast<const char*>(peer_ptrs[rank]);
  __syncthreads();
  const uint32_t call = s_call, flag = call + 1u;
  const int64_t half = call & 1u;
  const int64_t row_bytes = hidden * 4;  // LL: 8 packet bytes per 2 elements
  // where rank `src` puts its rows in any buffer, this call
  const int64_t my_slot = (half * world + rank) * slot_bytes;

  // ---- 1. push this rank's rows into slot `rank` of every peer's buffer ----------------------
  // (pushed: the projection before, tp_gemv_push, already did, with this call's flag)
  for (int64_t row = blockIdx.x; !pushed && row < rows; row += gridDim.x) {
#pragma unroll
    for (int j = 0; j < kVecs; ++j) {
      const int idx = threadIdx.x + j * blockDim.x;
      if (idx < nvec) {
        const uint4 v = row == blockIdx.x ? first[j]
                                          : *reinterpret_cast<const uint4*>(x + row * hidden + idx * 8);
        const uint64_t p0 = packet(v.x, flag), p1 = packet(v.y, flag);
        const uint64_t p2 = packet(v.z, flag), p3 = packet(v.w, flag);
        const int64_t off = my_slot + row * row_bytes + idx * 32;
#pragma unroll
        for (int k = 1; k < kMaxWorld; ++k) {
          if (k < world) {
            store_packets(dest[k] + off, p0, p1);
            store_packets(dest[k] + off + 16, p2, p3);
          }
        }
      }
    }
  }

  // ---- 2. wait for every peer's rows, sum in rank order, then the residual add + norm ----------
  // Once this thread has seen the abort word it waits for nothing more (its sums are then
  // meaningless; the host is failing the step anyway).
  bool aborted = false;
  for (int64_t row = blockIdx.x; row < rows; row += gridDim.x) {
    float acc[kVecs][8];
    Vec8<T> res[kVecs], w[kVecs];
#pragma unroll
    for (int j = 0; j < kVecs; ++j) {
      const int idx = threadIdx.x + j * blockDim.x;
      if (idx < nvec) {
        if constexpr (kNorm) {  // issued before the polls: their latency hides behind the wait
          res[j] = load_vec8(residual + row * hidden + idx * 8);
          w[j] = load_vec8(weight + idx * 8);
        }
        // Ranks in order, polling each peer's packets as its turn comes: all peers write at
        // once, so by the time one has arrived the next has too. (Words kept per rank instead
        // would sit in local memory: the poll loop keeps the rank loop from unrolling fully.)
#pragma unroll
        for (int r = 0; r < kMaxWorld; ++r) {
          if (r >= world) break;
          uint32_t words[4];
          if (r == rank) {
            const uint4 v = row == blockIdx.x
                                ? first[j]
                                : *reinterpret_cast<const uint4*>(x + row * hidden + idx * 8);
            words[0] = v.x;
            words[1] = v.y;
            words[2] = v.z;
            words[3] = v.w;
          } else {
            const char* src = mine + (half * world + r) * slot_bytes + row * row_bytes + idx * 32;
            uint64_t a = 0, b = 0, c = 0, d = 0;
            long long polls = 0;
            while (!aborted) {
              load_packets(src, a, b);
              load_packets(src + 16, c, d);
              if (static_cast<uint32_t>(a >> 32) == flag && static_cast<uint32_t>(b >> 32) == flag &&
                  static_cast<uint32_t>(c >> 32) == flag && static_cast<uint32_t>(d >> 32) == flag)
                break;
              if (++polls % kAbortEvery == 0) {
                aborted = load_abort(abort_flag) != 0;      // the host says a peer is gone
                if (polls > kSpinLimit && !aborted) __trap();  // nobody said so: fail, do not hang
              }
            }
            words[0] = static_cast<uint32_t>(a);
            words[1] = static_cast<uint32_t>(b);
            words[2] = static_cast<uint32_t>(c);
            words[3] = static_cast<uint32_t>(d);
          }
          add_words<T>(acc[j], words, r == 0);
        }
      }
    }
    float sumsq = 0.0f;
    Vec8<T> out[kVecs];
#pragma unroll
    for (int j = 0; j < kVecs; ++j) {
      const int idx = threadIdx.x + j * blockDim.x;
      if (idx < nvec) {
#pragma unroll
        for (int i = 0; i < 8; ++i) {
          const T s = from_float<T>(acc[j][i]);  // the all-reduce's output, in the storage dtype
          if constexpr (kNorm) {
            const T v = from_float<T>(to_float(s) + to_float(res[j].v[i]));
            res[j].v[i] = v;
            const float f = to_float(v);
            sumsq += f * f;
          } else {
            out[j].v[i] = s;
          }
        }
        if constexpr (kNorm) {
          store_vec8(residual + row * hidden + idx * 8, res[j]);
        } else {
          store_vec8(x + row * hidden + idx * 8, out[j]);
        }
      }
    }
    if constexpr (kNorm) {
      const float inv_rms = rsqrtf(block_sum(sumsq) / static_cast<float>(hidden) + eps);
#pragma unroll
      for (int j = 0; j < kVecs; ++j) {
        const int idx = threadIdx.x + j * blockDim.x;
        if (idx < nvec) {
#pragma unroll
          for (int i = 0; i < 8; ++i)
            out[j].v[i] = from_float<T>(to_float(res[j].v[i]) * inv_rms * to_float(w[j].v[i]));
          store_vec8(x + row * hidden + idx * 8, out[j]);
        }
      }
    }
  }

  // ---- 3. the last CTA to finish advances the call count (read by every CTA above) ------------
  if (gridDim.x == 1) return;  // advanced at the start
  __syncthreads();
  if (threadIdx.x == 0) {
    __threadfence();
    const uint32_t done = atomicAdd(counters + 1, 1u);
    if (done == gridDim.x - 1) {  // every CTA has read s_call: safe to advance
      counters[1] = 0;
      counters[0] = next_call(call);
      __threadfence();
    }
  }
}

}  // namespace

cudaError_t tp_all_reduce(void* x, void* residual, const void* weight, const int64_t* peer_ptrs,
                          uint32_t* counters, const int32_t* abort_flag, int64_t num_tokens,
                          int64_t hidden, int64_t slot_bytes, int world, int rank,
                          bool add_rms_norm, float eps, DType dtype, cudaStream_t stream,
                          bool pushed) {
  if (num_tokens == 0) return cudaSuccess;
  if (abort_flag == nullptr || (pushed && num_tokens != 1)) return cudaErrorInvalidValue;
  const int64_t nvec = hidden / 8;
  if (world < 2 || world > kMaxWorld || rank < 0 || rank >= world || hidden <= 0 ||
      hidden % 8 != 0 || nvec > int64_t{kMaxVecsPerThread} * 1024 || slot_bytes % 32 != 0 ||
      num_tokens * hidden * 4 > slot_bytes)
    return cudaErrorInvalidValue;
  const DeviceInfo info = current_device_info();
  const int max_ctas = info.num_sms > 0 ? info.num_sms : 1;
  const dim3 grid(static_cast<unsigned>(std::min<int64_t>(num_tokens, max_ctas)));
  int vecs = 1;
  while (nvec > int64_t{vecs} * 1024) vecs *= 2;
  const int threads = std::max<int>(64, static_cast<int>((nvec + vecs - 1) / vecs + 31) / 32 * 32);
  const bool pdl = info.cc_major >= 9;
  return QWEN3_DISPATCH_HALF(dtype, T, [&] {
    T* xi = static_cast<T*>(x);
    T* res = static_cast<T*>(residual);
    const T* wi = static_cast<const T*>(weight);
    auto go = [&](auto kv, auto knorm) -> cudaError_t {
      constexpr int V = decltype(kv)::value;
      constexpr bool N = decltype(knorm)::value;
      if (pdl) {
        return launch_ex(tp_all_reduce_kernel<T, N, V, true>, grid, dim3(threads), stream, true, 1,
                         xi, res, wi, peer_ptrs, counters, abort_flag, num_tokens, hidden,
                         slot_bytes, world, rank, eps, pushed);
      }
      tp_all_reduce_kernel<T, N, V, false><<<grid, threads, 0, stream>>>(
          xi, res, wi, peer_ptrs, counters, abort_flag, num_tokens, hidden, slot_bytes, world,
          rank, eps, pushed);
      return cudaGetLastError();
    };
    auto by_vecs = [&](auto knorm) -> cudaError_t {
      if (vecs == 1) return go(std::integral_constant<int, 1>{}, knorm);
      if (vecs == 2) return go(std::integral_constant<int, 2>{}, knorm);
      return go(std::integral_constant<int, 4>{}, knorm);
    };
    return add_rms_norm ? by_vecs(std::true_type{}) : by_vecs(std::false_type{});
  });
}

}  // namespace qwen3_kernels
