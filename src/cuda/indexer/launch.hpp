// src/cuda/indexer/launch.hpp - the lightning indexer's logits over the paged fp8 key cache.
#pragma once

#include <cuda_runtime_api.h>

#include <string>

#include "latentkv/backend.hpp"
#include "latentkv/ops.hpp"

namespace latentkv::cuda {

// Requests per indexer_logits call: one grid row each.
inline constexpr int kMaxIndexerBatch = static_cast<int>(kMaxGpuRequests);

// logits [B, q_len, max_len]: for visible t, sum_h w_h relu(q_h . k_t) kscale_t; -inf elsewhere.
// Arguments must be validated; lengths and block tables are read on the device. The plan's
// workspace (one claim counter per request) is optional: the launch throws Error when a workspace
// is given but smaller. check_indexer_logits_call throws what the launch refuses before it queues
// anything, and queues nothing itself.
Plan plan_indexer_logits(const IndexerLogitsParams& p);
void check_indexer_logits_call(const IndexerLogitsParams& p);
void launch_indexer_logits(const IndexerLogitsParams& p, cudaStream_t stream);

// Whether indexer_logits runs its warpgroup (wgmma) kernel for caches of `page_size` tokens per
// page on a device of compute capability `sm`: sm_90 with the library's sm_90a code, pages as
// kIndexerWgmmaPages says, unless the environment sets LATENTKV_INDEXER_KERNEL=mma. Else the
// mma.sync kernel.
bool indexer_uses_wgmma(int page_size, int sm);
// The page sizes the wgmma kernel takes, for reports; kIndexerWgmmaPageSize is one of them.
inline constexpr const char* kIndexerWgmmaPages = "pages of a multiple of 4 tokens";
inline constexpr int kIndexerWgmmaPageSize = 64;
// The kernel's name for reports: "indexer_logits<...>"; the prefill's: "indexer_prefill = ...".
std::string indexer_logits_kernel_name(int page_size, int sm);
std::string indexer_prefill_kernel_name(int page_size, int sm);

// An indexer prefill's new tokens in groups of up to `tokens` (<= kMaxDecodeQLen) on the wgmma
// kernel (prefill.cpp): for launch_indexer_logits_groups, p.q [rows, 1, Hi, 128], p.weights and
// p.logits [rows, 1, max_len] are the chunk's new tokens'; p.block_table [groups, max_pages] and
// p.seq_lens [groups] the groups' (prefill_rows.hpp, launch_prefill_groups), and group b's rows are
// those of its new tokens [spans[b].x, spans[b].x + spans[b].y), causal among them. No fault
// record (the prefill checks its requests, q and the weights), no claims.
struct IndexerGroups {
  const int2* spans = nullptr;  // [groups] device memory
  int groups = 0;
  int tokens = 1;
};
void launch_indexer_logits_groups(const IndexerLogitsParams& p, const IndexerGroups& g, cudaStream_t stream);

// Indexer prefill (prefill.cpp): logits then top-k of every new token, in chunks of new tokens.
// The plan gives the chunk and the workspace for it; the launch throws Error when p.workspace is
// smaller. Arguments must be validated. check_indexer_prefill_call throws what the launch refuses
// before it queues anything (its chunks' launches included), and queues nothing itself.
Plan plan_indexer_prefill(const IndexerPrefillParams& p);
void check_indexer_prefill_call(const IndexerPrefillParams& p);
void launch_indexer_prefill(const IndexerPrefillParams& p, cudaStream_t stream);

}  // namespace latentkv::cuda
