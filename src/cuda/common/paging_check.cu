// The paging check on its own (see paging_check.hpp): one CTA per request.
#include "cuda/common/paging_check.hpp"

#include <cuda_runtime.h>

#include <algorithm>

#include "cuda/common/cuda_check.hpp"
#include "cuda/common/paging_check.cuh"

namespace latentkv::cuda {
namespace {

constexpr int kThreads = 256;

__global__ void __launch_bounds__(kThreads) paging_check_kernel(const PagingCheck c) {
  for (int b = blockIdx.x; b < c.batch; b += gridDim.x) check_request_paging(c, b);
}

}  // namespace

void launch_paging_check(const PagingCheck& check, cudaStream_t stream, const char* op) {
  if (check.fault.record == nullptr || check.batch <= 0) return;
  const auto blocks = static_cast<unsigned>(std::min(check.batch, 65535));
  paging_check_kernel<<<blocks, kThreads, 0, stream>>>(check);
  LKV_CUDA_CHECK_LAUNCH(op);
}

}  // namespace latentkv::cuda
