// The paging check on its own (see paging_check.hpp): CTAs per request over its logits' parts.
#include "cuda/common/paging_check.hpp"

#include <cuda_runtime.h>

#include <algorithm>

#include "cuda/common/chained_launch.cuh"
#include "cuda/common/cuda_check.hpp"
#include "cuda/common/paging_check.cuh"

namespace latentkv::cuda {
namespace {

constexpr int kThreads = 256;
constexpr int kLogitsPerThread = 8;                         // loads in flight per thread
constexpr int kLogitsPerCta = kThreads * kLogitsPerThread;  // a part of a row's logits
constexpr int kMostParts = 1024;

// Part `part` of `parts` of the logits request b's rows see (positions t < L - q_len + i + 1 of row
// i), when its length is one the reference goes on to scan with: every thread's loads go out
// together before any is tested, so that a part costs one round trip.
__device__ void check_visible_logits(const PagingCheck& c, int b, int part, int parts) {
  const std::int32_t len = c.seq_lens[b];
  if (len < 0 || len > static_cast<std::int64_t>(c.max_pages) * c.page_size || len > c.max_len) return;
  const std::int64_t stride = static_cast<std::int64_t>(parts) * kThreads;
  for (int i = 0; i < c.q_len; ++i) {
    const float* row = c.logits + (static_cast<std::int64_t>(b) * c.q_len + i) * c.max_len;
    const std::int64_t visible = max(len - c.q_len + i + 1, 0);
    for (std::int64_t t0 = static_cast<std::int64_t>(part) * kThreads + threadIdx.x; t0 < visible;
         t0 += stride * kLogitsPerThread) {
      float v[kLogitsPerThread];
#pragma unroll
      for (int u = 0; u < kLogitsPerThread; ++u) v[u] = t0 + u * stride < visible ? row[t0 + u * stride] : 0.0f;
#pragma unroll
      for (int u = 0; u < kLogitsPerThread; ++u) {
        if (isnan(v[u])) {
          record_fault(c.fault, DeviceFaultCode::kLogit, {.index = b, .position = t0 + u * stride, .length = i});
        }
      }
    }
  }
}

// Grid (parts of a row's logits, requests): the first part's CTA also checks the request's length
// and pages. One CTA per request scanning a 32K-logit row took about 23 us on an H200 (a glm5 decode
// step with every op given a record: 1.8 ms more); in parts of 2048 logits, one round trip each.
__global__ void __launch_bounds__(kThreads) paging_check_kernel(const PagingCheck c) {
  wait_for_previous_kernels();
  allow_next_kernel();  // one short pass: the op's own kernel may take its place as soon as it ends
  for (int b = blockIdx.y; b < c.batch; b += gridDim.y) {
    if (blockIdx.x == 0) check_request_paging(c, b);
    if (c.logits != nullptr) check_visible_logits(c, b, static_cast<int>(blockIdx.x), static_cast<int>(gridDim.x));
  }
}

}  // namespace

void launch_paging_check(const PagingCheck& check, cudaStream_t stream, const char* op) {
  if (check.fault.record == nullptr || check.batch <= 0) return;
  const std::int64_t parts =
      check.logits == nullptr || check.max_len <= 0
          ? 1
          : std::min<std::int64_t>((check.max_len + kLogitsPerCta - 1) / kLogitsPerCta, kMostParts);
  const dim3 grid(static_cast<unsigned>(parts), static_cast<unsigned>(std::min(check.batch, 65535)));
  launch_chained(op, paging_check_kernel, grid, kThreads, 0, stream, false, check);
}

}  // namespace latentkv::cuda
