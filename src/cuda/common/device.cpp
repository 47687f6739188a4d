// Detecting the CUDA device (host code; linked only into CUDA builds).
#include <cuda_runtime_api.h>

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
