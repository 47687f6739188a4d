// src/cuda/common/device_fault.cuh - how a kernel notes a bad device-resident value in the call's
// fault record (latentkv/device_fault.hpp; the launch's side is device_fault.hpp).
#pragma once

#include <cuda_runtime.h>

#include "cuda/common/device_fault.hpp"

namespace latentkv::cuda {

// Notes a fault of `code`, the other fields as `fields` gives them (its code and op are ignored),
// unless the record holds one already: the first fault recorded stays. Any thread may call it, many
// at once. Call sites name the fields they fill:
//   record_fault(sink, DeviceFaultCode::kSeqLen, {.index = b, .value = len, .pages = max_pages, .page_size = ps});
__device__ __forceinline__ void record_fault(const FaultSink& sink, DeviceFaultCode code, const DeviceFault& fields) {
  if (sink.record == nullptr) return;
  if (atomicCAS(&sink.record->code, 0, static_cast<std::int32_t>(code)) != 0) return;
  DeviceFault* f = sink.record;
  f->op = static_cast<std::int32_t>(sink.op);
  f->index = fields.index;
  f->position = fields.position;
  f->value = fields.value;
  f->bound = fields.bound;
  f->length = fields.length;
  f->pages = fields.pages;
  f->page_size = fields.page_size;
}

}  // namespace latentkv::cuda
