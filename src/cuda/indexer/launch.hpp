// src/cuda/indexer/launch.hpp - the lightning indexer's logits over the paged fp8 key cache.
#pragma once

#include <cuda_runtime_api.h>

#include "latentkv/backend.hpp"
#include "latentkv/ops.hpp"

namespace latentkv::cuda {

// Requests per indexer_logits call: one grid row each.
inline constexpr int kMaxIndexerBatch = 65535;

// logits [B, q_len, max_len]: for visible t, sum_h w_h relu(q_h . k_t) kscale_t; -inf elsewhere.
// Arguments must be validated; lengths and block tables are read on the device.
void launch_indexer_logits(const IndexerLogitsParams& p, cudaStream_t stream);

// Indexer prefill (prefill.cpp): logits then top-k of every new token, in chunks of new tokens.
// The plan gives the chunk and the workspace for it; the launch throws Error when p.workspace is
// smaller. Arguments must be validated.
Plan plan_indexer_prefill(const IndexerPrefillParams& p);
void launch_indexer_prefill(const IndexerPrefillParams& p, cudaStream_t stream);

}  // namespace latentkv::cuda
