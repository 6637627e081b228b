// paged_attention_prefill on Hopper: the same algorithm as prefill.cu (read its header first),
// with the two GEMMs on warpgroup MMA (wgmma) instead of mma.sync. sm_90a only; the body is
// compiled out of every other target and the host side checks that the device runs the sm_90a
// code before choosing this kernel (prefill.cu falls back to the mma.sync kernel otherwise).
//
// Why wgmma pays: mma.sync makes every warp read its own copy of the K and V fragments out of
// shared memory (ldmatrix), so at 16 rows per warp the kernel is bound by shared-memory bandwidth
// near half the tensor-core peak. wgmma reads the B operand once per warpgroup (64 rows) straight
// from shared memory through a matrix descriptor.
//
// CTA: 2 warpgroups x 64 packed rows = BLOCK_M 128; key tiles of BLOCK_N = 128.
//   S = Q K^T   wgmma m64n128k16, A = Q and B = K both from shared memory ("SS"), 8 k-steps over D.
//   O += P V    wgmma m64n128k16, A = P from registers ("RS"), B = V from shared memory read as
//               MN-major (V is [key][d], d contiguous), 8 k-steps over the 128 keys.
// Iteration n issues S(n) and then P(n-1) V(n-1), waits for S(n) only, and computes the softmax
// of tile n while the tensor cores run P V (FlashAttention-3's intra-warpgroup overlap; the two
// warpgroups also interleave). The loads stay cp.async (16 bytes per thread, each row's address
// looked up through the block table) into double buffers; one CTA barrier per tile. cp.async
// writes through the generic proxy, so each wait is followed by fence.proxy.async before wgmma
// (the async proxy) reads the tile.
//
// Shared-memory tiles use GMMA's canonical K-major layout with the 128-byte swizzle: a [rows, 128]
// tile of 16-bit values is stored as two [rows, 64] halves (d 0..63, then d 64..127); in each half
// row r is 128 bytes at r * 128 and its 16-byte chunk c sits at chunk (c ^ (r & 7)). The hardware
// applies that XOR on address bits [4,7) ^ [7,10), so every tile starts on a 1 KiB boundary.
//   K-major operand (Q, K): 8-row groups are SBO = 1 KiB apart; a k-step of 16 elements advances
//     the start address by 32 bytes inside the 128-byte row, and k-steps 4..7 use the second half.
//   MN-major operand (V): along N (= d) the two halves are LBO = BLOCK_N * 128 bytes apart; along
//     K (= keys) 8-key groups are SBO = 1 KiB apart; a k-step of 16 keys advances 2 KiB.
// Accumulator layout of wgmma m64nN (per warp w of the warpgroup, lane = 4 g + t): d[4 j + e] is
// row 16 w + g + 8 (e >> 1), column 8 j + 2 t + (e & 1): the mma.sync C layout, N / 8 times.
// The register A operand of a k16 step has the mma.sync A layout, so P is packed exactly as in
// prefill.cu.
#include "prefill_common.cuh"

#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900 && defined(__CUDA_ARCH_FEAT_SM90_ALL)
#define QWEN3_PREFILL_WGMMA 1
#endif

namespace qwen3_kernels {
namespace prefill {
namespace {

constexpr int kBlockM = 128;                        // 2 warpgroups x 64 packed rows
constexpr int kBlockN = 128;                        // keys per K/V tile
constexpr int kThreads = 256;
constexpr int kQBytes = kBlockM * kHeadDim * 2;     // 32 KiB, reused to stage the output
constexpr int kTileBytes = kBlockN * kHeadDim * 2;  // 32 KiB per K or V tile
constexpr int kSmemBytes = kQBytes + 4 * kTileBytes + 1024;  // + slack for 1 KiB alignment

#if defined(QWEN3_PREFILL_WGMMA)

constexpr int kLoadRowsPerPass = kThreads / 16;  // 16 threads load one 256-byte row
constexpr int kKvLoads = kBlockN / kLoadRowsPerPass;  // K or V rows per thread per tile

// Byte offset of 16-byte chunk `chunk` (0..15) of row `row` in a [rows, 128] GMMA tile.
__device__ __forceinline__ uint32_t gmma_offset(int row, int chunk, int rows) {
  return static_cast<uint32_t>((chunk >> 3) * rows * 128 + row * 128 +
                               (((chunk & 7) ^ (row & 7)) << 4));
}

// Byte offset of chunk `chunk` of row `row` in a plain swizzled [rows, 256 B] staging tile.
__device__ __forceinline__ uint32_t stage_offset(int row, int chunk) {
  return static_cast<uint32_t>(row * 256 + ((chunk ^ (row & 7)) << 4));
}

// wgmma shared-memory matrix descriptor: start address, leading and stride byte offsets (all in
// 16-byte units), layout type 1 = 128-byte swizzle (bits 62-63), base offset 0 (tiles are 1 KiB
// aligned and k-step advances stay inside a 128-byte row).
__device__ __forceinline__ uint64_t gmma_desc(uint32_t addr, uint32_t lbo_bytes,
                                              uint32_t sbo_bytes) {
  return static_cast<uint64_t>((addr & 0x3FFFF) >> 4) |
         (static_cast<uint64_t>((lbo_bytes >> 4) & 0x3FFF) << 16) |
         (static_cast<uint64_t>((sbo_bytes >> 4) & 0x3FFF) << 32) | (1ull << 62);
}

__device__ __forceinline__ void wgmma_fence() {
  asm volatile("wgmma.fence.sync.aligned;\n" ::: "memory");
}
__device__ __forceinline__ void wgmma_commit() {
  asm volatile("wgmma.commit_group.sync.aligned;\n" ::: "memory");
}
// Waits until at most N of this warp's committed wgmma groups are still pending.
template <int N>
__device__ __forceinline__ void wgmma_wait() {
  asm volatile("wgmma.wait_group.sync.aligned %0;\n" ::"n"(N) : "memory");
}
// Makes the generic-proxy writes (cp.async, st.shared) visible to the async proxy (wgmma).
__device__ __forceinline__ void fence_proxy_async() {
  asm volatile("fence.proxy.async.shared::cta;\n" ::: "memory");
}
// Pins accumulator registers at this point: the compiler must not move their reads or writes
// across an asynchronous wgmma boundary it cannot see.
template <int N>
__device__ __forceinline__ void fence_regs(float (&r)[N]) {
#pragma unroll
  for (int i = 0; i < N; ++i) asm volatile("" : "+f"(r[i])::"memory");
}

// d[64 x 128] (+)= A[64 x 16] * B[16 x 128]; A, B by descriptor (both K-major). scale_d = 0
// ignores the old d.
template <typename T>
__device__ __forceinline__ void wgmma_ss(float (&d)[64], uint64_t desc_a, uint64_t desc_b,
                                         int scale_d);
// d[64 x 128] += A[64 x 16] * B[16 x 128]; A from registers, B by descriptor, MN-major.
template <typename T>
__device__ __forceinline__ void wgmma_rs(float (&d)[64], const uint32_t (&a)[4], uint64_t desc_b);

template <>
__device__ __forceinline__ void wgmma_ss<__nv_bfloat16>(float (&d)[64], uint64_t desc_a, uint64_t desc_b,
                                               int scale_d) {
  asm volatile(
      "{\n.reg .pred p;\nsetp.ne.b32 p, %66, 0;\n"
      "wgmma.mma_async.sync.aligned.m64n128k16.f32.bf16.bf16 {"
      "%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15,"
      "%16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31,"
      "%32, %33, %34, %35, %36, %37, %38, %39, %40, %41, %42, %43, %44, %45, %46, %47,"
      "%48, %49, %50, %51, %52, %53, %54, %55, %56, %57, %58, %59, %60, %61, %62, %63"
      "}, %64, %65, p, 1, 1, 0, 0;\n}\n"
      :
        "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7]),
        "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]), "+f"(d[13]), "+f"(d[14]), "+f"(d[15]),
        "+f"(d[16]), "+f"(d[17]), "+f"(d[18]), "+f"(d[19]), "+f"(d[20]), "+f"(d[21]), "+f"(d[22]), "+f"(d[23]),
        "+f"(d[24]), "+f"(d[25]), "+f"(d[26]), "+f"(d[27]), "+f"(d[28]), "+f"(d[29]), "+f"(d[30]), "+f"(d[31]),
        "+f"(d[32]), "+f"(d[33]), "+f"(d[34]), "+f"(d[35]), "+f"(d[36]), "+f"(d[37]), "+f"(d[38]), "+f"(d[39]),
        "+f"(d[40]), "+f"(d[41]), "+f"(d[42]), "+f"(d[43]), "+f"(d[44]), "+f"(d[45]), "+f"(d[46]), "+f"(d[47]),
        "+f"(d[48]), "+f"(d[49]), "+f"(d[50]), "+f"(d[51]), "+f"(d[52]), "+f"(d[53]), "+f"(d[54]), "+f"(d[55]),
        "+f"(d[56]), "+f"(d[57]), "+f"(d[58]), "+f"(d[59]), "+f"(d[60]), "+f"(d[61]), "+f"(d[62]), "+f"(d[63])
      : "l"(desc_a), "l"(desc_b), "r"(scale_d));
}

template <>
__device__ __forceinline__ void wgmma_rs<__nv_bfloat16>(float (&d)[64], const uint32_t (&a)[4],
                                               uint64_t desc_b) {
  asm volatile(
      "{\n.reg .pred p;\nsetp.ne.b32 p, %69, 0;\n"
      "wgmma.mma_async.sync.aligned.m64n128k16.f32.bf16.bf16 {"
      "%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15,"
      "%16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31,"
      "%32, %33, %34, %35, %36, %37, %38, %39, %40, %41, %42, %43, %44, %45, %46, %47,"
      "%48, %49, %50, %51, %52, %53, %54, %55, %56, %57, %58, %59, %60, %61, %62, %63"
      "}, {%64, %65, %66, %67}, %68, p, 1, 1, 1;\n}\n"
      :
        "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7]),
        "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]), "+f"(d[13]), "+f"(d[14]), "+f"(d[15]),
        "+f"(d[16]), "+f"(d[17]), "+f"(d[18]), "+f"(d[19]), "+f"(d[20]), "+f"(d[21]), "+f"(d[22]), "+f"(d[23]),
        "+f"(d[24]), "+f"(d[25]), "+f"(d[26]), "+f"(d[27]), "+f"(d[28]), "+f"(d[29]), "+f"(d[30]), "+f"(d[31]),
        "+f"(d[32]), "+f"(d[33]), "+f"(d[34]), "+f"(d[35]), "+f"(d[36]), "+f"(d[37]), "+f"(d[38]), "+f"(d[39]),
        "+f"(d[40]), "+f"(d[41]), "+f"(d[42]), "+f"(d[43]), "+f"(d[44]), "+f"(d[45]), "+f"(d[46]), "+f"(d[47]),
        "+f"(d[48]), "+f"(d[49]), "+f"(d[50]), "+f"(d[51]), "+f"(d[52]), "+f"(d[53]), "+f"(d[54]), "+f"(d[55]),
        "+f"(d[56]), "+f"(d[57]), "+f"(d[58]), "+f"(d[59]), "+f"(d[60]), "+f"(d[61]), "+f"(d[62]), "+f"(d[63])
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(desc_b), "r"(1));
}

template <>
__device__ __forceinline__ void wgmma_ss<__half>(float (&d)[64], uint64_t desc_a, uint64_t desc_b,
                                               int scale_d) {
  asm volatile(
      "{\n.reg .pred p;\nsetp.ne.b32 p, %66, 0;\n"
      "wgmma.mma_async.sync.aligned.m64n128k16.f32.f16.f16 {"
      "%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15,"
      "%16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31,"
      "%32, %33, %34, %35, %36, %37, %38, %39, %40, %41, %42, %43, %44, %45, %46, %47,"
      "%48, %49, %50, %51, %52, %53, %54, %55, %56, %57, %58, %59, %60, %61, %62, %63"
      "}, %64, %65, p, 1, 1, 0, 0;\n}\n"
      :
        "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7]),
        "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]), "+f"(d[13]), "+f"(d[14]), "+f"(d[15]),
        "+f"(d[16]), "+f"(d[17]), "+f"(d[18]), "+f"(d[19]), "+f"(d[20]), "+f"(d[21]), "+f"(d[22]), "+f"(d[23]),
        "+f"(d[24]), "+f"(d[25]), "+f"(d[26]), "+f"(d[27]), "+f"(d[28]), "+f"(d[29]), "+f"(d[30]), "+f"(d[31]),
        "+f"(d[32]), "+f"(d[33]), "+f"(d[34]), "+f"(d[35]), "+f"(d[36]), "+f"(d[37]), "+f"(d[38]), "+f"(d[39]),
        "+f"(d[40]), "+f"(d[41]), "+f"(d[42]), "+f"(d[43]), "+f"(d[44]), "+f"(d[45]), "+f"(d[46]), "+f"(d[47]),
        "+f"(d[48]), "+f"(d[49]), "+f"(d[50]), "+f"(d[51]), "+f"(d[52]), "+f"(d[53]), "+f"(d[54]), "+f"(d[55]),
        "+f"(d[56]), "+f"(d[57]), "+f"(d[58]), "+f"(d[59]), "+f"(d[60]), "+f"(d[61]), "+f"(d[62]), "+f"(d[63])
      : "l"(desc_a), "l"(desc_b), "r"(scale_d));
}

template <>
__device__ __forceinline__ void wgmma_rs<__half>(float (&d)[64], const uint32_t (&a)[4],
                                               uint64_t desc_b) {
  asm volatile(
      "{\n.reg .pred p;\nsetp.ne.b32 p, %69, 0;\n"
      "wgmma.mma_async.sync.aligned.m64n128k16.f32.f16.f16 {"
      "%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15,"
      "%16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31,"
      "%32, %33, %34, %35, %36, %37, %38, %39, %40, %41, %42, %43, %44, %45, %46, %47,"
      "%48, %49, %50, %51, %52, %53, %54, %55, %56, %57, %58, %59, %60, %61, %62, %63"
      "}, {%64, %65, %66, %67}, %68, p, 1, 1, 1;\n}\n"
      :
        "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7]),
        "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]), "+f"(d[13]), "+f"(d[14]), "+f"(d[15]),
        "+f"(d[16]), "+f"(d[17]), "+f"(d[18]), "+f"(d[19]), "+f"(d[20]), "+f"(d[21]), "+f"(d[22]), "+f"(d[23]),
        "+f"(d[24]), "+f"(d[25]), "+f"(d[26]), "+f"(d[27]), "+f"(d[28]), "+f"(d[29]), "+f"(d[30]), "+f"(d[31]),
        "+f"(d[32]), "+f"(d[33]), "+f"(d[34]), "+f"(d[35]), "+f"(d[36]), "+f"(d[37]), "+f"(d[38]), "+f"(d[39]),
        "+f"(d[40]), "+f"(d[41]), "+f"(d[42]), "+f"(d[43]), "+f"(d[44]), "+f"(d[45]), "+f"(d[46]), "+f"(d[47]),
        "+f"(d[48]), "+f"(d[49]), "+f"(d[50]), "+f"(d[51]), "+f"(d[52]), "+f"(d[53]), "+f"(d[54]), "+f"(d[55]),
        "+f"(d[56]), "+f"(d[57]), "+f"(d[58]), "+f"(d[59]), "+f"(d[60]), "+f"(d[61]), "+f"(d[62]), "+f"(d[63])
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(desc_b), "r"(1));
}
#endif  // QWEN3_PREFILL_WGMMA

// grid (Hkv, ceil(max_seqlen_q * group / BLOCK_M), B), M tiles in reverse (longest rows first).
template <typename T>
__global__ void __launch_bounds__(kThreads, 1) prefill_sm90_kernel(const PrefillParams p) {
#if defined(QWEN3_PREFILL_WGMMA)
  extern __shared__ uint8_t smem_raw[];
  const uint32_t raw_addr = smem_addr(smem_raw);
  const uint32_t s_q = (raw_addr + 1023) & ~1023u;  // the 128-byte swizzle needs 1 KiB alignment
  uint8_t* smem = smem_raw + (s_q - raw_addr);
  const uint32_t s_k = s_q + kQBytes;         // 2 stages
  const uint32_t s_v = s_k + 2 * kTileBytes;  // 2 stages

  const int kv_head = blockIdx.x;
  const int m_block = gridDim.y - 1 - blockIdx.y;
  const int seq = blockIdx.z;
  const int q_start = p.cu_seqlens_q[seq];
  const int lq = p.cu_seqlens_q[seq + 1] - q_start;
  const int group = p.group;
  const int rows = lq * group;
  const int row0 = m_block * kBlockM;
  if (row0 >= rows) return;

  const int lk = min(p.seq_lens_k[seq], p.max_blocks << p.block_size_log2);
  const int shift = lk - lq;  // absolute position of query token t is shift + t
  const int t_first = row0 / group;
  const int t_last = (min(row0 + kBlockM, rows) - 1) / group;
  const int key_end = shift + t_last + 1;
  const int n_tiles = key_end > 0 ? (key_end + kBlockN - 1) / kBlockN : 0;
  const int n_full = max(0, (shift + t_first + 1) / kBlockN);  // tiles before it need no mask

  const int tid = threadIdx.x;
  const int lane = tid & 31;
  const int warp = tid >> 5;
  const int wg = warp >> 2;
  const int ld_chunk = tid & 15;
  const int ld_row = tid >> 4;

  const T* q = static_cast<const T*>(p.q);
#pragma unroll
  for (int i = 0; i < kBlockM / kLoadRowsPerPass; ++i) {
    const int r = ld_row + i * kLoadRowsPerPass;
    const int pr = row0 + r;
    const bool valid = pr < rows;
    const int token = pr / group;
    const int head = kv_head * group + (pr - token * group);
    const T* src = valid ? q + ((int64_t)(q_start + token) * p.num_q_heads + head) * kHeadDim +
                               ld_chunk * 8
                         : q;
    cp_async_16(s_q + gmma_offset(r, ld_chunk, kBlockM), src, valid);
  }

  const int64_t slot_stride = (int64_t)p.num_kv_heads * kHeadDim;
  const T* k_head = static_cast<const T*>(p.k_cache) + kv_head * kHeadDim + ld_chunk * 8;
  const T* v_head = static_cast<const T*>(p.v_cache) + kv_head * kHeadDim + ld_chunk * 8;
  const int32_t* table = p.block_tables + (int64_t)seq * p.max_blocks;
  const int block_mask = (1 << p.block_size_log2) - 1;
  // Copies this thread's rows of key tile `tile` into dst; rows past the sequence are zeroed.
  // The block table is re-read per tile (L1 hits) rather than holding 8 offsets across the GEMMs.
  auto load_tile = [&](uint32_t dst, const T* head_base, int tile) {
#pragma unroll
    for (int i = 0; i < kKvLoads; ++i) {
      const int r = ld_row + i * kLoadRowsPerPass;
      const int key = tile * kBlockN + r;
      const bool valid = key < lk;
      const T* src = head_base;
      if (valid) {
        const int64_t block = __ldg(table + (key >> p.block_size_log2));
        src += ((block << p.block_size_log2) + (key & block_mask)) * slot_stride;
      }
      cp_async_16(dst + gmma_offset(r, ld_chunk, kBlockN), src, valid);
    }
  };

  // cp.async groups, in commit order: {Q, K(0)}, then in iteration n: {K(n + 1), V(n)}. V(n) is
  // first needed by P V in iteration n + 1 (see the loop), so both loads have one iteration to land.
  load_tile(s_k, k_head, 0);
  cp_async_commit();

  const int g = lane >> 2;
  const int t4 = lane & 3;
  int pos[2];
#pragma unroll
  for (int h = 0; h < 2; ++h) pos[h] = shift + (row0 + warp * 16 + g + 8 * h) / group;

  float o[64];
#pragma unroll
  for (int i = 0; i < 64; ++i) o[i] = 0.f;
  float row_max[2] = {-INFINITY, -INFINITY};
  float row_sum[2] = {0.f, 0.f};
  uint32_t p_frag[kBlockN / 16][4];  // P of the previous tile, the A operand of its P V

  // Software pipeline (FlashAttention-3's intra-warpgroup overlap): iteration n issues S(n) =
  // Q K(n)^T and then O += P(n-1) V(n-1), waits only for S(n), and runs the softmax of tile n
  // while the tensor cores work on P V. O is rescaled by tile n's alpha after P(n-1) V(n-1) has
  // landed, which is exactly where the un-pipelined order would apply it. The last P V runs
  // after the loop.
  for (int n = 0; n < n_tiles; ++n) {
    cp_async_wait<0>();  // K(n) and V(n - 1) have landed
    fence_proxy_async();
    // Every thread's copies are visible; every warpgroup has finished S(n - 1) (K stage
    // (n + 1) & 1) and P(n - 2) V(n - 2) (V stage n & 1), so both may be refilled.
    __syncthreads();
    if (n + 1 < n_tiles) load_tile(s_k + ((n + 1) & 1) * kTileBytes, k_head, n + 1);
    load_tile(s_v + (n & 1) * kTileBytes, v_head, n);
    cp_async_commit();

    // S = Q K^T: this warpgroup's 64 rows x 128 keys.
    float s[64];
    const uint32_t k_stage = s_k + (n & 1) * kTileBytes;
    fence_regs(o);
    wgmma_fence();  // o and p_frag were written by ordinary instructions
#pragma unroll
    for (int kk = 0; kk < kHeadDim / 16; ++kk) {
      const uint32_t half_k = kk >> 2, col = (kk & 3) * 32;
      const uint64_t da =
          gmma_desc(s_q + half_k * (kBlockM * 128) + wg * (64 * 128) + col, 16, 1024);
      const uint64_t db = gmma_desc(k_stage + half_k * (kBlockN * 128) + col, 16, 1024);
      wgmma_ss<T>(s, da, db, kk > 0 ? 1 : 0);
    }
    wgmma_commit();
    if (n > 0) {
      // O += P(n-1) V(n-1).
      const uint32_t v_stage = s_v + ((n - 1) & 1) * kTileBytes;
#pragma unroll
      for (int kk = 0; kk < kBlockN / 16; ++kk)
        wgmma_rs<T>(o, p_frag[kk], gmma_desc(v_stage + kk * (16 * 128), kBlockN * 128, 1024));
      wgmma_commit();
      wgmma_wait<1>();  // S(n) is done; P V may still run
    } else {
      wgmma_wait<0>();
    }
    fence_regs(s);

    if (n >= n_full) {  // a tile on the diagonal (or past the sequence's last key)
#pragma unroll
      for (int j = 0; j < kBlockN / 8; ++j) {
#pragma unroll
        for (int e = 0; e < 4; ++e) {
          const int key = n * kBlockN + j * 8 + 2 * t4 + (e & 1);
          if (key > pos[e >> 1]) s[4 * j + e] = -INFINITY;
        }
      }
    }

    // Online softmax (see prefill.cu): base 2, scale folded in, -inf rows kept NaN-free.
    float alpha[2];
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      float mx = row_max[h];
#pragma unroll
      for (int j = 0; j < kBlockN / 8; ++j)
        mx = fmaxf(mx, fmaxf(s[4 * j + 2 * h], s[4 * j + 2 * h + 1]));
      mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, 1));
      mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, 2));
      const float m_scaled = mx == -INFINITY ? 0.f : mx * p.scale_log2;
      alpha[h] = fast_exp2(row_max[h] * p.scale_log2 - m_scaled);
      row_max[h] = mx;
      row_sum[h] *= alpha[h];
#pragma unroll
      for (int j = 0; j < kBlockN / 8; ++j) {
        float& s0 = s[4 * j + 2 * h];
        float& s1 = s[4 * j + 2 * h + 1];
        s0 = fast_exp2(fmaf(s0, p.scale_log2, -m_scaled));
        s1 = fast_exp2(fmaf(s1, p.scale_log2, -m_scaled));
        row_sum[h] += s0 + s1;
      }
    }

    wgmma_wait<0>();  // P(n-1) V(n-1) has landed: p_frag and o are free
    fence_regs(o);
    rescale_rows(o, alpha);
    // Two adjacent n8 accumulator tiles form the register A operand of one k16 step.
#pragma unroll
    for (int kk = 0; kk < kBlockN / 16; ++kk) {
      p_frag[kk][0] = pack2<T>(s[8 * kk + 0], s[8 * kk + 1]);
      p_frag[kk][1] = pack2<T>(s[8 * kk + 2], s[8 * kk + 3]);
      p_frag[kk][2] = pack2<T>(s[8 * kk + 4], s[8 * kk + 5]);
      p_frag[kk][3] = pack2<T>(s[8 * kk + 6], s[8 * kk + 7]);
    }
  }

  if (n_tiles > 0) {  // the last tile's P V
    cp_async_wait<0>();  // V(n_tiles - 1)
    fence_proxy_async();
    __syncthreads();
    const uint32_t v_stage = s_v + ((n_tiles - 1) & 1) * kTileBytes;
    fence_regs(o);
    wgmma_fence();
#pragma unroll
    for (int kk = 0; kk < kBlockN / 16; ++kk)
      wgmma_rs<T>(o, p_frag[kk], gmma_desc(v_stage + kk * (16 * 128), kBlockN * 128, 1024));
    wgmma_commit();
    wgmma_wait<0>();
    fence_regs(o);
  }
  cp_async_wait<0>();

  float inv[2];
#pragma unroll
  for (int h = 0; h < 2; ++h) {
    float l = row_sum[h];
    l += __shfl_xor_sync(0xffffffffu, l, 1);
    l += __shfl_xor_sync(0xffffffffu, l, 2);
    inv[h] = l > 0.f ? 1.f / l : 0.f;
  }

  // Every warpgroup is done reading Q through the async proxy before its space is reused.
  __syncthreads();
#pragma unroll
  for (int j = 0; j < kHeadDim / 8; ++j) {
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      const int r = warp * 16 + g + 8 * h;
      *reinterpret_cast<uint32_t*>(smem + stage_offset(r, j) + 4 * t4) =
          pack2<T>(o[4 * j + 2 * h] * inv[h], o[4 * j + 2 * h + 1] * inv[h]);
    }
  }
  __syncwarp();
  T* out = static_cast<T*>(p.out);
#pragma unroll
  for (int i = 0; i < 16 * 16 / 32; ++i) {
    const int idx = i * 32 + lane;
    const int r = warp * 16 + (idx >> 4);
    const int chunk = idx & 15;
    const int pr = row0 + r;
    if (pr < rows) {
      const int token = pr / group;
      const int head = kv_head * group + (pr - token * group);
      *reinterpret_cast<uint4*>(out + ((int64_t)(q_start + token) * p.num_q_heads + head) *
                                          kHeadDim + chunk * 8) =
          *reinterpret_cast<const uint4*>(smem + stage_offset(r, chunk));
    }
  }
#endif  // QWEN3_PREFILL_WGMMA
}

template <typename T>
cudaError_t launch(const PrefillParams& p, int batch, int max_seqlen_q, cudaStream_t stream) {
  const int64_t m_blocks = ((int64_t)max_seqlen_q * p.group + kBlockM - 1) / kBlockM;
  if (m_blocks > 65535) return cudaErrorInvalidConfiguration;  // grid.y limit
  cudaError_t err = cudaFuncSetAttribute(prefill_sm90_kernel<T>,
                                         cudaFuncAttributeMaxDynamicSharedMemorySize, kSmemBytes);
  if (err != cudaSuccess) return err;
  const dim3 grid(p.num_kv_heads, (unsigned)m_blocks, batch);
  prefill_sm90_kernel<T><<<grid, kThreads, kSmemBytes, stream>>>(p);
  return cudaGetLastError();
}

}  // namespace

bool sm90_available() {
  // Per device: does it run this binary's sm_90a code of the kernel? (binaryVersion is the SASS
  // version the driver picked: 90 on an H100/H200 built with sm_90a, 80 on an A100.)
  static int cached[64];  // 0 unknown, 1 yes, 2 no; a benign race writes the same value
  int dev = 0;
  if (cudaGetDevice(&dev) != cudaSuccess) return false;
  if (dev >= 0 && dev < 64 && cached[dev] != 0) return cached[dev] == 1;
  cudaFuncAttributes attr;
  bool ok = cudaFuncGetAttributes(&attr, prefill_sm90_kernel<__nv_bfloat16>) == cudaSuccess &&
            attr.binaryVersion == 90;
  if (!ok) (void)cudaGetLastError();  // clear a "no kernel image" error; we just fall back
  if (dev >= 0 && dev < 64) cached[dev] = ok ? 1 : 2;
  return ok;
}

cudaError_t launch_sm90(const PrefillParams& p, int batch, int max_seqlen_q, DType dtype,
                        cudaStream_t stream) {
  if (!sm90_available()) return cudaErrorNotSupported;
  return QWEN3_DISPATCH_HALF(dtype, T, [&] { return launch<T>(p, batch, max_seqlen_q, stream); });
}

}  // namespace prefill
}  // namespace qwen3_kernels
