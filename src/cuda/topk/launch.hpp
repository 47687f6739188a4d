// src/cuda/topk/launch.hpp - top-k of each query row's visible logits, as physical slots.
#pragma once

#include <cuda_runtime_api.h>

#include <cstddef>

#include "latentkv/backend.hpp"
#include "latentkv/ops.hpp"

namespace latentkv::cuda {

// Scratch for these shapes: per query row, a histogram, counters and a candidate list.
Plan plan_topk(const TopkParams& p);

// One cooperative kernel, or a memset of the row states (left out when p.workspace_cleared) and two
// kernels; never synchronizes. Arguments must be validated and
// p.workspace must hold plan_topk(p).workspace_bytes (else Error). check_topk_call throws what the
// launch refuses before it queues anything, and queues nothing itself.
void check_topk_call(const TopkParams& p);
void launch_topk(const TopkParams& p, cudaStream_t stream);

}  // namespace latentkv::cuda
