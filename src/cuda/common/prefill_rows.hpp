// src/cuda/common/prefill_rows.hpp - each new token of a prefill as a one-token decode "request".
//
// New token r of request b (rows [cu[b], cu[b+1]) of the new tokens, n_b of them, L_b tokens in
// all) sees positions t < L_b - n_b + (r - cu[b]) + 1. Giving each token that length and its own
// copy of request b's block-table row turns any prefill into per-token decode-shaped work, with
// causality exactly each token's length. Both prefill paths (dense MLA, indexer) use it.
#pragma once

#include <cuda_runtime_api.h>

#include <cstdint>
#include <limits>
#include <string>

#include "cuda/common/device_fault.hpp"
#include "latentkv/error.hpp"
#include "latentkv/tensor.hpp"

namespace latentkv::cuda {

struct PrefillRows {
  const std::int32_t* cu_new_tokens = nullptr;  // [batch + 1]
  const std::int32_t* seq_lens = nullptr;       // [batch]
  const std::int32_t* block_table = nullptr;    // [batch, max_pages]
  int batch = 0;                      // >= 1
  int max_pages = 0;
  int page_size = 1;
  std::int64_t num_pages = 0;         // the pool's pages
  std::int64_t new_tokens = 0;        // T, the rows of q: what cu_new_tokens[batch] must be
  FaultSink fault;                    // the prefill's record and op
};

// The requests of `op`, a prefill with `new_tokens` new tokens: cu_new_tokens [B + 1], seq_lens [B]
// and block_table [B, max_pages] (device views, validated shapes), over a pool of num_pages pages.
// The kernels count requests in an int: more than INT32_MAX of them (gigabytes of lengths alone) are
// refused rather than cut down to fewer.
inline PrefillRows prefill_rows_of(const char* op, const TensorView& cu_new_tokens, const TensorView& seq_lens,
                                   const TensorView& block_table, int page_size, std::int64_t num_pages,
                                   std::int64_t new_tokens, const FaultSink& fault) {
  if (seq_lens.size(0) > std::numeric_limits<std::int32_t>::max()) {
    throw Error(op, "seq_lens", std::to_string(seq_lens.size(0)) + " requests (B)",
                "at most " + std::to_string(std::numeric_limits<std::int32_t>::max()) + " requests per call on a GPU");
  }
  PrefillRows in;
  in.cu_new_tokens = cu_new_tokens.as<const std::int32_t>();
  in.seq_lens = seq_lens.as<const std::int32_t>();
  in.block_table = block_table.as<const std::int32_t>();
  in.batch = static_cast<int>(seq_lens.size(0));
  in.max_pages = static_cast<int>(block_table.size(1));
  in.page_size = page_size;
  in.num_pages = num_pages;
  in.new_tokens = new_tokens;
  in.fault = fault;
  return in;
}

// For new tokens first .. first + rows - 1: row_lens [rows] and row_table [rows, max_pages]. Bad
// device data (cu not ascending, lengths beyond the table) gives clamped, in-bounds values; the
// launch for first = 0 checks every request as the reference does (cu_new_tokens, lengths, the
// pages the lengths use) and notes a fault in `in.fault`, so that the kernels the rows feed need
// not. `op` names the calling op in launch errors.
void launch_prefill_rows(const PrefillRows& in, std::int64_t first, std::int64_t rows, std::int32_t* row_lens,
                         std::int32_t* row_table, cudaStream_t stream, const char* op);

// New tokens need requests to belong to: throws Error naming `op` when there are none (B = 0). The
// launchers below check it; a prefill may check it before it queues anything.
void check_has_requests(const PrefillRows& in, const char* op);

// New tokens first .. first + rows - 1 of a prefill in groups of up to `group`, each group of one
// request (a decode "request" of group x H query rows: decode_common.cuh, indexer/logits.cu). With
// c_b = cu[b] clamped into the window, request b owns group indices [(c_b - first) / group + b, +
// ceil(n_b / group)) of the group_slots(rows, group, B) = rows / group + B (n_b its new tokens in
// the window; the indices between are empty groups), and group index i sits at slot slots - 1 - i,
// so that a request's last, longest groups launch first. Slot z gets spans[z] = {its first new
// token - first, tokens} (tokens 0: empty), group_lens[z] = what its last new token sees and
// group_table[z] = its request's block-table row. Bad device data gives clamped, in-bounds values
// (with offsets not ascending from 0 to T, groups may overlap or miss new tokens: their rows are
// then written twice or not at all); the launch for first = 0 checks every request as
// launch_prefill_rows does, so that a call with a fault record names the bad offset.
inline std::int64_t group_slots(std::int64_t rows, int group, std::int64_t batch) { return rows / group + batch; }
void launch_prefill_groups(const PrefillRows& in, std::int64_t first, std::int64_t rows, int group,
                           std::int32_t* group_lens, std::int32_t* group_table, int2* spans, cudaStream_t stream,
                           const char* op);

// The same checks of every request without building rows, for a prefill of no new tokens (whose
// cu_new_tokens must then be all zeros; with no requests, the one offset). Nothing when in.fault
// has no record.
void launch_prefill_checks(const PrefillRows& in, cudaStream_t stream, const char* op);

}  // namespace latentkv::cuda
