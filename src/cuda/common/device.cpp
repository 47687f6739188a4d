// Detecting the CUDA device and choosing between kernel families (host code; linked only into CUDA
// builds).
#include <cuda_runtime_api.h>

#include <algorithm>
#include <cctype>
#include <cstdlib>
#include <cstring>
#include <sstream>
#include <string>

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

std::string arch_problem(int sm) {
  const std::string built = LKV_CUDA_ARCH_LIST;
  std::istringstream entries(built);
  for (std::string entry; std::getline(entries, entry, ',');) {
    if (entry == "native" || entry == "all" || entry == "all-major") return {};  // resolved by CMake, not known here
    if (entry.empty() || !std::isdigit(static_cast<unsigned char>(entry[0]))) continue;
    std::size_t digits = 0;
    const int arch = std::stoi(entry, &digits);
    const std::string rest = entry.substr(digits);
    if (rest == "a" || rest == "a-real") {
      if (sm == arch) return {};
    } else if (rest == "f" || rest == "f-real") {  // a family: the same major, this minor or a later one
      if (sm / 10 == arch / 10 && sm >= arch) return {};
    } else {
      const bool code = rest != "-virtual", ptx = rest != "-real";
      if (code && sm / 10 == arch / 10 && sm >= arch) return {};
      if (ptx && sm >= arch) return {};
    }
  }
  std::string listed = built;
  std::replace(listed.begin(), listed.end(), ',', ';');
  return "the library holds no code for sm_" + std::to_string(sm) + " (built with LKV_CUDA_ARCHS=\"" + listed +
         "\"; add the GPU's architecture there)";
}

}  // namespace latentkv::cuda
