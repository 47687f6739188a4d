// src/cuda/common/cuda_check.hpp - turning CUDA errors into latentkv::Error.
#pragma once

#include <cuda_runtime_api.h>

#include <cstddef>
#include <cstdint>
#include <map>
#include <mutex>
#include <string>
#include <tuple>
#include <utility>

#include "core/validate.hpp"
#include "latentkv/backend.hpp"
#include "latentkv/error.hpp"

namespace latentkv::cuda {

// Throws unless `status` is cudaSuccess. The error is first taken off the thread's last-error
// state, where a failed runtime call also leaves it: otherwise the next launch check
// (LKV_CUDA_CHECK_LAUNCH) would report it again as its own, under another op's name. (An error the
// context keeps, such as a kernel fault, fails every later call anyway.)
inline void check(cudaError_t status, const char* op, const char* what) {
  if (status != cudaSuccess) {
    (void)cudaGetLastError();
    throw Error(op, std::string(what) + " failed: " + cudaGetErrorName(status) + " (" + cudaGetErrorString(status) + ")");
  }
}

// compute() for `key`, computed once per process and kept (thread-safe). Each call site's lambda is
// its own type, so each call site keeps its own map; map nodes stay put, so the reference stays valid.
template <class Key, class Compute>
const auto& once_per_key(const Key& key, Compute&& compute) {
  using Value = decltype(compute());
  static std::mutex mutex;
  static std::map<Key, Value> known;
  const std::lock_guard<std::mutex> lock(mutex);
  auto it = known.find(key);
  if (it == known.end()) it = known.emplace(key, compute()).first;
  return it->second;
}

// Throws unless `pointer` is `bytes`-aligned: the kernels read and write such pieces of `arg`.
inline void check_aligned(const char* op, const char* arg, const void* pointer, std::size_t bytes) {
  if (reinterpret_cast<std::uintptr_t>(pointer) % bytes != 0) {
    throw Error(op, arg, detail::misaligned_address(pointer, bytes),
                std::to_string(bytes) + "-byte aligned device memory");
  }
}

inline int current_device(const char* op) {
  int device = 0;
  check(cudaGetDevice(&device), op, "cudaGetDevice");
  return device;
}

// Makes `device` the calling thread's current one while it lives, then the one before again: for
// the plan of a call on a device that is not the current one (planning reads the current device's
// limits and occupancy, as the launch will on that device). Nothing when it already is, or when
// `device` is no CUDA device.
class ScopedCurrentDevice {
 public:
  ScopedCurrentDevice(const DeviceInfo& device, const char* op) {
    if (device.kind != DeviceKind::kCuda) return;
    const int current = current_device(op);
    if (device.index == current) return;
    check(cudaSetDevice(device.index), op, "cudaSetDevice");
    previous_ = current;
  }
  ~ScopedCurrentDevice() {
    if (previous_ >= 0) (void)cudaSetDevice(previous_);
  }
  ScopedCurrentDevice(const ScopedCurrentDevice&) = delete;
  ScopedCurrentDevice& operator=(const ScopedCurrentDevice&) = delete;

 private:
  int previous_ = -1;  // -1: unchanged
};

// What the launchers ask of the current device, read once per device.
struct DeviceLimits {
  int sm = 0;                // compute capability as major * 10 + minor (90 for sm_90)
  int multiprocessors = 0;   // SMs
  bool cooperative = false;  // takes cooperative launches
};

inline const DeviceLimits& current_device_limits(const char* op) {
  const int device = current_device(op);
  return once_per_key(device, [&] {
    const auto attribute = [&](cudaDeviceAttr which) {
      int value = 0;
      check(cudaDeviceGetAttribute(&value, which, device), op, "cudaDeviceGetAttribute");
      return value;
    };
    const int sm = attribute(cudaDevAttrComputeCapabilityMajor) * 10 + attribute(cudaDevAttrComputeCapabilityMinor);
    return DeviceLimits{sm, attribute(cudaDevAttrMultiProcessorCount), attribute(cudaDevAttrCooperativeLaunch) != 0};
  });
}

// The current device's compute capability as major * 10 + minor (90 for sm_90).
inline int current_device_sm(const char* op) { return current_device_limits(op).sm; }

// Whether a warpgroup (wgmma) kernel serves a device of compute capability `sm` (the current device's
// for a launch, the asked one for a backend's select()): the library holds sm_90a code, `sm` is 90,
// and the environment variable `env` is unset or "auto". "mma" keeps the mma.sync kernels that sm_89,
// sm_100 and sm_120 run (for comparison, and to test them on an sm_90); any other value is an error
// naming `op`.
bool wgmma_kernels_enabled(const char* op, const char* env, int sm);

// CTAs of `kernel` (`threads` threads, `smem` bytes of dynamic shared memory) that one SM of the
// current device holds at once; queried once per kernel, device and configuration, so that launchers
// may ask on every call.
template <class Kernel>
int resident_ctas_per_sm(Kernel* kernel, int threads, std::size_t smem, const char* op) {
  const std::tuple<const void*, int, int, std::size_t> key{reinterpret_cast<const void*>(kernel), current_device(op),
                                                           threads, smem};
  return once_per_key(key, [&] {
    int ctas = 0;
    check(cudaOccupancyMaxActiveBlocksPerMultiprocessor(&ctas, kernel, threads, smem), op,
          "cudaOccupancyMaxActiveBlocksPerMultiprocessor");
    return ctas;
  });
}

// Raises `kernel`'s dynamic shared-memory limit to `bytes` on the current device, once per kernel
// and device (the attribute is per device: a second GPU of the process needs its own call); returns
// `bytes`. A failure is kept too, and reported on every call.
template <class Kernel>
int allow_dynamic_smem(Kernel* kernel, int bytes, const char* op) {
  const std::pair<const void*, int> key{reinterpret_cast<const void*>(kernel), current_device(op)};
  const cudaError_t status = once_per_key(
      key, [&] { return cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, bytes); });
  check(status, op, "cudaFuncSetAttribute (dynamic shared memory)");
  return bytes;
}

}  // namespace latentkv::cuda

// Checks a CUDA runtime call; `op` names the latentkv op for the message.
#define LKV_CUDA_CHECK(op, call) ::latentkv::cuda::check((call), (op), #call)
// Checks the launch just made (configuration errors surface here; faults surface at the next sync).
#define LKV_CUDA_CHECK_LAUNCH(op) ::latentkv::cuda::check(cudaGetLastError(), (op), "kernel launch")
