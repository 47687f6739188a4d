// src/cuda/mla/launch.hpp - planning and launching dense MLA decode.
#pragma once

#include <cuda_runtime_api.h>

#include <string>

#include "latentkv/backend.hpp"
#include "latentkv/ops.hpp"

namespace latentkv::cuda {

// The split-KV schedule for these shapes on a device with `multiprocessors` SMs. Depends on the
// batch, rows (q_len x heads) and block-table capacity only, never on the current lengths.
Plan plan_mla_decode(const MlaDecodeParams& p, int multiprocessors);

// Launches decode (and the split combine when p.num_splits > 1). Arguments must be validated;
// p.num_splits must come from plan_mla_decode and p.workspace hold its workspace_bytes.
void launch_mla_decode(const MlaDecodeParams& p, cudaStream_t stream);

// The kernel instance a call with these shapes runs, for printing.
std::string mla_decode_kernel_name(KvDtype dtype, int rows);

}  // namespace latentkv::cuda
