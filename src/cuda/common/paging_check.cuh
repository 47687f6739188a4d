// src/cuda/common/paging_check.cuh - the device side of paging_check.hpp, for kernels that make the
// same checks on their way (prefill_rows.cu, the decode and indexer kernels).
#pragma once

#include <cuda_runtime.h>

#include <cstdint>

#include "cuda/common/device_fault.cuh"
#include "cuda/common/paging_check.hpp"

namespace latentkv::cuda {

// Position t >= 0 lies on page t / page_size of its block-table row, at t % page_size: a shift and a
// mask when page_shift (page_shift_of) is not -1. A division by a value known only at run time is
// about 30 instructions, and the tile loops take one or two per token.
__device__ __forceinline__ int position_page(int t, int page_size, int page_shift) {
  return page_shift >= 0 ? t >> page_shift : t / page_size;
}
__device__ __forceinline__ int position_in_page(int t, int page_size, int page_shift) {
  return page_shift >= 0 ? t & (page_size - 1) : t % page_size;
}

// Request b's length `len` outside 0 .. max_pages x page_size, or past max_len (>= 0), as a fault.
__device__ __forceinline__ void check_length(const FaultSink& sink, int b, std::int32_t len, int max_pages,
                                             int page_size, std::int64_t max_len = -1) {
  if (len < 0 || len > static_cast<std::int64_t>(max_pages) * page_size) {
    record_fault(sink, DeviceFaultCode::kSeqLen, {.index = b, .value = len, .pages = max_pages, .page_size = page_size});
  } else if (max_len >= 0 && len > max_len) {
    record_fault(sink, DeviceFaultCode::kSeqLenColumns, {.index = b, .value = len, .bound = max_len});
  }
}

// Page `page` at place p of request b's block-table row (a page its length `len` uses) outside
// 0 .. num_pages - 1, as a fault.
__device__ __forceinline__ void check_page(const FaultSink& sink, int b, std::int64_t p, std::int32_t page,
                                           std::int64_t num_pages, std::int32_t len, int page_size) {
  if (page < 0 || page >= num_pages) {
    record_fault(sink, DeviceFaultCode::kBlockTablePage,
                 {.index = b, .position = p, .value = page, .bound = num_pages, .length = len, .page_size = page_size});
  }
}

// The pages of a request of length `len` that the reference checks: those the length uses, none
// for a length outside 0 .. max_pages x page_size (the reference stops at the length), so that one
// bad length is one fault whatever the rest of its block-table row holds.
__device__ __forceinline__ std::int64_t pages_to_check(std::int32_t len, int max_pages, int page_size) {
  if (len < 0 || len > static_cast<std::int64_t>(max_pages) * page_size) return 0;
  return (static_cast<std::int64_t>(len) + page_size - 1) / page_size;
}

// Request b's length and the pages it uses, by a whole CTA (its threads share the pages).
__device__ __forceinline__ void check_request_paging(const PagingCheck& c, int b) {
  const std::int32_t len = c.seq_lens[b];
  if (threadIdx.x == 0) check_length(c.fault, b, len, c.max_pages, c.page_size, c.max_len);
  const std::int64_t used = pages_to_check(len, c.max_pages, c.page_size);
  const std::int32_t* row = c.block_table + static_cast<std::int64_t>(b) * c.max_pages;
  for (std::int64_t p = threadIdx.x; p < used; p += blockDim.x) {
    check_page(c.fault, b, p, row[p], c.num_pages, len, c.page_size);
  }
}

}  // namespace latentkv::cuda
