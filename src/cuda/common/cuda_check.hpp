// src/cuda/common/cuda_check.hpp - turning CUDA errors into latentkv::Error.
#pragma once

#include <cuda_runtime_api.h>

#include <cstddef>
#include <map>
#include <mutex>
#include <string>
#include <tuple>
#include <utility>

#include "latentkv/error.hpp"

namespace latentkv::cuda {

inline void check(cudaError_t status, const char* op, const char* what) {
  if (status != cudaSuccess) {
    throw Error(op, std::string(what) + " failed: " + cudaGetErrorName(status) + " (" + cudaGetErrorString(status) + ")");
  }
}

// What the launchers ask of the current device, read once per device.
struct DeviceLimits {
  int sm = 0;                // compute capability as major * 10 + minor (90 for sm_90)
  int multiprocessors = 0;   // SMs
  bool cooperative = false;  // takes cooperative launches
};

inline const DeviceLimits& current_device_limits(const char* op) {
  static std::mutex mutex;
  static std::map<int, DeviceLimits> known;  // device -> limits (map nodes stay put: references stay valid)
  int device = 0;
  check(cudaGetDevice(&device), op, "cudaGetDevice");
  const std::lock_guard<std::mutex> lock(mutex);
  auto it = known.find(device);
  if (it == known.end()) {
    int major = 0, minor = 0, sms = 0, cooperative = 0;
    check(cudaDeviceGetAttribute(&major, cudaDevAttrComputeCapabilityMajor, device), op, "cudaDeviceGetAttribute");
    check(cudaDeviceGetAttribute(&minor, cudaDevAttrComputeCapabilityMinor, device), op, "cudaDeviceGetAttribute");
    check(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, device), op, "cudaDeviceGetAttribute");
    check(cudaDeviceGetAttribute(&cooperative, cudaDevAttrCooperativeLaunch, device), op, "cudaDeviceGetAttribute");
    it = known.emplace(device, DeviceLimits{major * 10 + minor, sms, cooperative != 0}).first;
  }
  return it->second;
}

// The current device's compute capability as major * 10 + minor (90 for sm_90).
inline int current_device_sm(const char* op) { return current_device_limits(op).sm; }

// CTAs of `kernel` (`threads` threads, `smem` bytes of dynamic shared memory) that one SM of the
// current device holds at once; queried once per kernel, device and configuration, so that launchers
// may ask on every call.
template <class Kernel>
int resident_ctas_per_sm(Kernel* kernel, int threads, std::size_t smem, const char* op) {
  static std::mutex mutex;
  static std::map<std::tuple<const void*, int, int, std::size_t>, int> known;  // (kernel, device, threads, smem)
  int device = 0;
  check(cudaGetDevice(&device), op, "cudaGetDevice");
  const std::tuple<const void*, int, int, std::size_t> key{reinterpret_cast<const void*>(kernel), device, threads, smem};
  const std::lock_guard<std::mutex> lock(mutex);
  auto it = known.find(key);
  if (it == known.end()) {
    int ctas = 0;
    check(cudaOccupancyMaxActiveBlocksPerMultiprocessor(&ctas, kernel, threads, smem), op,
          "cudaOccupancyMaxActiveBlocksPerMultiprocessor");
    it = known.emplace(key, ctas).first;
  }
  return it->second;
}

// Raises `kernel`'s dynamic shared-memory limit to `bytes` on the current device, once per kernel
// and device (the attribute is per device: a second GPU of the process needs its own call); returns
// `bytes`.
template <class Kernel>
int allow_dynamic_smem(Kernel* kernel, int bytes, const char* op) {
  static std::mutex mutex;
  static std::map<std::pair<const void*, int>, cudaError_t> done;  // (kernel, device) -> result
  int device = 0;
  check(cudaGetDevice(&device), op, "cudaGetDevice");
  const std::pair<const void*, int> key{reinterpret_cast<const void*>(kernel), device};
  cudaError_t status;
  {
    const std::lock_guard<std::mutex> lock(mutex);
    auto it = done.find(key);
    if (it == done.end()) {
      it = done.emplace(key, cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, bytes)).first;
    }
    status = it->second;
  }
  check(status, op, "cudaFuncSetAttribute (dynamic shared memory)");
  return bytes;
}

}  // namespace latentkv::cuda

// Checks a CUDA runtime call; `op` names the latentkv op for the message.
#define LKV_CUDA_CHECK(op, call) ::latentkv::cuda::check((call), (op), #call)
// Checks the launch just made (configuration errors surface here; faults surface at the next sync).
#define LKV_CUDA_CHECK_LAUNCH(op) ::latentkv::cuda::check(cudaGetLastError(), (op), "kernel launch")
