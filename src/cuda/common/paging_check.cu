// The paging check on its own (see paging_check.hpp): one CTA per request.
#include "cuda/common/paging_check.hpp"

#include <cuda_runtime.h>

#include <algorithm>

#include "cuda/common/cuda_check.hpp"
#include "cuda/common/paging_check.cuh"

namespace latentkv::cuda {
namespace {

constexpr int kThreads = 256;

// The logits request b's rows see, when its length is one the reference goes on to scan with.
__device__ void check_visible_logits(const PagingCheck& c, int b) {
  const std::int32_t len = c.seq_lens[b];
  if (len < 0 || len > static_cast<std::int64_t>(c.max_pages) * c.page_size || len > c.max_len) return;
  for (int i = 0; i < c.q_len; ++i) {
    const float* row = c.logits + (static_cast<std::int64_t>(b) * c.q_len + i) * c.max_len;
    const int visible = max(len - c.q_len + i + 1, 0);
    for (int t = threadIdx.x; t < visible; t += kThreads) {
      if (isnan(row[t])) record_fault(c.fault, DeviceFaultCode::kLogit, {.index = b, .position = t, .length = i});
    }
  }
}

__global__ void __launch_bounds__(kThreads) paging_check_kernel(const PagingCheck c) {
  for (int b = blockIdx.x; b < c.batch; b += gridDim.x) {
    check_request_paging(c, b);
    if (c.logits != nullptr) check_visible_logits(c, b);
  }
}

}  // namespace

void launch_paging_check(const PagingCheck& check, cudaStream_t stream, const char* op) {
  if (check.fault.record == nullptr || check.batch <= 0) return;
  const auto blocks = static_cast<unsigned>(std::min(check.batch, 65535));
  paging_check_kernel<<<blocks, kThreads, 0, stream>>>(check);
  LKV_CUDA_CHECK_LAUNCH(op);
}

}  // namespace latentkv::cuda
