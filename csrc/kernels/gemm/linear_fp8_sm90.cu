// fp8::gemm: the block-scaled FP8 GEMM of linear_fp8 above one token, on Hopper with CUTLASS 3.x
// (the sm90 "blockwise scaling" collective of CUTLASS example 67):
//
//   out[t, n] = sum_g x_scales[g, t] * w_scales[n / 128, g] * sum_{k in g} xq[t, k] * w[n, k]
//
// rounded to bf16 once at the end, g running over the 128-wide groups of K.
//
// What the kernel does:
//   1. TMA loads xq (A, [M, K] K-major) and w (B, [N, K] K-major) tiles of K = 128 (one scale
//      group per k-tile) into a multi-stage shared-memory ring; a producer warp group issues
//      them, consumer warp groups run e4m3 wgmma with fp32 accumulation.
//   2. Scales in the mainloop: each k-tile's wgmma accumulate into a fresh fp32 register tile,
//      which is then added to the running sum times x_scale[row] * w_scale (the "promotion"
//      every 128 of K), so no product is ever formed in fp8 range. The promotion of k-tile t
//      runs while k-tile t+1's wgmma do (OverlappedPromotion, below), not between them. The
//      activation scales are one per row (SFA granularity 1 x 128, MN-major: a tile's
//      128 or 64 row scales are one contiguous TMA box per k-tile); the weight scale is one per
//      tile (SFB granularity 128 x 128, K-major: w_scales row-major as the checkpoint stores it).
//   3. K need not be a multiple of 128: the last k-tile's TMA zero-fills past K, so the partial
//      group contributes exactly its K % 128 columns, scaled by its own (last) scale column.
//      M and N tails are zero-filled the same way and clipped by the epilogue's TMA store.
//   4. Persistent grids: the cooperative configuration runs CUTLASS's stream-K scheduler with
//      its heuristic decomposition (data-parallel when the tiles fill the SMs in whole waves,
//      stream-K / split-K otherwise: at a few tokens N / 128 tiles would leave most SMs idle);
//      the ping-pong configuration (stream-K does not support it) the plain persistent one.
//   5. The launch: programmatic dependent launch (cutlass_gdc.h), the block scales read only
//      after the previous kernel has finished (ScalesAfterWait below).
//
// x_scales are read token-contiguous: scale (t, g) at x_scales[g * scale_stride + t] with
// scale_stride >= M a multiple of 4 (TMA: 16-byte rows). The GEMM sees SFA as scale_stride rows:
// rows M..scale_stride-1 are padding whose (unwritten) values only ever multiply rows of A that
// TMA zero-filled past M, and those output rows are never stored.
//
// Built for sm_90a and sm_80: CUTLASS compiles the kernel body only for sm_90a (elsewhere it is a
// stub), and the host side returns cudaErrorNotSupported unless the device is compute 9.0.
#include <cstdint>
#include <limits>

#include <cuda_runtime.h>

#include "cutlass_gdc.h"  // first: griddepcontrol in the CUTLASS kernels
#include "cute/tensor.hpp"
#include "cutlass/cutlass.h"
#include "cutlass/detail/blockwise_scale_layout.hpp"
#include "cutlass/epilogue/collective/collective_builder.hpp"
#include "cutlass/gemm/collective/collective_builder.hpp"
#include "cutlass/gemm/device/gemm_universal_adapter.h"
#include "cutlass/gemm/dispatch_policy.hpp"
#include "cutlass/gemm/kernel/gemm_universal.hpp"
#include "cutlass/gemm/kernel/tile_scheduler_params.h"
#include "cutlass/util/packed_stride.hpp"

#include "linear_fp8.h"
#include "qwen3_kernels/launch.cuh"  // current_device_info

namespace qwen3_kernels::fp8 {
namespace {

using namespace cute;

// One GEMM call, whatever the configuration.
struct Call {
  void* out;              // [M, N] bf16
  const void* xq;         // [M, K] e4m3
  const float* x_scales;  // [ceil(K/128), scale_stride]
  const void* w;          // [N, K] e4m3
  const float* w_scales;  // [ceil(N/128), ceil(K/128)]
  int m, n, k, scale_stride;
  int device, sm_count;   // the current device and its SM count (cached)
};

// The mainloop, with griddepcontrol.wait before the block scales are read. CUTLASS's sm90 kernels
// copy them in an auxiliary producer warp (load_auxiliary), which the ping-pong kernel makes wait
// for the previous grid and the cooperative kernel (CUTLASS 4.2) does not: under the PDL launch
// it would read x_scales while the kernel that writes them (the quantization) still runs. The
// wait is free after the first tile (the previous grid has finished by then).
template <class Base>
struct ScalesAfterWait : Base {
  using Base::Base;
  template <class... Args>
  CUTLASS_DEVICE void load_auxiliary(Args&&... args) {
    cutlass::arch::wait_on_dependent_grids();
    Base::load_auxiliary(static_cast<Args&&>(args)...);
  }
};

// The consumer side of the mainloop with each k-tile's promotion overlapped with the next k-tile's
// wgmma. CUTLASS's blockwise mainloop (4.2) issues a k-tile's wgmma into a temporary fp32 tile,
// waits for them (wgmma.wait_group 0), then adds temporary x scales into the output tile: the
// tensor cores idle from the last wgmma's retirement until the next k-tile's first is issued,
// for every 128 of K. Here the temporary tile is double-buffered: k-tile t+1's wgmma are issued
// into one buffer before k-tile t's (the other buffer) are waited for (wait_group 1) and promoted,
// so the promotion and the stage's wait run while the tensor cores work. Costs a second
// temporary tile of registers (Coop128 / Pingpong64: 64 a thread).
// Measured (H100, one call; benchmarks/linear_fp8_ab, each configuration against its twin on
// CUTLASS's mainloop): Coop128 at M = 2048..8192 on Qwen3-8B's projections 1.00-1.06x (qkv 4096:
// 168.6 -> 159.3 us), Pingpong64 up to 1.25x at few tokens (down M = 1: 32.5 -> 26.0 us),
// SwapCoop128x32 1.04-1.21x at 96..384 tokens (a cooperative 128 x 64 swapped tile 0.88-1.00x: no
// cell chooses one); outputs bit-identical to the twin's but for a few in a million (CUTLASS adds
// its first k-tile to the fragment as allocated). Qwen3-8B-FP8 + FP8 KV workload 12,235 /
// 12,225 against 12,139 / 12,143 output tok/s (alternating).
//
// The arithmetic is CUTLASS's: each k-tile's products summed by wgmma from zero, then
// acc += partial * (x_scale * w_scale), k-tiles in order; the first k-tile sets acc instead of
// adding to it.
// The pipeline contract is the base's: stages are released in order, all but the last (which
// mma_tail releases), each only after the wgmma reading it have retired.
template <class Base>
struct OverlappedPromotion : ScalesAfterWait<Base> {
  using ScalesAfterWait<Base>::ScalesAfterWait;
  using TileShape = typename Base::TileShape;
  using TiledMma = typename Base::TiledMma;
  static_assert(Base::ScalePromotionInterval == 4, "one scale group per k-tile (K tile 128)");
  static constexpr int kScalesM = Base::ScaleMsPerTile;  // x (or, swapped, w) scales a tile
  static constexpr int kScalesN = Base::ScaleNsPerTile;
  static_assert(kScalesM == 1 || kScalesN == 1, "one operand has one scale per tile");
  static constexpr int kStages = Base::DispatchPolicy::Stages;
  static constexpr int kTileM = size<0>(TileShape{}), kTileN = size<1>(TileShape{});

  template <class FrgTensorC>
  CUTLASS_DEVICE void mma(typename Base::MainloopPipeline pipeline,
                          typename Base::PipelineState smem_pipe_read,
                          FrgTensorC& accum,  // (MMA, MMA_M, MMA_N) fp32, overwritten
                          int k_tile_count, int thread_idx,
                          typename Base::TensorStorage& shared_tensors,
                          typename Base::Params const&) {
    // Operand stages and the MMA's fragments of them (descriptors), as in the base.
    Tensor sA = make_tensor(make_smem_ptr(shared_tensors.smem_A.data()),
                            typename Base::SmemLayoutA{});  // (BLK_M, BLK_K, PIPE)
    Tensor sB = make_tensor(make_smem_ptr(shared_tensors.smem_B.data()),
                            typename Base::SmemLayoutB{});  // (BLK_N, BLK_K, PIPE)
    TiledMma tiled_mma;
    constexpr int kWgThreads = cutlass::NumThreadsPerWarpGroup;
    constexpr int kWarpGroups = size(TiledMma{}) / kWgThreads;
    const int warp_group = __shfl_sync(0xffffffff, thread_idx / kWgThreads, 0);
    auto wg_mma =
        tiled_mma.get_slice(make_layout(Int<kWarpGroups>{}, Int<kWgThreads>{})(warp_group));
    Tensor tCrA = wg_mma.make_fragment_A(wg_mma.partition_A(sA));  // (MMA, MMA_M, MMA_K, PIPE)
    Tensor tCrB = wg_mma.make_fragment_B(wg_mma.partition_B(sB));  // (MMA, MMA_N, MMA_K, PIPE)

    // The scales of a stage seen as (BLK_M, BLK_N) tiles: stage s holds kScalesM x scales (one
    // per row, or one for the tile) then kScalesN w scales; each view repeats its value over the
    // other mode and over the rows / columns one scale covers, so the thread's partition of it
    // has the accumulator's shape with only its distinct values stored.
    constexpr int kGranM = kTileM / kScalesM, kGranN = kTileN / kScalesN;
    auto sfa_view = make_layout(
        make_shape(make_shape(Int<kGranM>{}, Int<kScalesM>{}), Int<kTileN>{}, Int<kStages>{}),
        make_stride(make_stride(_0{}, _1{}), _0{}, Int<kScalesM>{}));
    auto sfb_view = make_layout(
        make_shape(Int<kTileM>{}, make_shape(Int<kGranN>{}, Int<kScalesN>{}), Int<kStages>{}),
        make_stride(_0{}, make_stride(_0{}, _1{}), Int<kScalesN>{}));
    auto thr_mma = tiled_mma.get_slice(thread_idx);
    Tensor tCsSFA = thr_mma.partition_C(
        make_tensor(make_smem_ptr(shared_tensors.smem_SFA.data()), sfa_view));  // (.., PIPE)
    Tensor tCsSFB = thr_mma.partition_C(
        make_tensor(make_smem_ptr(shared_tensors.smem_SFB.data()), sfb_view));
    // The per-element scale of a k-tile: the many-valued side times the one-valued side.
    using Scale = decltype(make_tensor_like<float>(tCsSFA(_, _, _, 0)));
    using ScaleB = decltype(make_tensor_like<float>(tCsSFB(_, _, _, 0)));
    auto load_scales = [&](auto& scale, int stage) {
      if constexpr (kScalesN == 1) {  // x scales per row (or one), one w scale
        copy(tCsSFA(_, _, _, stage), scale);
        const float other = tCsSFB(0, 0, 0, stage);
        Tensor distinct = filter_zeros(scale);
        CUTLASS_PRAGMA_UNROLL
        for (int i = 0; i < size(distinct); ++i) distinct(i) *= other;
      } else {  // swapped: one w scale for the tile's rows, x scales per column
        copy(tCsSFB(_, _, _, stage), scale);
        const float other = tCsSFA(0, 0, 0, stage);
        Tensor distinct = filter_zeros(scale);
        CUTLASS_PRAGMA_UNROLL
        for (int i = 0; i < size(distinct); ++i) distinct(i) *= other;
      }
    };
    using ScaleT = cute::conditional_t<kScalesN == 1, Scale, ScaleB>;
    ScaleT scale0, scale1;
    Tensor part0 = make_fragment_like(accum), part1 = make_fragment_like(accum);

    // k-tile of stage `stage` into `part`: the wgmma of its K, from zero, committed as one batch.
    auto issue = [&](auto& part, int stage) {
      tiled_mma.accumulate_ = GMMA::ScaleOut::Zero;
      warpgroup_fence_operand(part);
      warpgroup_arrive();
      CUTLASS_PRAGMA_UNROLL
      for (int kb = 0; kb < size<2>(tCrA); ++kb) {
        cute::gemm(tiled_mma, tCrA(_, _, kb, stage), tCrB(_, _, kb, stage), part);
        tiled_mma.accumulate_ = GMMA::ScaleOut::One;
      }
      warpgroup_commit_batch();
      warpgroup_fence_operand(part);
    };
    auto promote = [&](auto& part, auto& scale, bool first) {
      warpgroup_fence_operand(part);
      if (first) {
        CUTLASS_PRAGMA_UNROLL
        for (int i = 0; i < size(accum); ++i) accum(i) = part(i) * scale(i);
      } else {
        CUTLASS_PRAGMA_UNROLL
        for (int i = 0; i < size(accum); ++i) accum(i) += part(i) * scale(i);
      }
    };
    auto next_stage = [&]() {  // waits for the next stage to land and returns its index
      pipeline.consumer_wait(smem_pipe_read, pipeline.consumer_try_wait(smem_pipe_read));
      const int stage = smem_pipe_read.index();
      ++smem_pipe_read;
      return stage;
    };
    typename Base::PipelineState smem_pipe_release = smem_pipe_read;

    warpgroup_fence_operand(accum);
    int stage = next_stage();
    load_scales(scale0, stage);
    issue(part0, stage);
    bool first = true;
    // Two k-tiles a trip, so each temporary tile keeps its registers: part0 holds even k-tiles,
    // part1 odd ones. Entering, part0's k-tile is in flight.
    for (int left = k_tile_count - 1; left > 0; left -= 2) {
      stage = next_stage();
      load_scales(scale1, stage);
      issue(part1, stage);
      warpgroup_wait<1>();  // part0's k-tile has retired: its stage goes back
      pipeline.consumer_release(smem_pipe_release);
      ++smem_pipe_release;
      promote(part0, scale0, first);
      first = false;
      if (left == 1) {  // part1 holds the last k-tile
        warpgroup_wait<0>();
        promote(part1, scale1, false);
        warpgroup_fence_operand(accum);
        return;
      }
      stage = next_stage();
      load_scales(scale0, stage);
      issue(part0, stage);
      warpgroup_wait<1>();
      pipeline.consumer_release(smem_pipe_release);
      ++smem_pipe_release;
      promote(part1, scale1, false);
    }
    warpgroup_wait<0>();  // part0 holds the last k-tile
    promote(part0, scale0, first);
    warpgroup_fence_operand(accum);
  }
};

// One configuration of the block-scaled GEMM. Everything but the tile, cluster and schedules is
// fixed by the format: e4m3 operands both K-major, fp32 accumulation and scales, bf16 out.
template <class TileShape_,         // CTA tile (M, N, K); K = 128: one scale group a k-tile
          class ClusterShape_,      // CTAs a cluster (M, N, 1): TMA multicast of the shared operand
          class KernelSchedule_,    // cooperative (2 consumer WGs, one tile) or ping-pong (1 each)
          class EpilogueSchedule_,  // matches the mainloop's
          class TileScheduler_,     // StreamKScheduler (cooperative only) or PersistentScheduler
          bool kSwapAB_ = false,    // out^T = w xq^T: the weight is A (its rows the tile's M)
          bool kOverlap_ = false>   // the mainloop's promotion overlapped (OverlappedPromotion)
struct BlockScaledGemm {
  static constexpr bool kSwapAB = kSwapAB_;
  using ElementA = cutlass::float_e4m3_t;                      // xq [M, K] (swapped: w [N, K])
  using LayoutA = cutlass::layout::RowMajor;                   // K contiguous
  static constexpr int AlignmentA = 16;                        // 16-byte TMA rows: K % 16 == 0
  using ElementB = cutlass::float_e4m3_t;                      // w [N, K] (swapped: xq [M, K])
  using LayoutB = cutlass::layout::ColumnMajor;                // [K, N] stored as [N, K]
  static constexpr int AlignmentB = 16;
  using ElementD = cutlass::bfloat16_t;                        // out [M, N]
  // swapped: D = out^T [N, M], column-major, is out [M, N] row-major
  using LayoutD =
      cute::conditional_t<kSwapAB, cutlass::layout::ColumnMajor, cutlass::layout::RowMajor>;
  static constexpr int AlignmentD = 8;                         // N % 8 == 0: 16-byte output rows
  using ElementC = void;                                       // no source operand: D = acc
  using ElementAccumulator = float;
  using ElementCompute = float;
  using ArchTag = cutlass::arch::Sm90;
  using OperatorClass = cutlass::arch::OpClassTensorOp;
  using TileShape = TileShape_;
  using ClusterShape = ClusterShape_;

  // Scale granularity (M, N, K) = (1, 128, 128): a scale per token per group (SFA, MN-major:
  // tokens contiguous) and one per 128 x 128 weight block (SFB, K-major: groups contiguous).
  // Swapped, the same scales the other way round: (128, 1, 128), SFA K-major, SFB MN-major.
  using ScaleConfig = cute::conditional_t<
      kSwapAB,
      cutlass::detail::Sm90BlockwiseScaleConfig<kGroup, 1, kGroup, cute::GMMA::Major::K,
                                                cute::GMMA::Major::MN>,
      cutlass::detail::Sm90BlockwiseScaleConfig<1, kGroup, kGroup, cute::GMMA::Major::MN,
                                                cute::GMMA::Major::K>>;
  using LayoutSFA = decltype(ScaleConfig::deduce_layoutSFA());
  using LayoutSFB = decltype(ScaleConfig::deduce_layoutSFB());

  using CollectiveEpilogue = typename cutlass::epilogue::collective::CollectiveBuilder<
      ArchTag, OperatorClass, TileShape, ClusterShape,
      cutlass::epilogue::collective::EpilogueTileAuto,
      ElementAccumulator, ElementCompute,
      ElementC, LayoutD, AlignmentD,
      ElementD, LayoutD, AlignmentD,
      EpilogueSchedule_>::CollectiveOp;

  using CollectiveMainloop = typename cutlass::gemm::collective::CollectiveBuilder<
      ArchTag, OperatorClass,
      ElementA, cute::tuple<LayoutA, LayoutSFA>, AlignmentA,
      ElementB, cute::tuple<LayoutB, LayoutSFB>, AlignmentB,
      ElementAccumulator, TileShape, ClusterShape,
      // as many pipeline stages as fit next to the epilogue's shared memory
      cutlass::gemm::collective::StageCountAutoCarveout<
          static_cast<int>(sizeof(typename CollectiveEpilogue::SharedStorage))>,
      KernelSchedule_>::CollectiveOp;

  using GemmKernel = cutlass::gemm::kernel::GemmUniversal<
      cute::Shape<int, int, int, int>,  // (M, N, K, L = 1)
      cute::conditional_t<kOverlap_, OverlappedPromotion<CollectiveMainloop>,
                          ScalesAfterWait<CollectiveMainloop>>,
      CollectiveEpilogue, TileScheduler_>;
  using Gemm = cutlass::gemm::device::GemmUniversalAdapter<GemmKernel>;

  using StrideA = typename GemmKernel::StrideA;
  using StrideB = typename GemmKernel::StrideB;
  using StrideC = typename GemmKernel::StrideC;
  using StrideD = typename GemmKernel::StrideD;

  static typename Gemm::Arguments arguments(const Call& c) {
    cutlass::KernelHardwareInfo hw_info;
    hw_info.device_id = c.device;
    hw_info.sm_count = c.sm_count;  // cached: no device query per call
    if constexpr (kSwapAB) {
      // The problem (N, M, K): A = w, B = xq; the token scales (SFB) span scale_stride columns.
      const LayoutSFA layout_sfa =
          ScaleConfig::tile_atom_to_shape_SFA(make_shape(c.n, c.m, c.k, 1));
      const LayoutSFB layout_sfb =
          ScaleConfig::tile_atom_to_shape_SFB(make_shape(c.n, c.scale_stride, c.k, 1));
      return typename Gemm::Arguments{
          cutlass::gemm::GemmUniversalMode::kGemm,
          {c.n, c.m, c.k, 1},
          {static_cast<const ElementA*>(c.w),
           cutlass::make_cute_packed_stride(StrideA{}, {c.n, c.k, 1}),
           static_cast<const ElementB*>(c.xq),
           cutlass::make_cute_packed_stride(StrideB{}, {c.m, c.k, 1}),
           c.w_scales, layout_sfa, c.x_scales, layout_sfb},
          {{1.0f, 0.0f},
           nullptr, cutlass::make_cute_packed_stride(StrideC{}, {c.n, c.m, 1}),
           static_cast<ElementD*>(c.out),
           cutlass::make_cute_packed_stride(StrideD{}, {c.n, c.m, 1})},
          hw_info};
    }
    // SFA spans scale_stride rows (see the top of the file), its groups scale_stride apart.
    const LayoutSFA layout_sfa =
        ScaleConfig::tile_atom_to_shape_SFA(make_shape(c.scale_stride, c.n, c.k, 1));
    const LayoutSFB layout_sfb = ScaleConfig::tile_atom_to_shape_SFB(make_shape(c.m, c.n, c.k, 1));

    typename Gemm::Arguments args{
        cutlass::gemm::GemmUniversalMode::kGemm,
        {c.m, c.n, c.k, 1},
        {static_cast<const ElementA*>(c.xq),
         cutlass::make_cute_packed_stride(StrideA{}, {c.m, c.k, 1}),
         static_cast<const ElementB*>(c.w),
         cutlass::make_cute_packed_stride(StrideB{}, {c.n, c.k, 1}),
         c.x_scales, layout_sfa, c.w_scales, layout_sfb},
        {{1.0f, 0.0f},
         nullptr, cutlass::make_cute_packed_stride(StrideC{}, {c.m, c.n, 1}),
         static_cast<ElementD*>(c.out), cutlass::make_cute_packed_stride(StrideD{}, {c.m, c.n, 1})},
        hw_info};
    return args;  // the scheduler's defaults: heuristic decomposition / raster, no swizzle
  }

  static size_t workspace_size(const Call& c) { return Gemm::get_workspace_size(arguments(c)); }

  static cudaError_t run(const Call& c, void* workspace, size_t workspace_bytes,
                         cudaStream_t stream) {
    auto args = arguments(c);
    if (Gemm::can_implement(args) != cutlass::Status::kSuccess) return cudaErrorNotSupported;
    if (Gemm::get_workspace_size(args) > workspace_bytes) return cudaErrorInvalidValue;
    Gemm gemm;
    // initialize builds the TMA descriptors on the host and zeroes the stream-K barriers with
    // cudaMemsetAsync on the stream: graph-capturable.
    if (gemm.initialize(args, workspace, stream) != cutlass::Status::kSuccess) {
      const cudaError_t err = cudaGetLastError();
      return err != cudaSuccess ? err : cudaErrorUnknown;
    }
    // PDL (cutlass_gdc.h): Qwen3-8B-FP8 + FP8 KV workload 13,297 / 13,272 output tok/s against
    // 13,196 / 13,177 without (H200, alternating in one lease).
    if (gemm.run(stream, /*cuda_adapter=*/nullptr, /*launch_with_pdl=*/true) !=
        cutlass::Status::kSuccess) {
      const cudaError_t err = cudaGetLastError();
      return err != cudaSuccess ? err : cudaErrorLaunchFailure;
    }
    return cudaGetLastError();
  }
};

// The configurations (each instantiation costs minutes of nvcc: keep them few).
//   Coop128: 128 x 128 tile, two consumer warp groups of 64 rows each; a 1 x 2 cluster multicasts
//     the activation tile to the two CTAs of neighbouring weight tiles. Stream-K scheduler.
//   Pingpong64: 64 x 128 tile per consumer warp group, the two alternating so that one's
//     epilogue overlaps the other's mainloop; half the row padding of Coop128 when M is not a
//     multiple of 128, twice the tiles. Persistent scheduler, same cluster.
// (A 128 x 256 tile would need 2 x 128 fp32 accumulator registers a thread with the promotion
// buffer: past the 232 a consumer thread gets.)
using Coop128 = BlockScaledGemm<
    Shape<_128, _128, _128>, Shape<_1, _2, _1>,
    cutlass::gemm::KernelTmaWarpSpecializedCooperativeFP8BlockScaledAccum,
    cutlass::epilogue::TmaWarpSpecializedCooperative,
    cutlass::gemm::StreamKScheduler, false, true>;
using Pingpong64 = BlockScaledGemm<
    Shape<_64, _128, _128>, Shape<_1, _2, _1>,
    cutlass::gemm::KernelTmaWarpSpecializedPingpongFP8BlockScaledAccum,
    cutlass::epilogue::TmaWarpSpecialized,
    cutlass::gemm::PersistentScheduler, false, true>;

// Swapped (the weight's rows are the tile's M, tokens its N), for a few dozen to a hundred tokens:
// a tile's token side is 64 instead of 128, and the weight's 128-row blocks give N / 128 tiles
// per 64 tokens.
//   SwapPingpong128x64: 128 weight rows x 64 tokens per consumer warp group, persistent.
using SwapPingpong128x64 = BlockScaledGemm<
    Shape<_128, _64, _128>, Shape<_1, _1, _1>,
    cutlass::gemm::KernelTmaWarpSpecializedPingpongFP8BlockScaledAccum,
    cutlass::epilogue::TmaWarpSpecialized,
    cutlass::gemm::PersistentScheduler, true, true>;

// For a handful of tokens (the decode steps of a few sequences, batch 1): the same swap with a
// token side of 16 or 32 (wgmma N = 16 / 32), so no token-row padding beyond 16 / 32 and no e4m3
// conversion on the CUDA cores (the weight-streaming passes of linear_fp8_gemv.cu widen every
// weight byte to f16 for mma.sync; wgmma reads e4m3 as it is). N / 128 tiles, spread over every SM
// by stream-K: each SM streams a slice of the weight's K through the TMA ring.
//   SwapCoop128x16, SwapCoop128x32: 128 weight rows x 16 / 32 tokens, cooperative, stream-K.
using SwapCoop128x16 = BlockScaledGemm<
    Shape<_128, _16, _128>, Shape<_1, _1, _1>,
    cutlass::gemm::KernelTmaWarpSpecializedCooperativeFP8BlockScaledAccum,
    cutlass::epilogue::TmaWarpSpecializedCooperative,
    cutlass::gemm::StreamKScheduler, true, true>;
using SwapCoop128x32 = BlockScaledGemm<
    Shape<_128, _32, _128>, Shape<_1, _1, _1>,
    cutlass::gemm::KernelTmaWarpSpecializedCooperativeFP8BlockScaledAccum,
    cutlass::epilogue::TmaWarpSpecializedCooperative,
    cutlass::gemm::StreamKScheduler, true, true>;

// For the decode steps of ~130..190 sequences (the throughput schedule's 176): 96 tokens a tile,
// so M = 176 pads to 192 in two tiles a weight tile (Coop128: 256; a 64-token tile: three tiles).
// (192 tokens a tile, one a weight tile, spills on CUTLASS's mainloop already: 72 bytes of stack
// a thread, and would not fit the second temporary tile.)
using SwapCoop128x96 = BlockScaledGemm<
    Shape<_128, _96, _128>, Shape<_1, _1, _1>,
    cutlass::gemm::KernelTmaWarpSpecializedCooperativeFP8BlockScaledAccum,
    cutlass::epilogue::TmaWarpSpecializedCooperative,
    cutlass::gemm::StreamKScheduler, true, true>;

enum class Config {
  kCoop128, kPingpong64, kSwapPingpong128x64, kSwapCoop128x16, kSwapCoop128x32, kSwapCoop128x96
};

// The choice, by shape, from benchmarks/linear_fp8_ab on the H200 (every configuration on
// Qwen3-8B's projections, overlapped promotion, weights rotated past the L2; best of two rounds,
// us; the winner against the next best or the configuration the cell ran before):
//   - M <= 64: SwapCoop128x16 (x32 from 33 tokens where N > 4096): the weight's rows as the
//     wgmma M and 16 / 32 tokens as N, so few tokens pad nothing, and stream-K spreads the N / 128
//     tiles' K over every SM. M = 32: qkv 10.1, gate_up 28.6, down 20.8 (o: Pingpong64 10.8 vs
//     12.9, left); M = 64: qkv (x32) 10.6, o 9.1, gate_up (x32) 29.8, down 19.4.
//   - M <= 128: N <= 4096 (o, down) SwapCoop128x32 (o 10.3-10.4; down 22.1-22.3 vs the
//     cooperative 128 x 64 swapped tile 24.9-25.7), N <= 8192 (qkv) Pingpong64 (13.0-13.4),
//     wider (gate_up) SwapPingpong128x64 (32.7-34.2 vs Coop128 36.9-38.5).
//   - M <= 192 (the decode steps of the throughput schedule, <= 176 sequences): N <= 4096
//     Pingpong64 (o 11.2-13.0, down 25.9-30.6), else SwapCoop128x96: 96 tokens a tile, M = 176
//     in two (gate_up 45.2-46.1 vs Coop128 55.0-65.6 at 144..192; qkv 17.0-17.1 vs 16.8-18.6).
//   - M <= 256: o Pingpong64 (12.9-14.4); the rest Coop128 (down 29.9-30.5 vs Pingpong64
//     31.0-35.8; qkv 15.1-15.5, gate_up 46.1-47.4).
//   - Above: Coop128 (M = 384: qkv 25.4, o 15.1, gate_up 69.4, down 36.5, each the best; 512 and
//     up the best or within 5% of Coop128 with a 2 x 1 cluster, the harness's coop128mc),
//     data-parallel or stream-K by CUTLASS's heuristic on the wave count.
// Qwen3-8B-FP8 + FP8 KV workload against the choice before (H100, alternating in one lease):
// 12,433 / 12,441 against 12,282 / 12,284 output tok/s.
// Lost at 129..256 tokens (branch experiment/fp8-gemm-mid-clusters, linear_fp8_ab `mid`, H100):
// SwapCoop128x96 in a 1 x 2, 2 x 1 or 2 x 2 cluster (TMA multicast of the weight tile to both
// token tiles, or of the token tile to two weight tiles): at M = 176 1 x 2 1.01x (gate_up 45.4
// vs 45.7 us, qkv 17.0 vs 17.2), 2 x 1 0.94-1.01x, 2 x 2 0.81-0.97x, so L2-to-SM traffic is not
// what holds that tile at ~2.2 TB/s; forced data-parallel, stream-K or split-K 2 / 3
// decompositions 0.53-1.00x. Down at 144..192 would take SwapCoop128x96 on the H100 (31.0-32.2
// vs Pingpong64 32.3-34.3 us); the H200 sweep above chose Pingpong64 there.
Config choose(int64_t m, int64_t n, int64_t k) {
  if (m <= 32) return Config::kSwapCoop128x16;
  if (m <= 64) return n <= 4096 ? Config::kSwapCoop128x16 : Config::kSwapCoop128x32;
  if (m <= 128) {
    if (n <= 4096) return Config::kSwapCoop128x32;
    return n <= 8192 ? Config::kPingpong64 : Config::kSwapPingpong128x64;
  }
  if (m <= 192) return n <= 4096 ? Config::kPingpong64 : Config::kSwapCoop128x96;
  if (m <= 256 && n <= 4096 && k <= 4096) return Config::kPingpong64;
  return Config::kCoop128;
}

// The configuration's workspace size and run, by value: the configurations choose() returns (each
// one instantiated costs minutes of nvcc; benchmarks/linear_fp8_ab reaches the others directly).
template <class G>
size_t workspace_of(const Call& c) { return G::workspace_size(c); }
size_t config_workspace_size(Config config, const Call& c) {
  switch (config) {
    case Config::kPingpong64: return workspace_of<Pingpong64>(c);
    case Config::kSwapCoop128x16: return workspace_of<SwapCoop128x16>(c);
    case Config::kSwapCoop128x32: return workspace_of<SwapCoop128x32>(c);
    case Config::kSwapCoop128x96: return workspace_of<SwapCoop128x96>(c);
    case Config::kSwapPingpong128x64: return workspace_of<SwapPingpong128x64>(c);
    default: return workspace_of<Coop128>(c);
  }
}
cudaError_t run_config(Config config, const Call& c, void* workspace, size_t workspace_bytes,
                       cudaStream_t stream) {
  switch (config) {
    case Config::kPingpong64: return Pingpong64::run(c, workspace, workspace_bytes, stream);
    case Config::kSwapCoop128x16: return SwapCoop128x16::run(c, workspace, workspace_bytes, stream);
    case Config::kSwapCoop128x32: return SwapCoop128x32::run(c, workspace, workspace_bytes, stream);
    case Config::kSwapCoop128x96: return SwapCoop128x96::run(c, workspace, workspace_bytes, stream);
    case Config::kSwapPingpong128x64:
      return SwapPingpong128x64::run(c, workspace, workspace_bytes, stream);
    default: return Coop128::run(c, workspace, workspace_bytes, stream);
  }
}

// Fills the call but its buffers; cudaErrorNotSupported off compute 9.0 (sm_90a code only).
cudaError_t make_call(int64_t m, int64_t n, int64_t k, int64_t scale_stride, Call& c,
                      Config& config) {
  constexpr int64_t kIntMax = std::numeric_limits<int>::max();
  if (m < 1 || n < 8 || k < 16 || n % 8 != 0 || k % 16 != 0 || scale_stride < m ||
      scale_stride % 4 != 0 || m > kIntMax || n > kIntMax || k > kIntMax ||
      scale_stride > kIntMax) {
    return cudaErrorInvalidValue;
  }
  const DeviceInfo d = current_device_info();
  if (d.cc_major != 9 || d.cc_minor != 0 || d.num_sms <= 0) return cudaErrorNotSupported;
  int device = 0;
  const cudaError_t err = cudaGetDevice(&device);
  if (err != cudaSuccess) return err;
  c = Call{};
  c.m = static_cast<int>(m);
  c.n = static_cast<int>(n);
  c.k = static_cast<int>(k);
  c.scale_stride = static_cast<int>(scale_stride);
  c.device = device;
  c.sm_count = d.num_sms;
  config = choose(m, n, k);
  return cudaSuccess;
}

}  // namespace

size_t gemm_workspace_size(int64_t m, int64_t n, int64_t k) {
  Call c;
  Config config;
  // The workspace (stream-K partial tiles and barriers) depends on the tiles, not on where the
  // scales live: any valid scale_stride gives the size gemm() will ask for.
  if (make_call(m, n, k, (m + 3) / 4 * 4, c, config) != cudaSuccess) return 0;
  return config_workspace_size(config, c);
}

cudaError_t gemm(void* out, const void* xq, const float* x_scales, int64_t scale_stride,
                 const void* w, const float* w_scales, int64_t m, int64_t n, int64_t k,
                 void* workspace, size_t workspace_bytes, cudaStream_t stream) {
  Call c;
  Config config;
  const cudaError_t err = make_call(m, n, k, scale_stride, c, config);
  if (err != cudaSuccess) return err;
  // TMA needs 16-byte aligned bases (its rows are: K % 16, N % 8, scale_stride % 4 == 0).
  for (const void* p : {static_cast<const void*>(out), xq, static_cast<const void*>(x_scales), w,
                        static_cast<const void*>(w_scales)}) {
    if (reinterpret_cast<uintptr_t>(p) % 16 != 0) return cudaErrorMisalignedAddress;
  }
  c.out = out;
  c.xq = xq;
  c.x_scales = x_scales;
  c.w = w;
  c.w_scales = w_scales;
  return run_config(config, c, workspace, workspace_bytes, stream);
}

}  // namespace qwen3_kernels::fp8
