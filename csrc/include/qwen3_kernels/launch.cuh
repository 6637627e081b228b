// Host and device helpers for kernels with run-time selectable launch variants (activation.cu,
// norm.cu): a process-wide variant knob (set from the environment once, flipped by a benchmark
// through a C hook), cached device properties, cudaLaunchKernelEx with PDL / cluster attributes.
#pragma once

#include <cuda_runtime.h>

#include <atomic>
#include <cstdlib>
#include <cstring>
#include <type_traits>

namespace qwen3_kernels {

// ---- device --------------------------------------------------------------------------------------

// Programmatic dependent launch (sm_90+). A kernel launched with the PDL attribute may be scheduled
// while its predecessor still runs; pdl_wait() blocks until that predecessor has finished and its
// writes are visible, so nothing that reads or writes tensor memory may come before it. Both are
// no-ops without PDL and compile to nothing for sm_80.
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

// One op's launch variant: an index into the op's name table, initialised from the environment
// variable on first use (a name or an index; anything else means 0 = the default), then changed
// only through set(). Read once per launch: one relaxed atomic load, no getenv.
template <int kCount>
class VariantKnob {
 public:
  VariantKnob(const char* env, const char* const (&names)[kCount]) : env_(env), names_(names) {}

  int get() {
    int v = value_.load(std::memory_order_relaxed);
    if (v >= 0) return v;
    v = parse(std::getenv(env_));
    value_.store(v < 0 ? 0 : v, std::memory_order_relaxed);
    return value_.load(std::memory_order_relaxed);
  }
  // Returns the previous value, or -1 (nothing changed) when v is out of range.
  int set(int v) {
    if (v < 0 || v >= kCount) return -1;
    const int old = get();
    value_.store(v, std::memory_order_relaxed);
    return old;
  }
  const char* name(int v) const { return v >= 0 && v < kCount ? names_[v] : nullptr; }
  static constexpr int count() { return kCount; }

 private:
  int parse(const char* s) const {
    if (s == nullptr || *s == '\0') return 0;
    for (int i = 0; i < kCount; ++i)
      if (std::strcmp(s, names_[i]) == 0) return i;
    char* end = nullptr;
    const long v = std::strtol(s, &end, 10);
    return end != s && *end == '\0' && v >= 0 && v < kCount ? static_cast<int>(v) : 0;
  }

  const char* env_;
  const char* const* names_;
  std::atomic<int> value_{-1};
};

// Compute capability major and SM count of the current device, queried once per device (a launch
// must not ask the driver each time). 0 when the query fails: callers then take the plain path.
struct DeviceInfo {
  int cc_major = 0;
  int num_sms = 0;
};

inline DeviceInfo current_device_info() {
  constexpr int kMaxDevices = 64;
  static std::atomic<int> cc[kMaxDevices], sms[kMaxDevices];  // 0 = not asked yet
  int dev = 0;
  if (cudaGetDevice(&dev) != cudaSuccess || dev < 0 || dev >= kMaxDevices) return {};
  DeviceInfo info{cc[dev].load(std::memory_order_relaxed), sms[dev].load(std::memory_order_relaxed)};
  if (info.cc_major > 0 && info.num_sms > 0) return info;
  if (cudaDeviceGetAttribute(&info.cc_major, cudaDevAttrComputeCapabilityMajor, dev) != cudaSuccess ||
      cudaDeviceGetAttribute(&info.num_sms, cudaDevAttrMultiProcessorCount, dev) != cudaSuccess) {
    cudaGetLastError();  // clear it: the op's launch check must not report a failed query
    return {};
  }
  cc[dev].store(info.cc_major, std::memory_order_relaxed);
  sms[dev].store(info.num_sms, std::memory_order_relaxed);
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

// ---- PDL launch variants ---------------------------------------------------------------------------

// How a weight-streaming kernel (linear_gemv.cu) is launched: plainly, or with PDL, optionally
// reading its weight's first stage before the wait (early: the weight is no kernel's output during
// a forward) and / or triggering its dependents after its last store rather than at once (late).
// The kernel takes one as its kLaunch template parameter and reads the flags from
// LaunchTraits<kLaunch>; launch_pdl_variant instantiates and launches the one asked for.
enum LaunchVariant {
  kLaunchPlain, kLaunchPdl, kLaunchPdlEarly, kLaunchPdlLate, kLaunchPdlEarlyLate, kNumLaunchVariants
};

template <int kLaunch>
struct LaunchTraits {
  static_assert(kLaunch >= 0 && kLaunch < kNumLaunchVariants, "a LaunchVariant");
  static constexpr bool kPdl = kLaunch != kLaunchPlain;
  static constexpr bool kEarly = kLaunch == kLaunchPdlEarly || kLaunch == kLaunchPdlEarlyLate;
  static constexpr bool kLate = kLaunch == kLaunchPdlLate || kLaunch == kLaunchPdlEarlyLate;
};

// Launches kernel_of(std::integral_constant<int, V>{}) (a generic lambda returning the kernel
// instantiated for variant V) for the run-time variant: with the PDL attribute unless V is plain,
// and plainly on a device without PDL (before sm_90) or for a variant out of range.
template <typename KernelOf, typename... Args>
cudaError_t launch_pdl_variant(KernelOf kernel_of, int variant, dim3 grid, dim3 block,
                               cudaStream_t stream, Args... args) {
  if (current_device_info().cc_major < 9) variant = kLaunchPlain;
  auto go = [&](auto v) {
    return launch_ex(kernel_of(v), grid, block, stream, decltype(v)::value != kLaunchPlain, 1,
                     args...);
  };
  switch (variant) {
    case kLaunchPdl: return go(std::integral_constant<int, kLaunchPdl>{});
    case kLaunchPdlEarly: return go(std::integral_constant<int, kLaunchPdlEarly>{});
    case kLaunchPdlLate: return go(std::integral_constant<int, kLaunchPdlLate>{});
    case kLaunchPdlEarlyLate: return go(std::integral_constant<int, kLaunchPdlEarlyLate>{});
    default: return go(std::integral_constant<int, kLaunchPlain>{});
  }
}
static_assert(kNumLaunchVariants == 5, "launch_pdl_variant's switch lists every variant");

}  // namespace qwen3_kernels

// C hooks that a benchmark or test finds with ctypes in the loaded extension; not the op surface.
#define QWEN3_TUNING_EXPORT extern "C" __attribute__((visibility("default")))

// The four hooks of one VariantKnob, at global scope (KNOB: an expression naming the knob):
//   PREFIX_set_variant(v)   selects the variant of the following launches; returns the previous
//                           index, or -1 (nothing changed) when v is out of range
//   PREFIX_get_variant()    the current index
//   PREFIX_num_variants()   how many there are
//   PREFIX_variant_name(v)  the variant's name, or nullptr out of range
// qwen3_kernels/elementwise_tuning.py and decode_tuning.py find them by these names.
#define QWEN3_TUNING_HOOKS(PREFIX, KNOB)                                                      \
  QWEN3_TUNING_EXPORT int PREFIX##_set_variant(int v) { return (KNOB).set(v); }               \
  QWEN3_TUNING_EXPORT int PREFIX##_get_variant() { return (KNOB).get(); }                     \
  QWEN3_TUNING_EXPORT int PREFIX##_num_variants() { return (KNOB).count(); }                  \
  QWEN3_TUNING_EXPORT const char* PREFIX##_variant_name(int v) { return (KNOB).name(v); }
