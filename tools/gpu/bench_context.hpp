// tools/gpu/bench_context.hpp - what every GPU benchmark starts with: the device (a CUDA GPU or an
// error), a stream, the L2 size, and the bandwidth ceilings measured at the start of the run.
#pragma once

#include <cuda_runtime_api.h>

#include <cstddef>
#include <string>
#include <variant>

#include "bench.hpp"
#include "gpu/measure.hpp"
#include "latentkv/backend.hpp"
#include "latentkv/error.hpp"

namespace latentkv::tools::gpu {

struct BenchContext {
  DeviceInfo device;
  cudaStream_t stream = nullptr;
  std::int64_t l2_bytes = 0;
  BenchReport report;  // device name and ceilings filled in

  BenchContext() {
    device = detect_device();
    if (device.kind != DeviceKind::kCuda) throw Error("bench", "device", "cpu", "a CUDA GPU (bench times GPU kernels)");
    cuda_ok(cudaStreamCreate(&stream), "stream");
    cudaDeviceProp prop{};
    cuda_ok(cudaGetDeviceProperties(&prop, device.index), "properties");
    l2_bytes = prop.l2CacheSize;
    report.device = device.name + " (sm_" + std::to_string(device.sm) + ", " +
                    std::to_string(device.multiprocessors) + " SMs)";
    const Ceilings c = measure_ceilings(std::size_t{4} << 30, device.multiprocessors, stream);
    report.read_gbps = c.read_gbps;
    report.copy_gbps = c.copy_gbps;
  }
  BenchContext(const BenchContext&) = delete;
  BenchContext& operator=(const BenchContext&) = delete;
  ~BenchContext() {
    if (stream) cudaStreamDestroy(stream);
  }
};

// Copies a plan's split count and its workspace into the op `args` holds (ops without a schedule
// ignore it).
inline void attach_plan(OpArgs& args, const Plan& plan, const DeviceMemory& workspace) {
  std::visit(
      [&](auto& p) {
        if constexpr (requires { p.num_splits; }) {
          p.num_splits = plan.num_splits;
          p.workspace = workspace.get();
          p.workspace_bytes = workspace.bytes();
        }
      },
      args);
}

}  // namespace latentkv::tools::gpu
