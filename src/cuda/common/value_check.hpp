// src/cuda/common/value_check.hpp - the reference's check of an input tensor's values (no
// non-finite bf16 or float, no NaN fp8 code), as a small kernel of its own, for the ops whose
// kernels do not check that input as they stage it (mla_prefill and indexer_prefill, whose
// per-token kernels run without the record; the indexer when it has no logits columns to
// compute). Faults go to the call's record (latentkv/device_fault.hpp).
#pragma once

#include <cuda_runtime_api.h>

#include <cstdint>

#include "cuda/common/device_fault.hpp"
#include "latentkv/tensor.hpp"

namespace latentkv::cuda {

struct ValueCheck {
  const void* data = nullptr;  // contiguous elements of `dtype`: kBF16, kFP8E4M3 or kF32
  DType dtype = DType::kBF16;
  std::int64_t count = 0;
  DeviceFaultCode code = DeviceFaultCode::kNone;  // what a bad element is (kQuery, kIndexerQuery, kWeight)
  FaultSink fault;
};

inline ValueCheck value_check_of(const TensorView& v, DeviceFaultCode code, const FaultSink& fault) {
  return ValueCheck{v.data, v.dtype, v.numel(), code, fault};
}

// Every element of the tensor; nothing when the sink has no record or the tensor no elements. `op`
// names the calling op in launch errors.
void launch_value_check(const ValueCheck& check, cudaStream_t stream, const char* op);

}  // namespace latentkv::cuda
