// src/cuda/common/paging_check.hpp - the reference's checks of lengths and block-table pages
// (validate.cpp: check_paging_values), made on the device for ops whose own kernels do not make
// them, with faults noted in the call's record (latentkv/device_fault.hpp).
#pragma once

#include <cuda_runtime_api.h>

#include <bit>
#include <cstdint>

#include "cuda/common/device_fault.hpp"
#include "latentkv/tensor.hpp"

namespace latentkv::cuda {

// log2 of a page size (>= 1) that is a power of two, as engines use, else -1: the kernels then find
// a position's page and its place in it by a shift and a mask (position_page in paging_check.cuh).
inline int page_shift_of(int page_size) {
  const auto size = static_cast<unsigned>(page_size);
  return std::has_single_bit(size) ? std::countr_zero(size) : -1;
}

struct PagingCheck {
  const std::int32_t* block_table = nullptr;  // [batch, max_pages]
  const std::int32_t* seq_lens = nullptr;     // [batch]
  int batch = 0;
  int max_pages = 0;
  int page_size = 1;
  std::int64_t num_pages = 0;  // a page id must be below it
  std::int64_t max_len = -1;   // a length must not pass it (the logits' columns); -1: no such bound
  // The top-k's logits [batch, q_len, max_len], or null: no NaN at a position a row sees (positions
  // t < L - q_len + i + 1 of row i), for the requests whose length passed its checks.
  const float* logits = nullptr;
  int q_len = 1;
  FaultSink fault;
};

// The check of an op's block table [B, max_pages] and lengths [B] (device views, validated shapes).
inline PagingCheck paging_check_of(const TensorView& block_table, const TensorView& seq_lens, int page_size,
                                   std::int64_t num_pages, std::int64_t max_len, const FaultSink& fault) {
  PagingCheck c;
  c.block_table = block_table.as<const std::int32_t>();
  c.seq_lens = seq_lens.as<const std::int32_t>();
  c.batch = static_cast<int>(seq_lens.size(0));
  c.max_pages = static_cast<int>(block_table.size(1));
  c.page_size = page_size;
  c.num_pages = num_pages;
  c.max_len = max_len;
  c.fault = fault;
  return c;
}

// One small kernel: request b's length within 0 .. max_pages x page_size (and max_len), the pages
// that length uses within 0 .. num_pages - 1 and, given logits, the logits its rows see, for every
// request. Nothing when the sink has no record. `op` names the calling op in launch errors.
void launch_paging_check(const PagingCheck& check, cudaStream_t stream, const char* op);

}  // namespace latentkv::cuda
