// src/cuda/common/device_fault.hpp - where a launch's faults go (see latentkv/device_fault.hpp);
// device_fault.cuh has the kernels' side.
#pragma once

#include "cuda/common/cuda_check.hpp"
#include "latentkv/device_fault.hpp"

namespace latentkv::cuda {

// The call's record (null: none) and the op the caller called. Kernels take it as an argument of
// its own, beside their arguments struct: a field more in that struct changes how ptxas schedules
// the kernels that never use it (on sm_90a it serialized the wgmma decode's tensor-core pipeline).
struct FaultSink {
  DeviceFault* record = nullptr;
  DeviceFaultOp op = DeviceFaultOp::kNone;
  std::int64_t row_base = 0;  // a sliced launch's first row in the caller's tensors (sparse prefill)
};

// Throws unless `record` (a call's `fault`; null: none) is 8-byte aligned; `name` is the op's. A
// launch then passes FaultSink{record, its op} to its kernels.
inline void check_fault_record(const DeviceFault* record, const char* name) {
  if (record != nullptr) check_aligned(name, "fault", record, 8);
}

}  // namespace latentkv::cuda
