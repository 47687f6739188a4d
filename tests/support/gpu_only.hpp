// tests/support/gpu_only.hpp - a test-only backend that selects a kernel only for a CUDA device, as
// the cuda backend does, on every build (with or without CUDA): what a call on the CPU, or a plan
// made for it, says when a backend cannot run there. Launching its kernel is a test failure.
#pragma once

#include <gtest/gtest.h>

#include <string>
#include <string_view>

#include "latentkv/backend.hpp"

namespace latentkv::testing {

class GpuOnly final : public Backend {
 public:
  std::string_view name() const override { return "gpu_only"; }
  std::string_view description() const override { return "test-only: selects only for a CUDA device"; }
  int preference() const override { return 0; }
  Selection select(const Problem& problem) const override {
    if (problem.device.kind != DeviceKind::kCuda) return Selection::no("needs a GPU (device is " + problem.device.name + ")");
    return Selection::yes(Kernel{"gpu_only", [](const OpArgs&, const ExecContext&) { ADD_FAILURE() << "launched gpu_only"; }});
  }
};

// A CUDA device as a selection sees it, for plans made on a machine without one.
inline DeviceInfo test_gpu() { return DeviceInfo{DeviceKind::kCuda, 90, 0, "test gpu", 132}; }

}  // namespace latentkv::testing
