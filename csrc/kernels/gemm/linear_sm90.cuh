// linear on Hopper with CUTLASS 3.x: out[M, N] = x[M, K] @ w[N, K]^T, 16-bit in, fp32 accumulate.
//
// What the kernel shows (in the style of CUTLASS example 48):
//   1. TMA loads of both operands into a multi-stage shared-memory ring, consumed by wgmma
//      (warp-specialized: one producer warp group issues TMA, two consumer warp groups run wgmma on
//      halves of the tile: the "cooperative" schedule), TMA store of the output.
//   2. A persistent grid of one CTA per SM walking the tiles with the stream-K scheduler, whose
//      decomposition (data-parallel, split-K with S splits, stream-K, or CUTLASS's heuristic) is a
//      runtime argument: one instantiation covers every way of cutting the work.
//   3. Swapped operands (kSwapAB) for few tokens: out^T[N, M] = w[N, K] @ x[M, K]^T puts the
//      weight rows on the 64- or 128-wide M side of the wgmma tile instead of padding 1..64
//      tokens up to a 128-row tile; out^T is out read column-major, so no transpose is needed.
//      The batch-invariant mode's small-M tiles (swap_*); the default table picks none (cuBLAS
//      was faster there).
//   4. kCooperative = false: one consumer warp group on a 64-row tile, one tile per CTA (CUTLASS's
//      KernelTmaWarpSpecialized): twice the CTAs of a 128-row tile on a decode step's weight.
//
// Each instantiation lives in its own TU (linear_<config>_<dtype>.cu) so the build parallelises;
// this header is included only there. No torch headers: kernels are plain CUDA, and only
// csrc/torch_bindings.cpp sees tensors.
#pragma once

#include <cuda_runtime.h>

#include "cutlass_gdc.h"  // first: griddepcontrol in the CUTLASS kernels
#include "cute/tensor.hpp"
#include "cutlass/cutlass.h"
#include "cutlass/epilogue/collective/collective_builder.hpp"
#include "cutlass/gemm/collective/collective_builder.hpp"
#include "cutlass/gemm/device/gemm_universal_adapter.h"
#include "cutlass/gemm/dispatch_policy.hpp"
#include "cutlass/gemm/kernel/gemm_universal.hpp"
#include "cutlass/gemm/kernel/tile_scheduler_params.h"
#include "cutlass/util/packed_stride.hpp"

#include "linear_configs.h"

namespace qwen3_kernels::linear_detail {

// PDL (cutlass_gdc.h) up to this many tokens: the kernel starts while the previous one finishes
// (CUTLASS's producer waits for it before touching global memory). It pays where the step is a
// chain of short kernels and costs where they are long (H200, the deterministic mode, which runs
// these tiles at every M, PDL at every M against none: Qwen3-8B batch 1 226.7 / 226.7 against
// 214.4 / 214.5 decode tok/s, the 8B workload 8,783-8,794 against 9,034-9,056 output tok/s).
// Up to 64 tokens (H100, one call, with the decode kernels' early K/V copies of branch
// experiment/decode-kv-before-wait, which moved the default mode's batch 1 by 0.1%): the mode's
// Qwen3-8B batch 1 169.4 / 169.4 against 163.6 / 163.5 decode tok/s (0.956x the default's 177.2
// against 0.923x), its 8B workload 8,000 against 8,012 output tok/s.
constexpr int64_t kPdlMaxTokens = 64;

template <class Element_,       // cutlass::bfloat16_t or cutlass::half_t
          class TileShape_,     // CTA tile in the CUTLASS problem: (M', N', K)
          class ClusterShape_,  // CTAs per cluster along (M', N', 1): multicast of the shared operand
          bool kSwapAB,         // true: CUTLASS problem is out^T = w @ x^T (decode)
          bool kCooperative = true>  // false: one consumer warp group, a 64-row tile, one tile
                                     // per CTA (data-parallel only)
struct Sm90Gemm {
  // In both orientations the two operands are K-major (x and w are row-major [., K]), which is
  // what wgmma reads without a transpose; only the role of x and w and the output layout change.
  using Element            = Element_;
  using ElementA           = Element;                                       // A: w when swapped, else x
  using LayoutA            = cutlass::layout::RowMajor;                     // [M', K], K contiguous
  static constexpr int AlignmentA = 128 / cutlass::sizeof_bits<Element>::value;  // 16-byte TMA rows: K % 8 == 0
  using ElementB           = Element;                                       // B: x when swapped, else w
  using LayoutB            = cutlass::layout::ColumnMajor;                  // [K, N'] stored as [N', K]: K contiguous
  static constexpr int AlignmentB = AlignmentA;                             // same 16-byte rows
  using ElementD           = Element;                                       // out, rounded from fp32
  using LayoutD            = cute::conditional_t<kSwapAB,                   // out[M, N] row-major is out^T
                                                 cutlass::layout::ColumnMajor,  //   column-major when swapped
                                                 cutlass::layout::RowMajor>;
  static constexpr int AlignmentD = AlignmentA;                             // N % 8 == 0: 16-byte output rows
  using ElementC           = void;                                          // no source operand: D = acc
  using ElementAccumulator = float;                                         // fp32 accumulate
  using ElementCompute     = float;                                         // epilogue math in fp32
  using ArchTag            = cutlass::arch::Sm90;                           // wgmma + TMA
  using OperatorClass      = cutlass::arch::OpClassTensorOp;                // tensor cores
  using TileShape          = TileShape_;                                    // see the config TUs
  using ClusterShape       = ClusterShape_;                                 // see the config TUs
  using KernelSchedule     = cute::conditional_t<kCooperative,
                                                 cutlass::gemm::KernelTmaWarpSpecializedCooperative,  // 2 consumer WGs share a tile; stream-K needs it
                                                 cutlass::gemm::KernelTmaWarpSpecialized>;  // 1 consumer WG
  using EpilogueSchedule   = cute::conditional_t<kCooperative,
                                                 cutlass::epilogue::TmaWarpSpecializedCooperative,
                                                 cutlass::epilogue::TmaWarpSpecialized>;  // matches the mainloop
  using TileScheduler      = cute::conditional_t<kCooperative,
                                                 cutlass::gemm::StreamKScheduler,  // persistent; DP / split-K / stream-K at run time
                                                 void>;  // a grid of one CTA per tile

  using CollectiveEpilogue = typename cutlass::epilogue::collective::CollectiveBuilder<
      ArchTag, OperatorClass, TileShape, ClusterShape,
      cutlass::epilogue::collective::EpilogueTileAuto,
      ElementAccumulator, ElementCompute,
      ElementC, LayoutD, AlignmentD,
      ElementD, LayoutD, AlignmentD,
      EpilogueSchedule>::CollectiveOp;

  using CollectiveMainloop = typename cutlass::gemm::collective::CollectiveBuilder<
      ArchTag, OperatorClass,
      ElementA, LayoutA, AlignmentA,
      ElementB, LayoutB, AlignmentB,
      ElementAccumulator, TileShape, ClusterShape,
      // as many pipeline stages as fit next to the epilogue's shared memory
      cutlass::gemm::collective::StageCountAutoCarveout<
          static_cast<int>(sizeof(typename CollectiveEpilogue::SharedStorage))>,
      KernelSchedule>::CollectiveOp;

  using GemmKernel = cutlass::gemm::kernel::GemmUniversal<
      cute::Shape<int, int, int, int>,  // (M', N', K, L = 1)
      CollectiveMainloop, CollectiveEpilogue, TileScheduler>;
  using Gemm = cutlass::gemm::device::GemmUniversalAdapter<GemmKernel>;

  using StrideA = typename Gemm::GemmKernel::StrideA;
  using StrideB = typename Gemm::GemmKernel::StrideB;
  using StrideC = typename Gemm::GemmKernel::StrideC;
  using StrideD = typename Gemm::GemmKernel::StrideD;
  using DecompositionMode = cutlass::gemm::kernel::detail::DecompositionMode;

  static typename Gemm::Arguments arguments(const Problem& p) {
    // The CUTLASS problem (M', N'): swapped, the weight rows are M' and the tokens N'.
    const int pm = static_cast<int>(kSwapAB ? p.n : p.m);
    const int pn = static_cast<int>(kSwapAB ? p.m : p.n);
    const int pk = static_cast<int>(p.k);
    const void* a = kSwapAB ? p.w : p.x;
    const void* b = kSwapAB ? p.x : p.w;

    cutlass::KernelHardwareInfo hw_info;
    hw_info.device_id = p.device;
    hw_info.sm_count = p.sm_count;  // cached by the dispatcher: no device query per call

    typename Gemm::Arguments args{
        cutlass::gemm::GemmUniversalMode::kGemm,
        {pm, pn, pk, 1},
        {static_cast<const Element*>(a), cutlass::make_cute_packed_stride(StrideA{}, {pm, pk, 1}),
         static_cast<const Element*>(b), cutlass::make_cute_packed_stride(StrideB{}, {pn, pk, 1})},
        {{1.0f, 0.0f},
         nullptr, cutlass::make_cute_packed_stride(StrideC{}, {pm, pn, 1}),
         static_cast<Element*>(p.out), cutlass::make_cute_packed_stride(StrideD{}, {pm, pn, 1})},
        hw_info};
    if constexpr (kCooperative) {  // else data-parallel by construction
      switch (p.decomposition) {
        case Decomposition::kDataParallel:
          args.scheduler.decomposition_mode = DecompositionMode::DataParallel;
          break;
        case Decomposition::kSplitK:
          args.scheduler.decomposition_mode = DecompositionMode::SplitK;
          args.scheduler.splits = p.splits;
          break;
        case Decomposition::kStreamK:
          args.scheduler.decomposition_mode = DecompositionMode::StreamK;
          break;
        default:
          args.scheduler.decomposition_mode = DecompositionMode::Heuristic;
          break;
      }
    }
    return args;
  }

  static size_t workspace_size(const Problem& p) { return Gemm::get_workspace_size(arguments(p)); }

  static cudaError_t run(const Problem& p) {
    auto args = arguments(p);
    if (Gemm::can_implement(args) != cutlass::Status::kSuccess) return cudaErrorNotSupported;
    if (Gemm::get_workspace_size(args) > p.workspace_bytes) return cudaErrorInvalidValue;
    Gemm gemm;
    // initialize zeroes the stream-K barriers with cudaMemsetAsync on the stream: graph-capturable.
    if (gemm.initialize(args, p.workspace, p.stream) != cutlass::Status::kSuccess) {
      cudaError_t err = cudaGetLastError();
      return err != cudaSuccess ? err : cudaErrorUnknown;
    }
    if (gemm.run(p.stream, /*cuda_adapter=*/nullptr, /*launch_with_pdl=*/p.m <= kPdlMaxTokens) !=
        cutlass::Status::kSuccess) {
      cudaError_t err = cudaGetLastError();
      return err != cudaSuccess ? err : cudaErrorLaunchFailure;
    }
    return cudaGetLastError();
  }
};

}  // namespace qwen3_kernels::linear_detail
