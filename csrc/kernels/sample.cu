// sample_tokens: one token per row of the logits, greedy or sampled, in one pass over the logits.
//
// Sampling is an exponential race (the Gumbel-max trick in another form): with E_i ~ Exp(1)
// independent, argmax_i p_i / E_i is distributed as p = softmax(logits / T). Taking logs,
//   token = argmax_i  logits_i / T - log(E_i),
// which needs neither the softmax nor its normalisation: each logit is read once, scored, and
// reduced to the row's best (score, index). E_i = -log(1 - u_i), u_i from a counter-based hash of
// the row's key (seed lo, seed hi, counter) and the token id i, so a seeded request gets the same
// tokens whatever else is in the batch (the same hash as reference.seeded_exponential).
// Rows with T <= 0 are greedy: score_i = logits_i. Ties go to the lowest index, as torch.argmax.
// The exact score (log1pf, a true division) is what made the kernel compute bound; most tokens
// skip it: a cheap upper bound of their score (Scorer::bound) below the warp's best so far means
// they cannot win. The token chosen is the same as without the skip.
//
// Work split: CTA (row, split) scans one contiguous chunk of the row, so a small batch still covers
// the SMs (batch 1 with a 152k vocab is 64 CTAs, not one); with splits > 1 the chunks' bests go to
// the workspace and a one-warp-per-row pass picks each row's winner.
#include <cfloat>
#include <climits>

#include "qwen3_kernels/common.cuh"

namespace qwen3_kernels {
namespace {

constexpr int kThreads = 256;

// murmur3's 32-bit finaliser (the reference's _mix32)
__device__ __forceinline__ uint32_t mix32(uint32_t x) {
  x ^= x >> 16;
  x *= 0x85EBCA6Bu;
  x ^= x >> 13;
  x *= 0xC2B2AE35u;
  x ^= x >> 16;
  return x;
}

__device__ __forceinline__ float load_one(const float* p) { return *p; }
template <typename T>
__device__ __forceinline__ float load_one(const T* p) { return to_float(*p); }

// (score, index) pairs: a beats b when its score is higher, or equal with a lower index
__device__ __forceinline__ bool beats(float sa, int ia, float sb, int ib) {
  return sa > sb || (sa == sb && ia < ib);
}

__device__ __forceinline__ void warp_best(float& s, int& i) {
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) {
    const float so = __shfl_xor_sync(0xffffffffu, s, o);
    const int io = __shfl_xor_sync(0xffffffffu, i, o);
    if (beats(so, io, s, i)) s = so, i = io;
  }
}

struct Scorer {
  bool greedy;
  bool bounded;  // the cheap bound below may skip tokens (temperatures where its margin holds)
  float temperature, inv_temperature;
  uint32_t row_key;

  // the token's 32-bit hash: E's only input besides the row
  __device__ __forceinline__ uint32_t hash(uint32_t token) const {
    const uint32_t col = mix32(token * 0x27D4EB2Fu ^ 0x165667B1u);
    return mix32(mix32(row_key ^ col) ^ (row_key >> 7));
  }

  __device__ __forceinline__ static float uniform(uint32_t h) {
    return (static_cast<float>(h >> 9) + 0.5f) * (1.0f / 8388608.0f);  // in (0, 1)
  }

  // The score, exactly as the reference: u in (0, 1), E = -log(1 - u) (log1pf: accurate as
  // E -> 2^-24; --use_fast_math leaves it alone, unlike logf), logits / T - log E with a true
  // division.
  __device__ __forceinline__ float exact(float x, uint32_t h) const {
    const float e = -log1pf(-uniform(h));  // Exp(1), in [2^-24, 16.7]
    return __fdiv_rn(x, temperature) - __logf(e);
  }

  // A cheap upper bound of exact(x, h): E = -log(1 - u) >= u, so -log E <= -log u, and a
  // multiplication by 1/T instead of the division; the margin covers the roundings and the fast
  // logarithms of both (each ~1e-5 at worst for T in [1e-4, 1e4]). A token whose bound is below
  // the running best cannot win, so only the few near the best pay for log1pf and the division
  // (the hash and one fast log instead of ~80 instructions: the sampler was compute bound,
  // 0.5 TB/s at 256 rows).
  __device__ __forceinline__ float bound(float x, uint32_t h) const {
    const float a = x * inv_temperature;
    return a - 0.69314718f * __log2f(uniform(h)) + (1e-4f + 1e-6f * fabsf(a));
  }
};

// grid (rows, splits): the best (score, index) of logits[row, chunk * split : chunk * (split + 1)]
template <typename T, bool kVec>
__global__ void __launch_bounds__(kThreads)
sample_tokens_kernel(int64_t* __restrict__ out,            // [N] (splits == 1)
                     float* __restrict__ part_score,       // [N, splits] (splits > 1)
                     int* __restrict__ part_index,         // [N, splits]
                     const T* __restrict__ logits,         // [N, V], row stride `stride`
                     const float* __restrict__ temperatures,  // [N]
                     const int64_t* __restrict__ seed_keys,   // [N, 3]
                     int vocab, int64_t stride, int chunk) {
  const int row = blockIdx.x, split = blockIdx.y, splits = gridDim.y;
  Scorer score;
  score.temperature = temperatures[row];
  score.greedy = !(score.temperature > 0.0f);
  score.bounded = score.temperature >= 1e-4f && score.temperature <= 1e4f;
  score.inv_temperature = 1.0f / score.temperature;
  score.row_key = 0;
  if (!score.greedy) {
    const int64_t* key = seed_keys + static_cast<int64_t>(row) * 3;
    const uint32_t lo = static_cast<uint32_t>(key[0]), hi = static_cast<uint32_t>(key[1]);
    const uint32_t counter = static_cast<uint32_t>(key[2]);
    score.row_key = mix32(lo ^ mix32(hi ^ mix32(counter * 0x9E3779B1u ^ 0x68E31DA4u)));
  }
  const T* x = logits + static_cast<int64_t>(row) * stride;
  const int begin = split * chunk;
  const int end = min(vocab, begin + chunk);

  float best = -INFINITY;
  int best_i = INT_MAX;  // an all -inf row still picks its lowest index, as torch.argmax does
  // floor: the best score any lane of this warp has reached so far, refreshed once per loop
  // step. Every token whose upper bound is strictly below it (or below this lane's own best) can
  // neither win nor tie, so it is skipped. A per-lane best alone was not enough: it starts low,
  // so for a long while some lane of the warp took the exact path on most steps and the whole
  // warp waited on it (N = 256: 149 -> 123 us only). A bound that is not finite (inf or NaN
  // logits, an overflowing x / T) always takes the exact path.
  float floor = -INFINITY;
  auto consider = [&](float xv, int i) {
    float s;
    if (score.greedy) {
      s = xv;
    } else {
      const uint32_t h = score.hash(static_cast<uint32_t>(i));
      if (score.bounded) {
        const float b = score.bound(xv, h);
        if (b < fmaxf(best, floor) && isfinite(b)) return;
      }
      s = score.exact(xv, h);
    }
    if (beats(s, i, best, best_i)) best = s, best_i = i;
  };
  if constexpr (kVec) {
    // 16-byte loads: the row start, the chunk bounds and the vocab are multiples of the width
    constexpr int kW = 16 / sizeof(T);
    // (the trip count is the same for every thread: the warp max below needs all 32 lanes)
    for (int base = begin; base < end; base += kThreads * kW) {
      const int i = base + threadIdx.x * kW;
      if (i < end) {
        uint4 raw = *reinterpret_cast<const uint4*>(x + i);
        const T* v = reinterpret_cast<const T*>(&raw);
#pragma unroll
        for (int j = 0; j < kW; ++j) consider(load_one(v + j), i + j);
      }
      floor = warp_max(best);
    }
  } else {
    for (int base = begin; base < end; base += kThreads) {
      const int i = base + threadIdx.x;
      if (i < end) consider(load_one(x + i), i);
      floor = warp_max(best);
    }
  }

  __shared__ float s_score[kThreads / 32];
  __shared__ int s_index[kThreads / 32];
  warp_best(best, best_i);
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  if (lane == 0) s_score[warp] = best, s_index[warp] = best_i;
  __syncthreads();
  if (warp == 0) {
    best = lane < kThreads / 32 ? s_score[lane] : -INFINITY;
    best_i = lane < kThreads / 32 ? s_index[lane] : INT_MAX;
    warp_best(best, best_i);
    if (lane == 0) {
      if (splits == 1) {
        out[row] = best_i == INT_MAX ? 0 : best_i;
      } else {
        part_score[row * splits + split] = best;
        part_index[row * splits + split] = best_i;
      }
    }
  }
}

// one warp per row: the best of the row's `splits` (<= 32) chunk winners
__global__ void sample_tokens_combine_kernel(int64_t* __restrict__ out, const float* __restrict__ part_score,
                                             const int* __restrict__ part_index, int rows, int splits) {
  const int row = blockIdx.x * (blockDim.x / 32) + threadIdx.x / 32;
  const int lane = threadIdx.x % 32;
  if (row >= rows) return;
  float best = lane < splits ? part_score[row * splits + lane] : -INFINITY;
  int best_i = lane < splits ? part_index[row * splits + lane] : INT_MAX;
  warp_best(best, best_i);
  if (lane == 0) out[row] = best_i == INT_MAX ? 0 : best_i;
}

template <typename T>
cudaError_t launch(int64_t* out, const void* logits, const float* temperatures,
                   const int64_t* seed_keys, float* workspace, int64_t rows, int64_t vocab,
                   int64_t stride, int splits, cudaStream_t stream) {
  constexpr int kW = 16 / sizeof(T);
  const bool vec = vocab % kW == 0 && stride % kW == 0 &&
                   reinterpret_cast<uintptr_t>(logits) % 16 == 0;
  // chunks of whole vectors, so every chunk starts 16-byte aligned
  int chunk = static_cast<int>((vocab + splits - 1) / splits);
  chunk = (chunk + kW - 1) / kW * kW;
  float* part_score = workspace;
  int* part_index = reinterpret_cast<int*>(workspace + rows * splits);
  const dim3 grid(static_cast<unsigned>(rows), static_cast<unsigned>(splits));
  const T* x = static_cast<const T*>(logits);
  if (vec) {
    sample_tokens_kernel<T, true><<<grid, kThreads, 0, stream>>>(
        out, part_score, part_index, x, temperatures, seed_keys, static_cast<int>(vocab), stride,
        chunk);
  } else {
    sample_tokens_kernel<T, false><<<grid, kThreads, 0, stream>>>(
        out, part_score, part_index, x, temperatures, seed_keys, static_cast<int>(vocab), stride,
        chunk);
  }
  if (splits > 1) {
    constexpr int kRowsPerCta = 4;
    sample_tokens_combine_kernel<<<static_cast<unsigned>((rows + kRowsPerCta - 1) / kRowsPerCta),
                                   kRowsPerCta * 32, 0, stream>>>(out, part_score, part_index,
                                                                  static_cast<int>(rows), splits);
  }
  return cudaGetLastError();
}

}  // namespace

cudaError_t sample_tokens(int64_t* out, const void* logits, const float* temperatures,
                          const int64_t* seed_keys, float* workspace, int64_t num_rows,
                          int64_t vocab, int64_t logits_stride, int splits, LogitsDType dtype,
                          cudaStream_t stream) {
  if (num_rows == 0) return cudaSuccess;
  if (splits < 1 || splits > kMaxSampleSplits || vocab < 1 || vocab > INT_MAX / 2)
    return cudaErrorInvalidValue;
  switch (dtype) {
    case LogitsDType::kFloat32:
      return launch<float>(out, logits, temperatures, seed_keys, workspace, num_rows, vocab,
                           logits_stride, splits, stream);
    case LogitsDType::kFloat16:
      return launch<__half>(out, logits, temperatures, seed_keys, workspace, num_rows, vocab,
                            logits_stride, splits, stream);
    default:
      return launch<__nv_bfloat16>(out, logits, temperatures, seed_keys, workspace, num_rows,
                                   vocab, logits_stride, splits, stream);
  }
}

}  // namespace qwen3_kernels
