// Launch helpers shared by the kernels: programmatic dependent launch (PDL) on the device, the
// current device's properties cached on the host, cudaLaunchKernelEx with PDL / cluster attributes.
#pragma once

#include <cuda_runtime.h>

#include <atomic>
#include <type_traits>

namespace qwen3_kernels {

// ---- device --------------------------------------------------------------------------------------

// Programmatic dependent launch (sm_90+). A kernel launched with the PDL attribute may be scheduled
// while its predecessor still runs; pdl_wait() blocks until that predecessor has finished and its
// writes are visible, so nothing that reads or writes tensor memory may come before it, but for
// what no kernel of the package writes, each stated at its kernel: a GEMV's weight loads, paged
// decode's seq_lens and block-table reads (and its L2 prefetches, which only warm the cache). Both
// are no-ops without PDL and compile to nothing for sm_80.
// pdl_launch_dependents() lets the next kernel be scheduled; its own pdl_wait() still waits for
// this whole grid (and so, transitively, for the grids before it). The small kernels between the
// GEMVs call it before their wait, so the launches cascade through them: a GEMV is resident and
// streams its weight (which no kernel writes) while the chain before it still runs. A GEMV calls
// it after its wait, which ends the cascade there.
__device__ __forceinline__ void pdl_wait() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile("griddepcontrol.wait;\n" ::: "memory");
#endif
}
__device__ __forceinline__ void pdl_launch_dependents() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile("griddepcontrol.launch_dependents;\n" ::);
#endif
}

// ---- host ----------------------------------------------------------------------------------------

// Compute capability, SM count and shared memory per SM of the current device, queried once per
// device (a launch must not ask the driver each time). 0 when the query fails: callers then take
// the plain path.
struct DeviceInfo {
  int cc_major = 0;
  int cc_minor = 0;
  int num_sms = 0;
  int smem_per_sm = 0;  // bytes an SM offers its CTAs (cudaDevAttrMaxSharedMemoryPerMultiprocessor)
};

inline DeviceInfo current_device_info() {
  constexpr int kMaxDevices = 64;
  // major * 10 + minor, the SM count and shared memory per SM; 0 = not asked yet
  static std::atomic<int> cc[kMaxDevices], sms[kMaxDevices], smem[kMaxDevices];
  int dev = 0;
  if (cudaGetDevice(&dev) != cudaSuccess || dev < 0 || dev >= kMaxDevices) return {};
  const int c = cc[dev].load(std::memory_order_relaxed);
  DeviceInfo info{c / 10, c % 10, sms[dev].load(std::memory_order_relaxed),
                  smem[dev].load(std::memory_order_relaxed)};
  if (info.cc_major > 0 && info.num_sms > 0 && info.smem_per_sm > 0) return info;
  if (cudaDeviceGetAttribute(&info.cc_major, cudaDevAttrComputeCapabilityMajor, dev) != cudaSuccess ||
      cudaDeviceGetAttribute(&info.cc_minor, cudaDevAttrComputeCapabilityMinor, dev) != cudaSuccess ||
      cudaDeviceGetAttribute(&info.num_sms, cudaDevAttrMultiProcessorCount, dev) != cudaSuccess ||
      cudaDeviceGetAttribute(&info.smem_per_sm, cudaDevAttrMaxSharedMemoryPerMultiprocessor, dev) !=
          cudaSuccess) {
    cudaGetLastError();  // clear it: the op's launch check must not report a failed query
    return {};
  }
  cc[dev].store(info.cc_major * 10 + info.cc_minor, std::memory_order_relaxed);
  sms[dev].store(info.num_sms, std::memory_order_relaxed);
  smem[dev].store(info.smem_per_sm, std::memory_order_relaxed);
  return info;
}

// A cudaLaunchKernelEx configuration: dynamic shared memory, the PDL attribute (pdl) and/or 1-D
// clusters of `cluster` CTAs along x (> 1). The caller checks that the device has them (sm_90+).
// One object serves an occupancy query (cudaOccupancyMaxActiveClusters takes &cfg) and the launch
// it sizes. Not copyable: cfg points at attrs.
struct LaunchConfig {
  cudaLaunchConfig_t cfg = {};
  cudaLaunchAttribute attrs[2];
  LaunchConfig(dim3 grid, dim3 block, size_t smem_bytes, cudaStream_t stream, bool pdl,
               int cluster) {
    cfg.gridDim = grid;
    cfg.blockDim = block;
    cfg.dynamicSmemBytes = smem_bytes;
    cfg.stream = stream;
    unsigned n = 0;
    if (pdl) {
      attrs[n].id = cudaLaunchAttributeProgrammaticStreamSerialization;
      attrs[n].val.programmaticStreamSerializationAllowed = 1;
      ++n;
    }
    if (cluster > 1) {
      attrs[n].id = cudaLaunchAttributeClusterDimension;
      attrs[n].val.clusterDim.x = static_cast<unsigned>(cluster);
      attrs[n].val.clusterDim.y = 1;
      attrs[n].val.clusterDim.z = 1;
      ++n;
    }
    cfg.attrs = attrs;
    cfg.numAttrs = n;
  }
  LaunchConfig(const LaunchConfig&) = delete;
  LaunchConfig& operator=(const LaunchConfig&) = delete;
};

template <typename... KArgs, typename... Args>
cudaError_t launch_ex(void (*kernel)(KArgs...), const LaunchConfig& c, Args... args) {
  return cudaLaunchKernelEx(&c.cfg, kernel, static_cast<KArgs>(args)...);
}

// The common case: no dynamic shared memory.
template <typename... KArgs, typename... Args>
cudaError_t launch_ex(void (*kernel)(KArgs...), dim3 grid, dim3 block, cudaStream_t stream,
                      bool pdl, int cluster, Args... args) {
  return launch_ex(kernel, LaunchConfig(grid, block, 0, stream, pdl, cluster), args...);
}

}  // namespace qwen3_kernels
