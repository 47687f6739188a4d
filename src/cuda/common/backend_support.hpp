// src/cuda/common/backend_support.hpp - what every CUDA backend's select() and launchers share.
#pragma once

#include <cuda_runtime_api.h>

#include <string>

#include "cuda/common/cuda_check.hpp"
#include "latentkv/backend.hpp"

namespace latentkv::cuda {

inline constexpr int kMinSm = 89;  // cvt.e4m3x2 and the 99 KB shared-memory plan

inline cudaStream_t stream_of(const ExecContext& c) { return static_cast<cudaStream_t>(c.stream); }

// The device a call launches on (the current one): its views and caches must be there.
inline Device launch_device(const char* op) { return Device::cuda(current_device(op)); }

// Why the library's device code cannot run on a GPU of compute capability `sm` (90 for sm_90), from
// the architectures it was built for (LKV_CUDA_ARCHS, read by arch_list_runs_on, arch_list.hpp);
// empty when it can.
std::string arch_problem(int sm);

// Support common to every CUDA backend; an empty string means supported.
inline std::string device_problem(const Problem& p) {
  if (p.device.kind != DeviceKind::kCuda) return "needs a CUDA GPU (device is " + p.device.name + ")";
  if (p.device.sm < kMinSm) {
    return "needs sm_" + std::to_string(kMinSm) + " or newer (device is sm_" + std::to_string(p.device.sm) + ")";
  }
  if (std::string why = arch_problem(p.device.sm); !why.empty()) return why;
  if (p.heads > kMaxHeads) return "heads " + std::to_string(p.heads) + " outside 1 .. " + std::to_string(kMaxHeads);
  if (p.q_len > kMaxDecodeQLen) {
    return "q_len " + std::to_string(p.q_len) + " outside 1 .. " + std::to_string(kMaxDecodeQLen);
  }
  return {};
}

// Refuses, naming the argument, what a plan() would otherwise count or divide with (backend_support.cpp):
// every CUDA backend's plan() (the cuda backend's and the cast baselines') calls it first.
void check_plan_extents(const OpArgs& args, const DeviceInfo& device);

// Query rows of one request's decode: q_len x heads (each at least 1 when not fixed yet).
inline int rows_of(const Problem& p) { return (p.q_len > 0 ? p.q_len : 1) * (p.heads > 0 ? p.heads : 1); }

}  // namespace latentkv::cuda
