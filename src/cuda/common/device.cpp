// Detecting the CUDA device and choosing between kernel families (host code; linked only into CUDA
// builds).
#include <cuda_runtime_api.h>

#include <algorithm>
#include <cstdlib>
#include <cstring>
#include <map>
#include <mutex>
#include <string>

#include "cuda/common/arch_list.hpp"
#include "cuda/common/backend_support.hpp"
#include "cuda/common/cuda_check.hpp"
#include "latentkv/backend.hpp"

namespace latentkv::detail {

namespace {

// What detect_device reports of a device that cannot change while the process runs, read once per
// device: cudaGetDeviceProperties reads every property there is (milliseconds on some drivers), and
// run() asks for the device on every call that names none. A failed read is not kept.
struct DeviceFacts {
  int sm = 0;
  std::string name;
  int multiprocessors = 0;
};

const DeviceFacts* device_facts(int device) {
  static std::mutex mutex;
  static std::map<int, DeviceFacts> known;  // nodes stay put: a pointer to one stays valid
  const std::lock_guard<std::mutex> lock(mutex);
  if (const auto it = known.find(device); it != known.end()) return &it->second;
  cudaDeviceProp prop{};
  if (cudaGetDeviceProperties(&prop, device) != cudaSuccess) {
    cudaGetLastError();  // not left behind for the next launch's check to report as its own
    return nullptr;
  }
  return &known.emplace(device, DeviceFacts{prop.major * 10 + prop.minor, prop.name, prop.multiProcessorCount})
              .first->second;
}

}  // namespace

bool cuda_detect_device(DeviceInfo& info) {
  // The count is fixed for the process (CUDA_VISIBLE_DEVICES is read once, at the runtime's start).
  static const int count = [] {
    int n = 0;
    if (cudaGetDeviceCount(&n) != cudaSuccess) {
      cudaGetLastError();  // clear the sticky "no device" error
      n = 0;
    }
    return n;
  }();
  if (count == 0) return false;
  int device = 0;
  if (cudaGetDevice(&device) != cudaSuccess) {
    cudaGetLastError();
    return false;
  }
  const DeviceFacts* facts = device_facts(device);
  if (facts == nullptr) return false;
  info.kind = DeviceKind::kCuda;
  info.index = device;
  info.sm = facts->sm;
  info.name = facts->name;
  info.multiprocessors = facts->multiprocessors;
  return true;
}

}  // namespace latentkv::detail

namespace latentkv::cuda {

bool wgmma_kernels_enabled(const char* op, const char* env, int sm) {
#if defined(LKV_HAVE_SM90A)
  const char* choice = std::getenv(env);
  if (choice != nullptr && std::strcmp(choice, "mma") == 0) return false;
  if (choice != nullptr && choice[0] != '\0' && std::strcmp(choice, "auto") != 0) {
    throw Error(op, env, quoted_value(choice), "unset, \"auto\" or \"mma\"");
  }
  return sm == 90;
#else
  (void)op, (void)env, (void)sm;
  return false;
#endif
}

std::string arch_problem(int sm) {
  const std::string built = LKV_CUDA_ARCH_LIST;
  if (arch_list_runs_on(built, sm)) return {};
  std::string listed = built;
  std::replace(listed.begin(), listed.end(), ',', ';');
  return "the library holds no code for sm_" + std::to_string(sm) + " (built with LKV_CUDA_ARCHS=\"" + listed +
         "\"; add the GPU's architecture there)";
}

}  // namespace latentkv::cuda
