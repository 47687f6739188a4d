// src/cuda/indexer/launch.hpp - the lightning indexer's logits over the paged fp8 key cache.
#pragma once

#include <cuda_runtime_api.h>

#include "latentkv/ops.hpp"

namespace latentkv::cuda {

// logits [B, q_len, max_len]: for visible t, sum_h w_h relu(q_h . k_t) kscale_t; -inf elsewhere.
// Arguments must be validated; lengths and block tables are read on the device.
void launch_indexer_logits(const IndexerLogitsParams& p, cudaStream_t stream);

}  // namespace latentkv::cuda
