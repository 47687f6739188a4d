// Each new token's visible length and block-table row (see prefill_rows.hpp).
#include "cuda/common/prefill_rows.hpp"

#include <cuda_runtime.h>

#include <algorithm>
#include <cstdint>

#include "cuda/common/cuda_check.hpp"
#include "cuda/common/paging_check.cuh"
#include "latentkv/error.hpp"

namespace latentkv::cuda {
namespace {

constexpr int kThreads = 128;

// Whether request b's new tokens, cu[b + 1] - cu[b], are 0 .. its length.
__device__ __forceinline__ bool count_ok(const PrefillRows& in, int b) {
  const std::int64_t n = static_cast<std::int64_t>(in.cu_new_tokens[b + 1]) - in.cu_new_tokens[b];
  return n >= 0 && n <= in.seq_lens[b];
}

// The reference's checks of request b (validate.cpp: check_paging_values, check_new_tokens), by a
// whole CTA: its length within the block table, the pages that length uses within the pool, its new
// tokens within its length; request 0's CTA checks cu[0], the last request's cu[B]. A fault goes to
// in.fault. The reference names the first of these in its order; a negative length also breaks its
// request's count, and one bad offset cu[b] breaks two counts (requests b - 1 and b) or a count and
// cu[B]: a check defers to the one before it in that order when that one fails too, so that one bad
// value gives the reference's fault.
__device__ void check_request(const PrefillRows& in, int b) {
  if (threadIdx.x == 0) {
    const std::int32_t lo = in.cu_new_tokens[b], hi = in.cu_new_tokens[b + 1], len = in.seq_lens[b];
    if (b == 0 && lo != 0) record_fault(in.fault, DeviceFaultCode::kNewTokensStart, {.value = lo});
    const bool ok = count_ok(in, b);
    if (!ok && len >= 0 && (b == 0 ? lo == 0 : count_ok(in, b - 1))) {
      record_fault(in.fault, DeviceFaultCode::kNewTokensCount, {.index = b + 1, .value = hi, .bound = lo, .length = len});
    }
    if (b == in.batch - 1 && hi != in.new_tokens && ok) {
      record_fault(in.fault, DeviceFaultCode::kNewTokensEnd, {.index = in.batch, .value = hi, .bound = in.new_tokens});
    }
  }
  PagingCheck paging;
  paging.block_table = in.block_table;
  paging.seq_lens = in.seq_lens;
  paging.batch = in.batch;
  paging.max_pages = in.max_pages;
  paging.page_size = in.page_size;
  paging.num_pages = in.num_pages;
  paging.fault = in.fault;
  check_request_paging(paging, b);
}

// One CTA per new token first + blockIdx.x: its request b (the last b with cu[b] <= r), its length,
// and request b's block-table row.
__global__ void __launch_bounds__(kThreads)
    prefill_rows_kernel(const PrefillRows in, std::int64_t first, std::int32_t* row_lens, std::int32_t* row_table) {
  __shared__ int request;
  if (first == 0 && in.fault.record != nullptr) {  // the first launch checks every request
    for (int b = blockIdx.x; b < in.batch; b += gridDim.x) check_request(in, b);
  }
  const std::int64_t r = first + blockIdx.x;
  if (threadIdx.x == 0) {
    int lo = 0, hi = in.batch;
    while (hi - lo > 1) {
      const int mid = (lo + hi) / 2;
      if (in.cu_new_tokens[mid] <= r) lo = mid;
      else hi = mid;
    }
    request = lo;
    const std::int64_t capacity = static_cast<std::int64_t>(in.max_pages) * in.page_size;
    const std::int64_t length = min(static_cast<std::int64_t>(max(in.seq_lens[lo], 0)), capacity);
    const std::int64_t new_tokens = static_cast<std::int64_t>(in.cu_new_tokens[lo + 1]) - in.cu_new_tokens[lo];
    const std::int64_t visible = length - new_tokens + (r - in.cu_new_tokens[lo]) + 1;
    row_lens[blockIdx.x] = static_cast<std::int32_t>(max(std::int64_t{0}, min(visible, length)));
  }
  __syncthreads();
  const std::int32_t* from = in.block_table + static_cast<std::int64_t>(request) * in.max_pages;
  std::int32_t* to = row_table + static_cast<std::int64_t>(blockIdx.x) * in.max_pages;
  for (int p = threadIdx.x; p < in.max_pages; p += kThreads) to[p] = from[p];
}

// One CTA per group slot (prefill_rows.hpp, launch_prefill_groups).
__global__ void __launch_bounds__(kThreads)
    prefill_groups_kernel(const PrefillRows in, std::int64_t first, std::int64_t rows, int group,
                          std::int32_t* group_lens, std::int32_t* group_table, int2* spans) {
  __shared__ int request;
  if (first == 0 && in.fault.record != nullptr) {  // the first launch checks every request
    for (int b = blockIdx.x; b < in.batch; b += gridDim.x) check_request(in, b);
  }
  const std::int64_t z = blockIdx.x, slots = gridDim.x;
  if (threadIdx.x == 0) {
    const std::int64_t index = slots - 1 - z;  // the group index this slot holds
    // cu clamped into [0, T], then into the window, so that bad offsets still give in-bounds rows.
    const auto cu = [&](int b) { return min(max(static_cast<std::int64_t>(in.cu_new_tokens[b]), std::int64_t{0}), in.new_tokens); };
    const auto in_window = [&](int b) { return min(max(cu(b), first), first + rows) - first; };
    const auto first_index = [&](int b) { return in_window(b) / group + b; };
    int lo = 0, hi = in.batch;  // the last request whose first group index is <= index
    while (hi - lo > 1) {
      const int mid = (lo + hi) / 2;
      if (first_index(mid) <= index) lo = mid;
      else hi = mid;
    }
    const std::int64_t start = in_window(lo), n = max(in_window(lo + 1) - start, std::int64_t{0});
    const std::int64_t k = index - first_index(lo);  // the group's place among request lo's groups in the window
    const std::int64_t row = start + k * group;
    const std::int64_t count = k >= 0 && k * group < n ? min(static_cast<std::int64_t>(group), n - k * group) : 0;
    // What the group's last new token sees: the request's length less its new tokens after it.
    const std::int64_t capacity = static_cast<std::int64_t>(in.max_pages) * in.page_size;
    const std::int64_t length = min(static_cast<std::int64_t>(max(in.seq_lens[lo], 0)), capacity);
    const std::int64_t after = max(cu(lo + 1), cu(lo)) - (first + row + count);
    const std::int64_t visible = length - after;
    spans[z] = make_int2(static_cast<int>(count > 0 ? row : 0), static_cast<int>(count));
    group_lens[z] = count > 0 ? static_cast<std::int32_t>(max(std::int64_t{0}, min(visible, length))) : 0;
    request = lo;
  }
  __syncthreads();
  // Every slot gets its table row, an empty group's too (the kernels may look its first pages up).
  const std::int32_t* from = in.block_table + static_cast<std::int64_t>(request) * in.max_pages;
  std::int32_t* to = group_table + z * in.max_pages;
  for (int p = threadIdx.x; p < in.max_pages; p += kThreads) to[p] = from[p];
}

__global__ void __launch_bounds__(kThreads) prefill_checks_kernel(const PrefillRows in) {
  if (in.batch == 0) {  // no requests: cu_new_tokens is [cu[0]], which must be 0 (its start and its end)
    const std::int32_t start = in.cu_new_tokens[0];
    if (threadIdx.x == 0 && start != 0) record_fault(in.fault, DeviceFaultCode::kNewTokensStart, {.value = start});
    return;
  }
  for (int b = blockIdx.x; b < in.batch; b += gridDim.x) check_request(in, b);
}

}  // namespace

void check_has_requests(const PrefillRows& in, const char* op) {
  if (in.batch < 1) throw Error(op, "cu_new_tokens", "B = 0", "B >= 1 requests for new tokens");
}

void launch_prefill_groups(const PrefillRows& in, std::int64_t first, std::int64_t rows, int group,
                           std::int32_t* group_lens, std::int32_t* group_table, int2* spans, cudaStream_t stream,
                           const char* op) {
  if (rows <= 0) return;
  check_has_requests(in, op);
  if (group < 1) throw Error(op, "group", std::to_string(group), ">= 1 new tokens a group");
  const std::int64_t slots = group_slots(rows, group, in.batch);
  if (slots > INT32_MAX) throw Error(op, "q", std::to_string(slots) + " groups", "fewer than 2^31 per launch");
  prefill_groups_kernel<<<static_cast<unsigned>(slots), kThreads, 0, stream>>>(in, first, rows, group, group_lens,
                                                                                group_table, spans);
  LKV_CUDA_CHECK_LAUNCH(op);
}

void launch_prefill_checks(const PrefillRows& in, cudaStream_t stream, const char* op) {
  if (in.fault.record == nullptr) return;
  prefill_checks_kernel<<<static_cast<unsigned>(std::clamp(in.batch, 1, 65535)), kThreads, 0, stream>>>(in);
  LKV_CUDA_CHECK_LAUNCH(op);
}

void launch_prefill_rows(const PrefillRows& in, std::int64_t first, std::int64_t rows, std::int32_t* row_lens,
                         std::int32_t* row_table, cudaStream_t stream, const char* op) {
  if (rows <= 0) return;
  check_has_requests(in, op);
  if (rows > INT32_MAX) throw Error(op, "q", std::to_string(rows) + " new tokens", "fewer than 2^31 per launch");
  prefill_rows_kernel<<<static_cast<unsigned>(rows), kThreads, 0, stream>>>(in, first, row_lens, row_table);
  LKV_CUDA_CHECK_LAUNCH(op);
}

}  // namespace latentkv::cuda
