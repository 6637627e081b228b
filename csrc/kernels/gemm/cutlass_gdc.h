// Included before any CUTLASS header by linear_fp8_sm90.cu and linear_sm90.cuh, whose GEMMs run()
// launches with PDL like the kernels around them (the bf16 tiles up to kPdlMaxTokens tokens):
// CUTLASS's producer warps wait for the previous kernel (griddepcontrol.wait) before their first
// global load, so the GEMM's launch and prologue overlap the previous kernel's tail.
//
// CUTLASS_GDC_ENABLED is the switch cutlass/arch/grid_dependency_control.h reads. CUTLASS defines
// it itself only under CUTLASS_ENABLE_GDC_FOR_SM90, which also compiles an early trigger into the
// cooperative kernel that does not build with the stream-K scheduler (CUTLASS 4.2: is_last_tile
// binds a const member to a non-const reference). Set for sm_90a device code only: griddepcontrol
// does not exist before sm_90, and without a PDL launch the wait returns at once.
#pragma once

#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ == 900 && defined(__CUDA_ARCH_FEAT_SM90_ALL)
#define CUTLASS_GDC_ENABLED
#endif
