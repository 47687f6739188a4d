// src/cuda/common/cuda_check.hpp - turning CUDA errors into latentkv::Error.
#pragma once

#include <cuda_runtime_api.h>

#include <string>

#include "latentkv/error.hpp"

namespace latentkv::cuda {

inline void check(cudaError_t status, const char* op, const char* what) {
  if (status != cudaSuccess) {
    throw Error(op, std::string(what) + " failed: " + cudaGetErrorName(status) + " (" + cudaGetErrorString(status) + ")");
  }
}

}  // namespace latentkv::cuda

// Checks a CUDA runtime call; `op` names the latentkv op for the message.
#define LKV_CUDA_CHECK(op, call) ::latentkv::cuda::check((call), (op), #call)
// Checks the launch just made (configuration errors surface here; faults surface at the next sync).
#define LKV_CUDA_CHECK_LAUNCH(op) ::latentkv::cuda::check(cudaGetLastError(), (op), "kernel launch")
