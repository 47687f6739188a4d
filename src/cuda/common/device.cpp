// Detecting the CUDA device and choosing between kernel families (host code; linked only into CUDA
// builds).
#include <cuda_runtime_api.h>

#include <cstdlib>
#include <cstring>

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
  cudaGetDevice(&device);
  cudaDeviceProp prop{};
  if (cudaGetDeviceProperties(&prop, device) != cudaSuccess) return false;
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

}  // namespace latentkv::cuda
