// Detecting the CUDA device and choosing between kernel families (host code; linked only into CUDA
// builds).
#include <cuda_runtime_api.h>

#include <algorithm>
#include <cstdlib>
#include <cstring>
#include <string>

#include "cuda/common/arch_list.hpp"
#include "cuda/common/backend_support.hpp"
#include "cuda/common/cuda_check.hpp"
#include "latentkv/backend.hpp"

namespace latentkv::detail {

bool cuda_detect_device(DeviceInfo& info) {
  int count = 0;
  if (cudaGetDeviceCount(&count) != cudaSuccess || count == 0) {
    cudaGetLastError();  // clear the sticky "no device" error
    return false;
  }
  int device = 0;
  cudaDeviceProp prop{};
  if (cudaGetDevice(&device) != cudaSuccess || cudaGetDeviceProperties(&prop, device) != cudaSuccess) {
    cudaGetLastError();  // not left behind for the next launch's check to report as its own
    return false;
  }
  info.kind = DeviceKind::kCuda;
  info.index = device;
  info.sm = prop.major * 10 + prop.minor;
  info.name = prop.name;
  info.multiprocessors = prop.multiProcessorCount;
  return true;
}

}  // namespace latentkv::detail

namespace latentkv::cuda {

bool wgmma_kernels_enabled(const char* op, const char* env, int sm) {
#if defined(LKV_HAVE_SM90A)
  const char* choice = std::getenv(env);
  if (choice != nullptr && std::strcmp(choice, "mma") == 0) return false;
  if (choice != nullptr && choice[0] != '\0' && std::strcmp(choice, "auto") != 0) {
    throw Error(op, env, choice, "unset, \"auto\" or \"mma\"");
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
